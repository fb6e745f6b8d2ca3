"""What a first read of an adapter costs alone and while another thread holds the GIL (the cold-start row).

A first read is what a loader thread does for an adapter it has not verified yet (``AdapterLoader._read`` with
``verified=False``): header and config checks, the tensors read, hashed (``version_id``) and validated, the slot
image built. Every call that releases the GIL (a torch op, a torch tensor freed, a large ``hashlib`` update or
numpy op, a ``pread``) must take it back; while the engine thread runs Python it keeps the GIL until the switch
interval forces it to let go, so each re-take waits up to ``sys.getswitchinterval()``. Here the main thread spins
in pure Python (as a busy engine thread) while the read runs on a second thread.

Reported (medians, ms): ``alone`` (the read on its thread, the main thread idle); ``contended`` (the main thread
spinning) under ``sys.setswitchinterval(--switch-interval-ms)`` (default 5 ms, CPython's; a per-tensor read of
the default adapter took ~30 s per read there, so ``--switch-interval-ms 1`` shortens such runs: each wait scales
with it); ``handoffs ~= (contended - alone) / switch interval``, the GIL re-takes the read waited for (an
estimate: the read's own Python work is shared with the spinning thread too); ``aten_ops``: ATen ops dispatched
by one read (``TorchDispatchMode``; views included), ``compute_ops`` of them not views; ``hash_updates``:
``hashlib.sha256`` calls given >= 2048 bytes (those release the GIL).

Defaults: Llama-2-7B shapes, q_proj/v_proj, r=16, bf16 files served in bf16, 32 layers (128 tensors, 16.8 MB),
files in the page cache. Usage: ``python benchmarks/diag_first_read.py [--targets all] [--layers 32]
[--file-dtype float32] [--reps 5] [--contended-reps 3] [--switch-interval-ms 5]`` (CPU; the device is not used).
Writes ``$OUT/first-read-<targets>-L<layers>-<file dtype>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LLAMA2_7B, git_commit, make_random_adapter, out_dir  # noqa: E402

from loraplex.adapters.identity import compute_version_id  # noqa: E402
from loraplex.adapters.loader import AdapterLoader  # noqa: E402
from loraplex.adapters.lora_request import LoRARequest  # noqa: E402
from loraplex.adapters.spec import BaseModelSpec  # noqa: E402

_VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "as_strided", "alias", "t", "transpose", "permute",
             "unsqueeze", "squeeze", "expand", "unfold", "narrow", "detach", "view_as", "unflatten", "split",
             "lift_fresh", "_reshape_alias", "reshape"}


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while entered (this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _count_hash_updates(read) -> int:
    """``hashlib.sha256`` updates (or initial data) of >= 2048 bytes (they release the GIL) during ``read()``."""
    real = hashlib.sha256
    count = 0

    class Counting:
        def __init__(self, data=b"") -> None:
            nonlocal count
            count += memoryview(data).nbytes >= 2048
            self._digest = real(data)

        def update(self, data) -> None:
            nonlocal count
            count += memoryview(data).nbytes >= 2048
            self._digest.update(data)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    hashlib.sha256 = Counting
    try:
        read()
    finally:
        hashlib.sha256 = real
    return count


def _on_thread(fn, *, spin: bool) -> float:
    """ms of ``fn()`` run on a new thread while this thread idles (``spin`` False) or spins in Python."""
    result: dict[str, float] = {}

    def body() -> None:
        t0 = time.perf_counter()
        fn()
        result["ms"] = 1e3 * (time.perf_counter() - t0)

    thread = threading.Thread(target=body)
    thread.start()
    if spin:
        x = 0
        while thread.is_alive():
            for _ in range(1000):
                x += 1
    thread.join()
    return result["ms"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="qv", choices=("qv", "all"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--file-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--contended-reps", type=int, default=3)
    ap.add_argument("--switch-interval-ms", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    config = dict(LLAMA2_7B, num_hidden_layers=args.layers)
    targets = ("q_proj", "v_proj") if args.targets == "qv" else ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj")
    h, i = config["hidden_size"], config["intermediate_size"]
    shapes = {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "o_proj": (h, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    spec = BaseModelSpec(num_layers=args.layers, hidden_size=h, module_shapes={m: shapes[m] for m in targets},
                         architecture="LlamaForCausalLM", vocab_size=config["vocab_size"])
    folder = make_random_adapter(Path(tempfile.mkdtemp()) / "a", config, args.rank, seed=1, targets=targets,
                                 dtype=getattr(torch, args.file_dtype))
    from safetensors.torch import load_file

    version_id = compute_version_id(json.loads((folder / "adapter_config.json").read_text()),
                                    load_file(str(folder / "adapter_model.safetensors")))
    request = LoRARequest("a", 1, str(folder), version_id=version_id)
    loader = AdapterLoader(spec, args.rank, torch.bfloat16, torch.device("cpu"), 4, background_loads=False,
                           max_loads_in_flight=1, num_loader_threads=1, pin_host_cache=False, page_rows=args.rank)

    def read() -> None:
        loader._read(request, version_id, None)  # a first read (not verified): hashed and validated

    read()  # warm-up (page cache, lazy imports)
    with _OpCounter() as counter:
        read()
    hash_updates = _count_hash_updates(read)
    alone = [_on_thread(read, spin=False) for _ in range(args.reps)]
    interval_s = args.switch_interval_ms / 1e3
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        contended = [_on_thread(read, spin=True) for _ in range(args.contended_reps)]
    finally:
        sys.setswitchinterval(old_interval)
    alone_ms, contended_ms = statistics.median(alone), statistics.median(contended)
    result = {
        "commit": git_commit(), "targets": list(targets), "layers": args.layers, "rank": args.rank,
        "file_dtype": args.file_dtype, "tensors": 2 * args.layers * len(targets),
        "file_MB": round((folder / "adapter_model.safetensors").stat().st_size / 1e6, 2),
        "switch_interval_ms": args.switch_interval_ms,
        "alone_ms": round(alone_ms, 1), "contended_ms": round(contended_ms, 1),
        "handoffs": round((contended_ms - alone_ms) / args.switch_interval_ms),
        "aten_ops": sum(counter.ops.values()),
        "compute_ops": sum(n for op, n in counter.ops.items() if op not in _VIEW_OPS),
        "hash_updates": hash_updates,
        "top_ops": dict(sorted(counter.ops.items(), key=lambda kv: -kv[1])[:12]),
        "alone_all_ms": [round(t, 1) for t in alone], "contended_all_ms": [round(t, 1) for t in contended],
    }
    print(json.dumps(result, indent=1))
    out = out_dir() / f"first-read-{args.targets}-L{args.layers}-{args.file_dtype}.json"
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
