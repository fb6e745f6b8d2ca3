"""Cheap registration and loads off the critical path, on CPU with toy shapes.

Declared ``version_id``: registration reads the header only, tensors at first use,
nothing is hashed. Without one: read + hash once, cached only if there is room,
re-reads trust a stat signature. Background reads (one worker thread) are claimed by
``ensure_ready``; failures are raised once to the caller that claims them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from loraplex.adapters import (
    AdapterChangedError,
    AdapterConflictError,
    AdapterFormatError,
    BaseModelSpec,
    LoRASlotPool,
    UnknownAdapterError,
    adapter_files_signature,
    inspect_peft_adapter,
    load_peft_adapter,
    peft_format,
)
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters import loader, tensor_file

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 8
TARGETS = [(0, "q_proj"), (1, "v_proj"), (1, "down_proj")]


class ReadSpy:
    """Counts tensor-data reads and sha256 content hashes done by the adapters package."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tensor_reads = 0
        self.hashes = 0
        first_read, reread, hash_fn = loader.read_new_slot_image, loader.read_slot_image, peft_format._content_hash

        def counting_first_read(*args, **kwargs):
            self.tensor_reads += 1
            return first_read(*args, **kwargs)

        def counting_module_read(*args, **kwargs):
            self.tensor_reads += 1
            return reread(*args, **kwargs)

        def counting_hash(*args, **kwargs):
            self.hashes += 1
            return hash_fn(*args, **kwargs)

        monkeypatch.setattr(loader, "read_new_slot_image", counting_first_read)
        monkeypatch.setattr(loader, "read_slot_image", counting_module_read)
        monkeypatch.setattr(peft_format, "_content_hash", counting_hash)

    @property
    def counts(self) -> tuple[int, int]:
        return self.tensor_reads, self.hashes


@pytest.fixture
def make_adapters(tmp_path, write_adapter):
    """``make_adapters(count)`` -> [(LoRARequest with declared version_id, reference weights)]."""

    def make(count: int, *, declare: bool = True):
        made = []
        for index in range(1, count + 1):
            generator = torch.Generator().manual_seed(100 + index)
            rank = 1 + index % 4
            reference = {}
            for layer, module in TARGETS:
                in_features, out_features = SPEC.module_shapes[module]
                reference[(layer, module)] = (
                    torch.randn(rank, in_features, generator=generator),
                    torch.randn(out_features, rank, generator=generator),
                    2.0 / rank,
                )
            folder = tmp_path / f"ad{index}"
            write_adapter(folder, {k: (a, b) for k, (a, b, _) in reference.items()}, r=rank, lora_alpha=2.0)
            version = load_peft_adapter(folder, SPEC, MAX_RANK).version_id if declare else None
            made.append((LoRARequest(f"ad{index}", index, str(folder), version_id=version), reference))
        return made

    return make


def make_pool(*, max_loras=2, max_cpu_loras=2, background=False, **kwargs) -> LoRASlotPool:
    return LoRASlotPool(SPEC, max_loras, MAX_RANK, max_cpu_loras, torch.float32, "cpu",
                        background_loads=background, **kwargs)


def assert_slot_holds(pool, slot, reference):
    for layer in range(SPEC.num_layers):
        for module, (in_features, out_features) in SPEC.module_shapes.items():
            expected_a, expected_b, expected_scaling = torch.zeros(MAX_RANK, in_features), torch.zeros(
                out_features, MAX_RANK), 0.0
            if (layer, module) in reference:
                a, b, expected_scaling = reference[(layer, module)]
                expected_a[: a.shape[0]] = a
                expected_b[:, : b.shape[1]] = b
            assert torch.equal(pool.weights.slot_factors(slot, layer, module)[0], expected_a), (slot, layer, module)
            assert torch.equal(pool.weights.slot_factors(slot, layer, module)[1], expected_b), (slot, layer, module)
            assert pool.scaling[layer][module][slot].item() == pytest.approx(expected_scaling, rel=1e-7)


