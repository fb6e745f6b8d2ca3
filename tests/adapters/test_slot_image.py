"""SlotImage: an adapter read straight into its slot layout equals the loaded adapter, padded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loraplex.adapters import AdapterFormatError, BaseModelSpec, inspect_peft_adapter, load_peft_adapter
from loraplex.adapters.slot_image import read_slot_image, slot_image_from_adapter

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 8
TARGETS = [(0, "q_proj"), (0, "down_proj"), (1, "v_proj")]


def write(tmp_path, write_adapter, rank: int, stored_dtype: torch.dtype):
    generator = torch.Generator().manual_seed(7)
    weights = {}
    for layer, module in TARGETS:
        in_features, out_features = SPEC.module_shapes[module]
        weights[(layer, module)] = (torch.randn(rank, in_features, generator=generator).to(stored_dtype),
                                    torch.randn(out_features, rank, generator=generator).to(stored_dtype))
    write_adapter(tmp_path / "ad", weights, r=rank, lora_alpha=2.0 * rank)
    return tmp_path / "ad", weights


# rank 3 < R: per-tensor reads into a padded image; rank R stored in the slot dtype: the
# image is the file's data section (one read); rank R in another dtype: converting copies.
@pytest.mark.parametrize("rank,stored_dtype", [(3, torch.float32), (MAX_RANK, torch.float32),
                                               (MAX_RANK, torch.bfloat16)], ids=["r3-fp32", "r8-fp32", "r8-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_image_equals_loaded_adapter_padded(tmp_path, write_adapter, rank, stored_dtype, dtype):
    folder, weights = write(tmp_path, write_adapter, rank, stored_dtype)
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    image = read_slot_image(layout, SPEC, MAX_RANK, dtype, version_id="v" * 64, pin_memory=False)
    loaded = slot_image_from_adapter(load_peft_adapter(folder, SPEC, MAX_RANK), SPEC, MAX_RANK, dtype,
                                     pin_memory=False)
    assert image.version_id == "v" * 64 and image.data.dtype == dtype
    assert image.offsets.keys() == loaded.offsets.keys() == set(TARGETS)
    assert torch.equal(image.scaling, loaded.scaling)
    expected_numel = sum(MAX_RANK * sum(SPEC.module_shapes[module]) for _, module in TARGETS)
    assert image.nbytes == expected_numel * image.data.element_size()
    columns = list(SPEC.module_shapes)
    for layer in range(SPEC.num_layers):
        for module in SPEC.module_shapes:
            key = (layer, module)
            if key not in weights:
                assert key not in image.offsets and image.scaling[layer, columns.index(module)] == 0.0
                continue
            a, b = weights[key]
            for got in (image, loaded):
                assert torch.equal(got.a(key)[:rank], a.to(dtype)) and not got.a(key)[rank:].any()
                assert torch.equal(got.b(key)[:, :rank], b.to(dtype)) and not got.b(key)[:, rank:].any()
            assert image.scaling[layer, columns.index(module)] == pytest.approx(2.0)


def test_overflow_in_slot_dtype_is_refused_naming_the_tensor(tmp_path, write_adapter):
    a = torch.full((2, 16), 0.5)
    b = torch.ones(16, 2)
    b[4, 1] = 70000.0  # finite in fp32, Inf in fp16
    write_adapter(tmp_path / "big", {(1, "q_proj"): (a, b)}, r=2, lora_alpha=2.0)
    layout = inspect_peft_adapter(tmp_path / "big", SPEC, MAX_RANK)
    read_slot_image(layout, SPEC, MAX_RANK, torch.bfloat16, version_id="x" * 64, pin_memory=False)  # fits bf16
    with pytest.raises(AdapterFormatError, match=r"layers\.1\.self_attn\.q_proj\.lora_B.*NaN or Inf.*float16"):
        read_slot_image(layout, SPEC, MAX_RANK, torch.float16, version_id="x" * 64, pin_memory=False)


@pytest.mark.parametrize("rank", [3, MAX_RANK])
def test_truncated_file_is_refused(tmp_path, write_adapter, rank):
    folder, _ = write(tmp_path, write_adapter, rank, torch.bfloat16)
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    path = folder / "adapter_model.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(AdapterFormatError, match="truncated|data_offsets"):
        read_slot_image(layout, SPEC, MAX_RANK, torch.bfloat16, version_id="x" * 64, pin_memory=False)


def _rewrite_offsets(path, edit) -> None:
    """Rewrite the safetensors header in place (same length, padded with spaces): ``edit(header)``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)  # room for longer offsets
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])


