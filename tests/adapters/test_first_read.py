"""The first read of an adapter (``read_new_slot_image``: the loader's unverified read) and ``load_peft_adapter``
work in batches: they give what the per-tensor implementation they replaced gave (kept below as the oracle:
``peft_format._build_adapter`` and the loader's ``slot_image_from_adapter`` as of 8adad64) - the same version id,
value checks, errors, warnings and slot-image bytes - and their torch op and hash calls, each a GIL hand-off on a
loader thread, do not grow with the number of layers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from loraplex.adapters import (
    AdapterFormatError,
    AdapterIncompatibleError,
    BaseModelSpec,
    LoRAAdapter,
    LoRAWeight,
    inspect_peft_adapter,
    load_peft_adapter,
)
from loraplex.adapters.adapter import VocabWeights
from loraplex.adapters.slot_image import read_new_slot_image, read_slot_image, slot_image_from_adapter
from loraplex.adapters.tensor_file import SAFETENSORS_NAME

SPEC = BaseModelSpec(num_layers=32, hidden_size=16,
                     module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)}, architecture="Toy")
PARENT = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}


# ------------------------------------------------------------------ the per-tensor oracle (before batching)


def _oracle_version_id(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(b"loraplex-adapter-v1\0")

    def framed(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    framed(json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        framed(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        framed(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def oracle_load(folder: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """``load_peft_adapter`` as it was: every tensor read on its own, checked and converted one by one."""
    layout = inspect_peft_adapter(folder, spec, max_rank)
    tensors = load_file(str(folder / SAFETENSORS_NAME))
    rank_max = {}
    for plan in layout.modules + layout.vocab_lora:
        rank_max[plan.a_name] = tensors[plan.a_name].abs().amax(dim=1)
        rank_max[plan.b_name] = tensors[plan.b_name].abs().amax(dim=0)
    for name in sorted(tensors):
        values = rank_max.get(name)
        if not bool(torch.isfinite(tensors[name] if values is None else values).all()):
            raise AdapterFormatError(f"tensor {name!r} contains NaN or Inf values")
    fp32_max, limit = torch.finfo(torch.float32).max, torch.finfo(dtype).max
    for plan in layout.modules + layout.vocab_lora:
        where = f"layer {plan.layer} {plan.module}" if plan.layer >= 0 else plan.module
        scaling = plan.hyper.scaling
        if not abs(scaling) <= fp32_max:
            raise AdapterIncompatibleError(
                f"adapter_config.json: {where}: scaling {scaling:.4g} (lora_alpha={plan.hyper.alpha:.4g}, "
                f"{plan.hyper.rank_field}={plan.hyper.rank}) is not finite in float32")
        a_max, b_max = rank_max[plan.a_name].double(), rank_max[plan.b_name].double()
        bound = abs(scaling) * float((a_max * b_max).sum())
        largest = max(float(a_max.max()), float(b_max.max()))
        if not (bound <= limit and largest <= limit):
            raise AdapterIncompatibleError(
                f"{where}: scaling * lora_B @ lora_A is not finite in {str(dtype).removeprefix('torch.')} "
                f"(scaling {scaling:.4g}, |lora_A| and |lora_B| up to {largest:.4g}: entries up to {bound:.4g}, "
                f"largest finite value {limit:.4g})")
    for module, name in layout.full_modules:
        largest = float(tensors[name].double().abs().max())
        if not largest <= limit:
            raise AdapterIncompatibleError(
                f"tensor {name!r} ({module} copy of modules_to_save) has values up to {largest:.4g}, not finite in "
                f"{str(dtype).removeprefix('torch.')} (largest finite value {limit:.4g})")
    weights = {(plan.layer, plan.module): LoRAWeight(
        a=tensors[plan.a_name].float(), b=tensors[plan.b_name].float(), scaling=plan.hyper.scaling,
        magnitude=None if plan.magnitude_name is None else tensors[plan.magnitude_name].float())
        for plan in layout.modules}
    zero = [key for key, weight in weights.items() if not bool(weight.b.any())]
    warnings: tuple[str, ...] = ()
    if zero and len(zero) == len(weights):
        warnings = (f"all {len(weights)} lora_B matrices are zero: the adapter does not change the model (untrained?)",)
    elif zero:
        warnings = (f"{len(zero)} of {len(weights)} lora_B matrices are zero (first: layer {zero[0][0]} {zero[0][1]}): "
                    "those modules do not change the model",)
    vocab = None
    if layout.vocab_lora or layout.full_modules:
        lora = {plan.module: LoRAWeight(a=tensors[plan.a_name].float(), b=tensors[plan.b_name].float(),
                                        scaling=plan.hyper.scaling) for plan in layout.vocab_lora}
        vocab = VocabWeights(embed=lora.get("embed_tokens"), head=lora.get("lm_head"),
                             full={module: tensors[name].float() for module, name in layout.full_modules})
    return LoRAAdapter(version_id=_oracle_version_id(layout.config.raw, tensors), rank=layout.rank,
                       alpha=layout.config.lora_alpha, use_rslora=layout.config.use_rslora,
                       target_modules=layout.target_modules, weights=weights, use_dora=layout.config.use_dora,
                       size_bytes=layout.size_bytes, warnings=warnings, path=layout.path, vocab=vocab)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    """Byte for byte (dtype and shape included): -0.0 is not 0.0 here."""
    if x is None or y is None:
        return x is None and y is None
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))


def assert_same_image(new, old) -> None:
    """Equal slot images: version, rank, pages, each module's lora_A / lora_B pages, scalings, DoRA magnitudes,
    vocabulary parts (the buffer's module order may differ: a verbatim image keeps the file's)."""
    assert (new.version_id, new.max_rank, new.page_rows) == (old.version_id, old.max_rank, old.page_rows)
    assert new.offsets.keys() == old.offsets.keys() and new.magnitude.keys() == old.magnitude.keys()
    assert new.data.dtype == old.data.dtype and _same(new.scaling, old.scaling)
    for key in old.offsets:
        assert _same(new.a(key), old.a(key)) and _same(new.b_pages(key), old.b_pages(key)), key
    for key in old.magnitude:
        assert _same(new.magnitude[key], old.magnitude[key]), key
    assert (new.vocab is None) == (old.vocab is None)
    if old.vocab is not None:
        for part in ("embed_a_t", "embed_b", "head_a", "head_b", "scaling"):
            assert _same(getattr(new.vocab, part), getattr(old.vocab, part)), part
        assert new.vocab.full.keys() == old.vocab.full.keys()
        assert all(_same(new.vocab.full[m], old.vocab.full[m]) for m in old.vocab.full)


def assert_same_adapter(new: LoRAAdapter, old: LoRAAdapter) -> None:
    assert (new.version_id, new.rank, new.alpha, new.use_rslora, new.target_modules, new.size_bytes, new.warnings,
            new.use_dora) == (old.version_id, old.rank, old.alpha, old.use_rslora, old.target_modules, old.size_bytes,
                              old.warnings, old.use_dora)
    assert list(new.weights) == list(old.weights)
    for key, weight in old.weights.items():
        got = new.weights[key]
        assert _same(got.a, weight.a) and _same(got.b, weight.b) and _same(got.magnitude, weight.magnitude), key
        assert got.scaling == weight.scaling
    assert (new.vocab is None) == (old.vocab is None)
    if old.vocab is not None:
        for part in ("embed", "head"):
            mine, theirs = getattr(new.vocab, part), getattr(old.vocab, part)
            assert (mine is None) == (theirs is None)
            if theirs is not None:
                assert _same(mine.a, theirs.a) and _same(mine.b, theirs.b) and mine.scaling == theirs.scaling
        assert new.vocab.full.keys() == old.vocab.full.keys()
        assert all(_same(new.vocab.full[m], old.vocab.full[m]) for m in old.vocab.full)


def _outcome(fn):
    try:
        return fn(), None
    except (AdapterFormatError, AdapterIncompatibleError) as exc:
        return None, (type(exc), str(exc))


def check_against_oracle(folder: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype,
                         page_rows: int | None) -> tuple:
    """The first read and ``load_peft_adapter`` against the oracle: the same result or the same error.
    Returns (first-read image, oracle error)."""
    expected, error = _outcome(lambda: oracle_load(folder, spec, max_rank, dtype))
    loaded, load_error = _outcome(lambda: load_peft_adapter(folder, spec, max_rank, serving_dtype=dtype))
    read, read_error = _outcome(lambda: read_new_slot_image(folder, spec, max_rank, dtype, pin_memory=False,
                                                            page_rows=page_rows))
    assert load_error == read_error == error
    if error is not None:
        return None, error
    assert_same_adapter(loaded, expected)
    image, stored = read
    old = slot_image_from_adapter(expected, spec, max_rank, dtype, pin_memory=False, page_rows=page_rows)
    assert_same_image(image, old)
    # a verified re-read (read_slot_image) gives the same buffer, byte for byte
    again = read_slot_image(inspect_peft_adapter(folder, spec, max_rank), spec, max_rank, dtype,
                            version_id=image.version_id, pin_memory=False, page_rows=page_rows, stored=stored)
    assert again.offsets == image.offsets and _same(again.data, image.data)
    assert_same_image(again, image)
    return image, None


# ------------------------------------------------------------------ hand-written adapters


def _name(layer: int, module: str, kind: str) -> str:
    suffix = "lora_magnitude_vector" if kind == "M" else f"lora_{kind}.weight"
    return f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}.{suffix}"


def write(folder: Path, layers: int = 2, *, r: int = 4, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          dtypes: dict[str, torch.dtype] | None = None, edit=None, **config) -> Path:
    """A PEFT folder with q_proj, v_proj and down_proj LoRA on ``layers`` layers (``rank_pattern`` honoured);
    ``dtypes``: stored dtype per tensor name suffix; ``edit(tensors)`` changes values (stored dtypes) before saving."""
    generator = torch.Generator().manual_seed(seed)
    ranks = config.get("rank_pattern", {})
    tensors = {}
    for layer in range(layers):
        for module, (fin, fout) in SPEC.module_shapes.items():
            rank = ranks.get(module, r)
            tensors[_name(layer, module, "A")] = torch.randn(rank, fin, generator=generator)
            tensors[_name(layer, module, "B")] = torch.randn(fout, rank, generator=generator)
    for name, tensor in tensors.items():
        chosen = next((d for suffix, d in (dtypes or {}).items() if name.endswith(suffix)), dtype)
        tensors[name] = tensor.to(chosen).contiguous()
    if edit is not None:
        edit(tensors)
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2.0 * r, "target_modules": list(SPEC.module_shapes),
         "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "use_rslora": False, **config}))
    save_file(tensors, str(folder / SAFETENSORS_NAME))
    return folder


Q0_A, Q0_B, V1_B = _name(0, "q_proj", "A"), _name(0, "q_proj", "B"), _name(1, "v_proj", "B")


def _set(name: str, index: tuple, value: float):
    def edit(tensors):
        tensors[name][index] = value
    return edit


def _fill(name: str, value: float):
    def edit(tensors):
        tensors[name].fill_(value)
    return edit


def _zero(*names: str):
    def edit(tensors):
        for name in names:
            tensors[name].zero_()
    return edit


# (write kwargs, serving dtype, pool rank, page rows)
HAND_WRITTEN = {
    "bf16-verbatim": (dict(), torch.bfloat16, 4, 4),
    "fp32-file-served-bf16": (dict(dtype=torch.float32), torch.bfloat16, 8, None),
    "fp32-file-served-fp16": (dict(dtype=torch.float32), torch.float16, 4, 4),
    "mixed-dtypes-f64": (dict(dtypes={"lora_A.weight": torch.float64, "q_proj.lora_B.weight": torch.float16}),
                         torch.bfloat16, 8, 2),
    "ranks-below-pool-paged": (dict(rank_pattern={"v_proj": 3, "down_proj": 1}), torch.bfloat16, 8, 2),
    "rslora-alpha-pattern": (dict(use_rslora=True, alpha_pattern={"q_proj": 3.0}), torch.float32, 4, None),
    "negative-zero": (dict(edit=_set(Q0_A, (0, 0), -0.0)), torch.bfloat16, 4, 4),
    "zero-b-one": (dict(edit=_zero(V1_B)), torch.bfloat16, 4, 4),
    "zero-b-all": (dict(edit=_zero(*[_name(layer, m, "B") for layer in range(2) for m in SPEC.module_shapes])),
                   torch.bfloat16, 4, 4),
    # float64 lora_B: |b| <= 2**-150 rounds to 0 in float32 (a zero-B warning); 7.1e-46 > 2**-150 does not
    "tiny-f64-b-is-zero-in-fp32": (dict(dtype=torch.float64, edit=_fill(V1_B, 7.0e-46)), torch.float32, 4, None),
    "tiny-f64-b-not-zero": (dict(dtype=torch.float64, edit=lambda t: (_fill(V1_B, 7.0e-46)(t),
                                                                      _set(V1_B, (1, 1), -7.1e-46)(t))),
                            torch.float32, 4, None),
    "nan-one-tensor": (dict(edit=_set(V1_B, (3, 2), float("nan"))), torch.bfloat16, 4, 4),
    "inf-in-two-first-by-name": (dict(edit=lambda t: (_set(V1_B, (0, 0), float("inf"))(t),
                                                     _set(Q0_A, (1, 1), -float("inf"))(t))), torch.bfloat16, 4, 4),
    "scaled-overflow-fp16": (dict(dtype=torch.float32, edit=_set(Q0_B, (2, 2), 3e4)), torch.float16, 4, 4),
    "factor-overflow-bf16": (dict(dtype=torch.float64, edit=_set(Q0_B, (0, 0), 1e39)), torch.bfloat16, 4, None),
}


@pytest.mark.parametrize("case", list(HAND_WRITTEN))
def test_first_read_equals_the_per_tensor_oracle(tmp_path, case, caplog):
    kwargs, dtype, max_rank, page_rows = HAND_WRITTEN[case]
    folder = write(tmp_path / case, **kwargs)
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters.peft_format"):
        image, error = check_against_oracle(folder, SPEC, max_rank, dtype, page_rows)
    expect_error = case.startswith(("nan", "inf", "scaled-overflow", "factor-overflow"))
    assert (error is not None) == expect_error
    if case.startswith(("nan", "inf")):
        assert error[0] is AdapterFormatError
        assert (V1_B if case.startswith("nan") else Q0_A) in error[1]  # the first tensor in name order
    if case.endswith("overflow-fp16") or case.endswith("overflow-bf16"):
        assert error[0] is AdapterIncompatibleError
    zero_b = any("lora_B matrices are zero" in record.getMessage() for record in caplog.records)
    assert zero_b == (case.startswith("zero-b") or case == "tiny-f64-b-is-zero-in-fp32")


# ------------------------------------------------------------------ PEFT-saved adapters


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("kwargs,dtype,page_rows", [
    (dict(r=4, lora_alpha=8, target_modules=ALL, use_dora=True, seed=3), torch.bfloat16, 4),
    (dict(r=4, lora_alpha=8, target_modules=ALL, use_dora=True, seed=3), torch.float32, 2),
    (dict(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True, rank_pattern={"v_proj": 2},
          alpha_pattern={"o_proj": 3}), torch.bfloat16, 2),
    (dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"], rank_pattern={"lm_head": 2}),
     torch.bfloat16, 4),
    (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"]),
     torch.float16, None),
], ids=["dora-bf16", "dora-fp32-paged", "rslora-patterns", "vocab-lora", "modules-to-save"])
def test_peft_adapters_first_read_equals_the_oracle(peft_adapter, spec, kwargs, dtype, page_rows):
    folder, _ = peft_adapter(**kwargs)
    image, error = check_against_oracle(folder, spec, 8, dtype, page_rows)
    assert error is None
    if kwargs.get("use_dora"):
        assert len(image.magnitude) == 2 * len(ALL)
    if "modules_to_save" in kwargs or "embed_tokens" in kwargs["target_modules"]:
        assert image.vocab is not None


def _edited_copy(source: Path, folder: Path, edit) -> Path:
    shutil.copytree(source, folder)
    tensors = {name: tensor.clone() for name, tensor in load_file(str(folder / SAFETENSORS_NAME)).items()}
    edit(tensors)
    save_file(tensors, str(folder / SAFETENSORS_NAME))
    return folder


def test_dora_magnitude_nan_and_full_copy_overflow_errors_equal_the_oracle(peft_adapter, spec, tmp_path):
    dora, _ = peft_adapter(r=4, lora_alpha=8, target_modules=ALL, use_dora=True, seed=3)
    magnitude = sorted(load_file(str(dora / SAFETENSORS_NAME)))[-1]
    assert magnitude.endswith("lora_magnitude_vector")
    folder = _edited_copy(dora, tmp_path / "dora", lambda t: t[magnitude].__setitem__(3, float("nan")))
    _, error = check_against_oracle(folder, spec, 8, torch.bfloat16, 4)
    assert error == (AdapterFormatError, f"tensor {magnitude!r} contains NaN or Inf values")

    saved, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            modules_to_save=["lm_head", "embed_tokens"])
    head = next(name for name in load_file(str(saved / SAFETENSORS_NAME)) if name.endswith("lm_head.weight"))
    folder = _edited_copy(saved, tmp_path / "saved", lambda t: t[head].__setitem__((5, 5), 1e6))
    _, error = check_against_oracle(folder, spec, 8, torch.float16, None)
    assert error[0] is AdapterIncompatibleError and "copy of modules_to_save" in error[1]


# ------------------------------------------------------------------ batched: calls independent of the layer count


class _Ops(TorchDispatchMode):
    """Counts ATen ops dispatched: (all, views). Every op call, and every tensor it leaves behind (a tensor's
    deallocation releases the GIL too), can cost a loader thread a GIL hand-off."""

    VIEWS = {"select", "slice", "view", "reshape", "_reshape_alias", "_unsafe_view", "alias", "as_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.count = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.views += func.overloadpacket.__name__ in self.VIEWS
        return func(*args, **(kwargs or {}))


def _calls(fn, monkeypatch) -> tuple[int, int, int, int]:
    """(ATen ops dispatched, of which views, sha256 calls given >= 2 KiB (each releases the GIL), preadv calls)
    of ``fn()``."""
    hashes = preads = 0
    real_sha, real_preadv = hashlib.sha256, os.preadv

    class CountingSha:
        def __init__(self, data=b"") -> None:
            nonlocal hashes
            hashes += memoryview(data).nbytes >= 2048
            self._digest = real_sha(data)

        def update(self, data) -> None:
            nonlocal hashes
            hashes += memoryview(data).nbytes >= 2048
            self._digest.update(data)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    def counting_preadv(*args):
        nonlocal preads
        preads += 1
        return real_preadv(*args)

    with monkeypatch.context() as patch:
        patch.setattr(hashlib, "sha256", CountingSha)
        patch.setattr(os, "preadv", counting_preadv)
        with _Ops() as ops:
            fn()
    return ops.count, ops.views, hashes, preads


@pytest.mark.parametrize("dtype,page_rows,pattern", [(torch.bfloat16, 4, {}), (torch.bfloat16, 4, {"v_proj": 2}),
                                                    (torch.float32, 2, {"v_proj": 2})],
                         ids=["verbatim", "padded", "converted-paged"])
def test_first_read_calls_do_not_grow_with_the_layers(tmp_path, monkeypatch, dtype, page_rows, pattern):
    """A 2-layer and a 32-layer adapter (6 and 96 modules) cost a first read the same torch ops, hash calls and
    reads: the checks, the hash and the image work on stacks of all modules of one shape (the per-tensor first
    read made ~34 ATen ops per module). ``load_peft_adapter`` adds two views per module (its ``LoRAWeight``s)."""
    counts = {}
    for layers in (2, 32):
        folder = write(tmp_path / f"L{layers}", layers, r=4, rank_pattern=pattern)
        read_new_slot_image(folder, SPEC, 8, dtype, pin_memory=False, page_rows=page_rows)  # warm-up
        counts[layers] = (
            _calls(lambda: read_new_slot_image(folder, SPEC, 8, dtype, pin_memory=False, page_rows=page_rows),
                   monkeypatch),
            _calls(lambda: load_peft_adapter(folder, SPEC, 8, serving_dtype=dtype), monkeypatch),
        )
    (read_2, load_2), (read_32, load_32) = counts[2], counts[32]
    assert read_2 == read_32, counts
    ops, _, hashes, preads = read_32
    assert ops <= 25 * 3 and hashes == 1 and preads == 1, counts  # 3 groups (module shapes); verbatim: 12 ops
    assert load_32[0] - load_2[0] == load_32[1] - load_2[1] == 2 * 3 * (32 - 2), counts  # views only
    assert load_32[2:] == (1, 1), counts


def test_a_verbatim_re_read_copies_no_stacked_factors(tmp_path, monkeypatch):
    """A re-read whose image is the file's data verbatim (every factor stored in the slot dtype at the pool's rank,
    one page) takes the factors from the one ``pread`` into the image: no stacked copy of them (``gather_rows``),
    which took half of a 16.8 MB adapter's re-read; the image equals the first read's."""
    import loraplex.adapters.tensor_file as tensor_file

    folder = write(tmp_path / "a", 32, r=8)
    first, _ = read_new_slot_image(folder, SPEC, 8, torch.bfloat16, pin_memory=False)
    gathers = []
    real = tensor_file.gather_rows
    monkeypatch.setattr(tensor_file, "gather_rows", lambda *args: gathers.append(1) or real(*args))
    again = read_slot_image(inspect_peft_adapter(folder, SPEC, 8), SPEC, 8, torch.bfloat16,
                            version_id=first.version_id, pin_memory=False, check_finite=False)
    assert gathers == []
    assert torch.equal(again.data, first.data) and torch.equal(again.scaling, first.scaling)


# ------------------------------------------------------------------ refusals found in review


def test_inf_against_a_zero_lora_b_column_and_float64_overflow_raise_no_numpy_warning(tmp_path):
    """The bound's products ``max|A[k, :]| * max|B[:, k]|`` are taken before the finiteness check: Inf * 0 (an Inf
    in lora_A, PEFT's all-zero initial lora_B) and a float64 overflow gave numpy RuntimeWarnings, raised instead
    of the ``AdapterError`` where warnings are errors."""
    import warnings

    inf_a = write(tmp_path / "inf", edit=lambda t: (_set(Q0_A, (0, 0), float("inf"))(t), _zero(Q0_B)(t)))
    huge = write(tmp_path / "huge", dtype=torch.float64,
                 edit=lambda t: (_set(Q0_A, (0, 0), 1e300)(t), _set(Q0_B, (0, 0), 1e300)(t)))
    for folder, error in ((inf_a, AdapterFormatError), (huge, AdapterIncompatibleError)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(error):
                load_peft_adapter(folder, SPEC, 4, serving_dtype=torch.bfloat16)
            with pytest.raises(error):
                read_new_slot_image(folder, SPEC, 4, torch.bfloat16, pin_memory=False)


@pytest.mark.parametrize("shape", ["[4, 1e400]", "[4.9, 16]", '["4", "16"]', "[4, true]"])
def test_a_header_shape_that_is_not_integers_is_a_format_error(tmp_path, shape):
    """``stored_tensors`` reads shapes as the safetensors library does (integers): 1e400 raised OverflowError (not
    an ``AdapterError``: an upload rewritten between the library's parse and this one), 4.9 was read as 4."""
    from loraplex.adapters.tensor_file import stored_tensors

    path = write(tmp_path / "a") / SAFETENSORS_NAME
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header[Q0_A]["shape"] = "@"
    text = json.dumps(header).replace('"@"', shape).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    with pytest.raises(AdapterFormatError, match="unreadable header"):
        stored_tensors(path)


def test_a_dora_magnitude_out_of_float32_range_is_refused_by_load_peft_adapter_too(peft_adapter, spec, tmp_path):
    """A float64 magnitude beyond float32's range is Inf as served (``SlotImage.magnitude`` fp32): the first read
    refuses it, and so does ``load_peft_adapter`` (``validate_adapter_dir`` checks uploads with it), which had
    returned an adapter holding an Inf magnitude."""
    dora, _ = peft_adapter(r=4, lora_alpha=8, target_modules=ALL, use_dora=True, seed=3)
    magnitude = sorted(load_file(str(dora / SAFETENSORS_NAME)))[-1]

    def edit(tensors):
        tensors[magnitude] = tensors[magnitude].double()
        tensors[magnitude][0] = 1e39

    folder = _edited_copy(dora, tmp_path / "dora", edit)
    message = f"tensor {magnitude!r} contains NaN or Inf values"
    with pytest.raises(AdapterFormatError, match=message.replace(".", r"\.")):
        load_peft_adapter(folder, spec, 8, serving_dtype=torch.float32)
    with pytest.raises(AdapterFormatError, match=message.replace(".", r"\.")):
        read_new_slot_image(folder, spec, 8, torch.float32, pin_memory=False)


@pytest.mark.parametrize("reader", ["read_new_slot_image", "load_peft_adapter"])
def test_a_file_replaced_between_its_header_and_its_data_is_refused(tmp_path, monkeypatch, reader):
    """The header and the data are read through two opens: a same-size file with another adapter's tensors in
    another order, put in place (``os.replace``) between them, would give tensors at the old header's offsets in
    the new file's bytes (found by review: accepted, with an id of neither file). Refused, naming the change."""
    import loraplex.adapters.tensor_file as tensor_file

    a, b = write(tmp_path / "a", 2, seed=1), write(tmp_path / "b", 2, seed=2)
    tensors = load_file(str(b / SAFETENSORS_NAME))
    raw = (b / SAFETENSORS_NAME).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])[::-1]
    blob, reordered = b"", {}
    for name in names:  # b's tensors, the last first
        data = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        reordered[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"],
                           "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(reordered, separators=(",", ":")).encode()
    assert len(text) <= length
    swap = tmp_path / "swap.safetensors"
    swap.write_bytes(length.to_bytes(8, "little") + text + b" " * (length - len(text)) + blob)
    assert swap.stat().st_size == (a / SAFETENSORS_NAME).stat().st_size
    real_open = tensor_file._open

    def racing_open(path):
        if swap.exists():
            os.replace(swap, path)  # lands between the header parse and the data read
        return real_open(path)

    monkeypatch.setattr(tensor_file, "_open", racing_open)
    with pytest.raises(AdapterFormatError, match="changed while it was read"):
        if reader == "read_new_slot_image":
            read_new_slot_image(a, SPEC, 4, torch.bfloat16, pin_memory=False)
        else:
            load_peft_adapter(a, SPEC, 4, serving_dtype=torch.bfloat16)
    assert not swap.exists()