def wait_ready(pool, int_id, *, timeout_s=30.0) -> None:
    """Poll ``ensure_ready`` (as the scheduler does each step) until it is True."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pool.ensure_ready(int_id):
            return
        pool.wait_for_loads(timeout_s=0.01)
    raise AssertionError(f"adapter {int_id} never became ready")


# ---------------------------------------------------------------- declared version id


def test_declared_registration_reads_header_only_and_first_use_verifies_the_hash(make_adapters, monkeypatch):
    (request, reference), = make_adapters(1)
    spy = ReadSpy(monkeypatch)
    pool = make_pool()
    assert pool.add_lora(request) is True
    assert spy.counts == (0, 0)  # no tensor data read, nothing hashed
    stats = pool.stats()
    assert (stats.disk_loads, stats.cpu_cache_lru, stats.registered) == (0, [], ["ad1"])
    assert pool.version_id(1) == request.version_id
    assert pool.pin(1) == 0  # first use: tensors read now and hashed once (checked against the declared id)
    assert spy.counts == (1, 1)
    assert (pool.stats().disk_loads, pool.stats().cpu_cache_lru) == (1, ["ad1"])
    assert_slot_holds(pool, 0, reference)


def test_preload_warms_the_host_cache_explicitly(make_adapters, monkeypatch):
    made = make_adapters(3)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(max_loras=1, max_cpu_loras=2)
    for request, _ in made:
        pool.add_lora(request)
    for int_id in (1, 2, 3):
        pool.preload(int_id)
    pool.preload(3)  # cached already: nothing read
    stats = pool.stats()
    assert (stats.disk_loads, stats.cpu_cache_lru, stats.cpu_evictions) == (3, ["ad2", "ad3"], 1)
    assert pool.pin(3) == 0 and spy.counts == (3, 3)  # each first read verified its hash
    assert_slot_holds(pool, 0, made[2][1])
    pool.unpin(3)
    assert pool.pin(1) == 0 and spy.counts == (4, 3)  # evicted ad1 re-read: verified before, not re-hashed
    assert_slot_holds(pool, 0, made[0][1])


def test_inspect_matches_the_loaded_adapter(make_adapters):
    (request, _), = make_adapters(1)
    layout = inspect_peft_adapter(request.lora_path, SPEC, MAX_RANK)
    adapter = load_peft_adapter(request.lora_path, SPEC, MAX_RANK)
    assert (layout.rank, layout.target_modules, layout.size_bytes) == (
        adapter.rank, adapter.target_modules, adapter.size_bytes)
    assert layout.size_bytes == os.path.getsize(Path(request.lora_path) / "adapter_model.safetensors") - (
        _header_bytes(Path(request.lora_path) / "adapter_model.safetensors"))
    assert layout.num_layers_targeted == len(adapter.layers) == 2


def _header_bytes(path: Path) -> int:
    with path.open("rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def test_declared_id_conflicts_and_bad_value(make_adapters):
    (request, _), = make_adapters(1)
    pool = make_pool()
    pool.add_lora(request)
    assert pool.add_lora(request) is False
    assert pool.add_lora(LoRARequest("ad1", 1, request.lora_path)) is False  # no declared id: same adapter
    other = "0" * 64
    with pytest.raises(AdapterConflictError,
                       match=f"LoRARequest.version_id='{other}': lora_int_id=1 is already registered with "
                             f"version_id='{request.version_id}'"):
        pool.add_lora(LoRARequest("ad1", 1, request.lora_path, version_id=other))
    for bad in ("abc", "A" * 64, 7):
        with pytest.raises(ValueError, match=r"LoRARequest.version_id=.*: must be a sha256 hex digest"):
            LoRARequest("x", 1, "/p", version_id=bad)
    assert LoRARequest("x", 1, "/p") == LoRARequest("x", 1, "/p", None)  # positional compatibility


def test_declared_adapter_changed_on_disk_is_refused_at_first_use(make_adapters, write_adapter):
    (request, reference), = make_adapters(1)
    pool = make_pool()
    pool.add_lora(request)
    changed = {k: (a, b * 2) for k, (a, b, _) in reference.items()}
    rank = next(iter(reference.values()))[0].shape[0]
    write_adapter(Path(request.lora_path), changed, r=rank, lora_alpha=2.0)
    with pytest.raises(AdapterChangedError, match=f"version_id .* != registered {request.version_id}"):
        pool.pin(1)
    stats = pool.stats()
    assert (stats.load_failures, stats.slot_loads, stats.slots[0].lora_name) == (1, 0, None)


@pytest.mark.parametrize("background", [False, True])
def test_declared_adapter_changed_before_registration_is_refused_at_first_read(make_adapters, background):
    """Issue 14 item 15: the stored file changed after upload and before the engine ever saw it
    (so the stat signature recorded at registration is the changed file's). The first read into
    the host cache hashes it and refuses it; the pool stays unchanged."""
    (request, _), = make_adapters(1)
    weights = Path(request.lora_path) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(b ^ 0x55 for b in data[-8:])  # same size, same header, other values
    weights.write_bytes(bytes(data))
    pool = make_pool(background=background)
    try:
        pool.add_lora(request)  # header only: still accepted
        with pytest.raises(AdapterChangedError, match=f"changed on disk: version_id .* != registered "
                                                      f"{request.version_id}"):
            if background:
                wait_ready(pool, 1)
            pool.pin(1)
        stats = pool.stats()
        assert (stats.load_failures, stats.cpu_cache_lru, stats.slot_loads) == (1, [], 0)
    finally:
        pool.close()


# ---------------------------------------------------------------- without a declared id


def test_undeclared_registration_never_evicts_and_reloads_trust_the_stat_signature(make_adapters, monkeypatch):
    made = make_adapters(3, declare=False)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(max_loras=1, max_cpu_loras=2)
    for request, _ in made:
        pool.add_lora(request)
    assert spy.counts == (3, 3)  # read and hashed once each
    stats = pool.stats()
    assert (stats.cpu_cache_lru, stats.cpu_evictions, stats.disk_loads) == (["ad1", "ad2"], 0, 3)
    assert pool.pin(3) == 0  # not cached: re-read, but not re-hashed (signature unchanged)
    assert spy.counts == (4, 3)
    pool.unpin(3)
    assert pool.stats().cpu_cache_lru == ["ad2", "ad3"]
    # Touch ad1's weights (same bytes, new mtime): the re-read re-hashes once, finds the same id.
    weights = Path(made[0][0].lora_path) / "adapter_model.safetensors"
    signature = adapter_files_signature(made[0][0].lora_path)
    os.utime(weights, ns=(signature[1][1] + 10**9, signature[1][1] + 10**9))
    assert pool.pin(1) == 0
    assert spy.counts == (5, 4)
    assert_slot_holds(pool, 0, made[0][1])
    pool.unpin(1)
    for int_id in (2, 3):  # evict ad1 from the host cache and the slot
        pool.pin(int_id)
        pool.unpin(int_id)
    assert "ad1" not in pool.stats().cpu_cache_lru
    pool.pin(1)  # the verified signature was recorded: no hash this time
    assert spy.counts[1] == 4


def test_verified_rereads_skip_the_nan_scan_until_the_files_change(make_adapters, monkeypatch):
    """The NaN/Inf scan of a slot image runs with every hashed read and not with a re-read the stat signature
    vouches for (the same bytes, scanned as the same dtype when they were hashed); once the files change the
    read is hashed and scanned again."""
    from loraplex.adapters import slot_image

    scans = []
    real = slot_image._check_finite
    monkeypatch.setattr(slot_image, "_check_finite", lambda *a: scans.append(1) or real(*a))
    made = make_adapters(2)
    pool = make_pool(max_loras=1, max_cpu_loras=1)
    for request, _ in made:
        pool.add_lora(request)
    pool.pin(1)  # first use: hashed, scanned
    pool.unpin(1)
    assert len(scans) == 1
    pool.pin(2)  # evicts ad1 from the host cache and the slot
    pool.unpin(2)
    assert len(scans) == 2
    pool.pin(1)  # verified re-read: not hashed, not scanned
    pool.unpin(1)
    assert len(scans) == 2
    assert_slot_holds(pool, 0, made[0][1])
    pool.pin(2)  # ad2's verified re-read: not scanned either
    pool.unpin(2)
    assert len(scans) == 2
    weights = Path(made[0][0].lora_path) / "adapter_model.safetensors"
    signature = adapter_files_signature(made[0][0].lora_path)
    os.utime(weights, ns=(signature[1][1] + 10**9, signature[1][1] + 10**9))
    pool.pin(1)  # the files changed (stat): hashed and scanned again
    assert len(scans) == 3
    assert_slot_holds(pool, 0, made[0][1])


# ---------------------------------------------------------------- background loads


def test_background_read_is_claimed_by_ensure_ready(make_adapters, monkeypatch):
    (request, reference), = make_adapters(1)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(background=True)
    pool.add_lora(request)
    try:
        assert pool.ensure_ready(1) is False  # read started
        assert pool.ensure_ready(1) in (False, True)  # idempotent: no second read is queued
        wait_ready(pool, 1)
        stats = pool.stats()
        assert (stats.disk_loads, stats.loads_in_flight, stats.cpu_cache_lru) == (1, 0, ["ad1"])
        assert pool.pin(1) == 0  # from host memory
        assert spy.counts == (1, 1) and pool.stats().disk_loads == 1
        assert_slot_holds(pool, 0, reference)
    finally:
        pool.close()


def test_pin_waits_for_an_in_flight_read_instead_of_reading_twice(make_adapters, monkeypatch):
    (request, reference), = make_adapters(1)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(background=True)
    pool.add_lora(request)
    try:
        assert pool.ensure_ready(1) is False
        assert pool.pin(1) == 0
        assert spy.counts == (1, 1)
        assert (pool.stats().disk_loads, pool.stats().loads_in_flight) == (1, 0)
        assert_slot_holds(pool, 0, reference)
    finally:
        pool.close()


def test_reads_in_flight_are_bounded(make_adapters):
    made = make_adapters(4)
    pool = make_pool(background=True, max_cpu_loras=4, max_loads_in_flight=2)
    for request, _ in made:
        pool.add_lora(request)
    try:
        started = [pool.ensure_ready(i) for i in (1, 2, 3)]
        assert started == [False, False, False]
        assert pool.stats().loads_in_flight <= 2
        for int_id in (1, 2, 3, 4):
            wait_ready(pool, int_id)
        stats = pool.stats()
        assert stats.disk_loads == 4 and stats.loads_in_flight == 0
        assert sorted(stats.cpu_cache_lru) == ["ad1", "ad2", "ad3", "ad4"]
    finally:
        pool.close()


def test_failed_background_read_is_raised_once_then_retried(make_adapters):
    (request, reference), = make_adapters(1)
    pool = make_pool(background=True)
    pool.add_lora(request)
    hidden = Path(request.lora_path).with_name("hidden")
    shutil.move(request.lora_path, hidden)
    try:
        assert pool.ensure_ready(1) is False
        pool.wait_for_loads(timeout_s=30)
        with pytest.raises(AdapterFormatError, match=f"adapter folder '{request.lora_path}' does not exist"):
            pool.ensure_ready(1)
        assert (pool.stats().load_failures, pool.stats().loads_in_flight) == (1, 0)
        shutil.move(hidden, request.lora_path)  # files back (same stat signature): the retry succeeds
        wait_ready(pool, 1)
        assert pool.pin(1) == 0
        assert_slot_holds(pool, 0, reference)
        assert pool.stats().disk_loads == 1
    finally:
        pool.close()


def test_removing_an_adapter_drops_its_read(make_adapters):
    (request, _), = make_adapters(1)
    pool = make_pool(background=True)
    pool.add_lora(request)
    try:
        pool.ensure_ready(1)
        assert pool.remove_lora(1) is True
        assert pool.stats().loads_in_flight == 0
        with pytest.raises(UnknownAdapterError, match="lora_int_id=1 is not registered"):
            pool.ensure_ready(1)
    finally:
        pool.close()


# ---------------------------------------------------------------- two-level cache


@pytest.mark.parametrize("background", [False, True])
def test_many_declared_adapters_one_read_each(make_adapters, monkeypatch, background):
    """8 adapters, 2 host-cache entries, 2 slots: registering reads nothing; serving them two
    at a time while the next two are prefetched (as the scheduler does) reads each exactly once."""
    made = make_adapters(8)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(max_loras=2, max_cpu_loras=2, background=background)
    for request, _ in made:
        pool.add_lora(request)
    assert spy.counts == (0, 0) and pool.stats().disk_loads == 0
    try:
        for int_id in (1, 2):
            wait_ready(pool, int_id)
        for first in range(1, 9, 2):
            running = (first, first + 1)
            for int_id in running:
                for _ in range(3):
                    pool.pin(int_id)
            for int_id in (first + 2, first + 3):  # prefetch the next pair while this one runs
                if int_id <= 8:
                    wait_ready(pool, int_id)
            for int_id in running:
                assert_slot_holds(pool, pool.pin(int_id), made[int_id - 1][1])
                for _ in range(4):
                    pool.unpin(int_id)
        stats = pool.stats()
        assert stats.disk_loads == 8 and spy.counts == (8, 8)
        assert (stats.load_failures, stats.slot_loads, stats.cpu_evictions) == (0, 8, 6)
    finally:
        pool.close()


def test_verified_rereads_reuse_the_parsed_header_until_the_files_change(make_adapters, monkeypatch):
    """The safetensors header is parsed under the signature the first (hashed) read recorded; verified re-reads
    reuse it, and once the files change the read parses it again."""
    made = make_adapters(2)  # (load_peft_adapter computes the declared ids: not counted)
    parses = []
    real = tensor_file.stored_tensors
    monkeypatch.setattr(tensor_file, "stored_tensors", lambda path: parses.append(str(path)) or real(path))
    pool = make_pool(max_loras=1, max_cpu_loras=1)
    for request, _ in made:
        pool.add_lora(request)
    pool.pin(1)  # first use: hashed; the header parsed once for later reads
    pool.unpin(1)
    assert len(parses) == 1 and pool.registry.get(1).stored is not None
    pool.pin(2)  # evicts ad1
    pool.unpin(2)
    assert len(parses) == 2
    pool.pin(1)  # verified re-read: the header is not parsed again
    pool.unpin(1)
    assert len(parses) == 2
    assert_slot_holds(pool, 0, made[0][1])
    pool.pin(2)
    pool.unpin(2)
    weights = Path(made[0][0].lora_path) / "adapter_model.safetensors"
    signature = adapter_files_signature(made[0][0].lora_path)
    os.utime(weights, ns=(signature[1][1] + 10**9, signature[1][1] + 10**9))
    pool.pin(1)  # the files changed (stat): hashed, the header parsed under the new signature
    assert len(parses) == 3
    assert_slot_holds(pool, 0, made[0][1])


def test_a_hashed_read_whose_files_changed_meanwhile_records_no_signature_to_trust(make_adapters, monkeypatch):
    """The files' stat after a hashed first read differs from the one before it (replaced while read): the
    registration keeps no signature, so the next read hashes again instead of trusting files never hashed."""
    made = make_adapters(1)
    spy = ReadSpy(monkeypatch)
    pool = make_pool(max_loras=1, max_cpu_loras=1)
    pool.add_lora(made[0][0])  # declared: header only
    real, calls = loader.adapter_files_signature, []

    def changed_after_the_read(path):
        calls.append(path)
        signature = real(path)
        return (signature[0], (signature[1][0] + 1, signature[1][1])) if len(calls) == 2 else signature

    monkeypatch.setattr(loader, "adapter_files_signature", changed_after_the_read)
    wait_ready(pool, 1)  # the first read: stat before, hashed read, stat after (changed)
    registration = pool.registry.get(1)
    assert len(calls) == 2 and spy.counts == (1, 1)
    assert (registration.signature, registration.verified, registration.stored) == (None, False, None)
    pool.loader.cache.pop(1)
    wait_ready(pool, 1)  # hashed again
    assert spy.counts == (2, 2) and pool.registry.get(1).verified
    pool.loader.cache.pop(1)
    wait_ready(pool, 1)  # now trusted under the stat that held
    assert spy.counts == (3, 2)