@pytest.mark.parametrize("rank", [3, MAX_RANK])
@pytest.mark.parametrize("case", ["overlap", "into_header", "float", "beyond_end"])
def test_header_offsets_rewritten_after_inspection_are_refused(tmp_path, write_adapter, rank, case):
    folder, _ = write(tmp_path, write_adapter, rank, torch.bfloat16)
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    b_name = layout.modules[0].b_name
    a_name = layout.modules[0].a_name

    def edit(header):
        begin, end = header[b_name]["data_offsets"]
        header[b_name]["data_offsets"] = {
            "overlap": header[a_name]["data_offsets"][:1] + [header[a_name]["data_offsets"][0] + end - begin],
            "into_header": [-(end - begin), 0],
            "float": [float(begin), float(end)],
            "beyond_end": [begin + 10**6, end + 10**6],
        }[case]

    _rewrite_offsets(folder / "adapter_model.safetensors", edit)
    with pytest.raises(AdapterFormatError, match="overlap|data_offsets"):
        read_slot_image(layout, SPEC, MAX_RANK, torch.bfloat16, version_id="x" * 64, pin_memory=False)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_parallel_read_parts_give_the_same_image(tmp_path, write_adapter, monkeypatch, parts):
    """A read split into parts on several threads (PARALLEL_READ_*: page-aligned parts, the last shorter) equals
    the one-thread read, and a file that ends inside a later part is refused as truncated."""
    from loraplex.adapters import tensor_file

    folder, _ = write(tmp_path, write_adapter, MAX_RANK, torch.float32)  # verbatim: one read of the data section
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    whole = read_slot_image(layout, SPEC, MAX_RANK, torch.float32, version_id="v" * 64, pin_memory=False)
    assert whole.nbytes > 256 * parts  # several aligned blocks per part
    reads = []
    real = tensor_file._pread_part
    monkeypatch.setattr(tensor_file, "_pread_part", lambda fd, view, offset, name: reads.append(
        (offset, len(view))) or real(fd, view, offset, name))
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_MIN_BYTES", 1024)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_ALIGN_BYTES", 256)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_PARTS", parts)
    monkeypatch.setattr(tensor_file, "_read_pool", None)
    split = read_slot_image(layout, SPEC, MAX_RANK, torch.float32, version_id="v" * 64, pin_memory=False)
    assert torch.equal(split.data, whole.data) and split.offsets == whole.offsets
    reads.sort()
    step = -(-(-(-whole.nbytes // parts)) // 256) * 256  # ceil(n / parts), rounded up to the alignment
    assert len(reads) == -(-whole.nbytes // step) > 1 and sum(n for _, n in reads) == whole.nbytes
    assert all(n % 256 == 0 for _, n in reads[:-1]) and 0 < reads[-1][1] <= reads[0][1]
    assert all(a + n == b for (a, n), (b, _) in zip(reads, reads[1:]))  # contiguous, no overlap
    path = folder / "adapter_model.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(AdapterFormatError, match="truncated|data_offsets"):
        read_slot_image(layout, SPEC, MAX_RANK, torch.float32, version_id="v" * 64, pin_memory=False)
    monkeypatch.setattr(tensor_file, "_read_pool", None)  # the pool created here is not the default's


def test_parallel_read_waits_for_every_part_when_one_fails(monkeypatch):
    """A failing part (a file truncated inside it) is raised only once every other part has ended: the caller
    closes the fd and reuses the buffer right after."""
    import threading
    import time as _time

    from loraplex.adapters import tensor_file

    ended, lock = [], threading.Lock()

    def part(fd, view, offset, name):
        if offset == 1024:  # the second part fails at once
            raise AdapterFormatError(f"tensor {name!r}: truncated")
        if offset > 1024:
            _time.sleep(0.2)  # the later parts are still reading when it fails
        with lock:
            ended.append(offset)

    monkeypatch.setattr(tensor_file, "_pread_part", part)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_MIN_BYTES", 1024)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_ALIGN_BYTES", 1024)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_PARTS", 4)
    monkeypatch.setattr(tensor_file, "_read_pool", None)
    with pytest.raises(AdapterFormatError, match="truncated"):
        tensor_file.pread_exact(-1, memoryview(bytearray(4096)), 0, "t")
    assert sorted(ended) == [0, 2048, 3072]  # every other part had ended when the error was raised
    monkeypatch.setattr(tensor_file, "_read_pool", None)


def test_parallel_reads_work_in_a_forked_child(tmp_path, write_adapter, monkeypatch):
    """The parent's read pool (threads do not survive fork) is replaced in a forked child."""
    import multiprocessing

    from loraplex.adapters import tensor_file

    folder, _ = write(tmp_path, write_adapter, MAX_RANK, torch.float32)
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_MIN_BYTES", 1024)
    monkeypatch.setattr(tensor_file, "PARALLEL_READ_ALIGN_BYTES", 256)
    whole = read_slot_image(layout, SPEC, MAX_RANK, torch.float32, version_id="v" * 64, pin_memory=False)
    assert tensor_file._read_pool is not None  # the parent's pool exists at fork
    child = multiprocessing.get_context("fork").Process(target=_read_in_child, args=(layout, whole.data))
    child.start()
    child.join(60)  # a liveness bound: without the reset the child waits forever for pool threads
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0


def _read_in_child(layout, expected) -> None:
    image = read_slot_image(layout, SPEC, MAX_RANK, torch.float32, version_id="v" * 64, pin_memory=False)
    os._exit(0 if torch.equal(image.data, expected) else 3)
