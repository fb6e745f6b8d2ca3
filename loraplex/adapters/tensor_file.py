"""An adapter's ``adapter_model.safetensors``: where its tensors lie (the JSON header) and their bytes, read
in a few large ``pread`` calls into host memory.

Safetensors format: an 8-byte little-endian header length, a JSON header whose ``data_offsets`` are
relative to the end of the header, then the data section::

    | length (8 B) | {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...} | data section ........ |

``TensorData`` holds tensors read this way as numpy byte arrays. A loader thread pays a GIL hand-off (it
releases the GIL, then waits up to the switch interval to take it back while the engine thread runs Python)
for each torch op call (a ``Tensor`` method measured 2-5, the ``torch.*`` function 1), each torch tensor
deallocated (``THPVariable`` frees its data with the GIL released), each large numpy operation, hash update
or ``pread``. Numpy views keep the GIL and free nothing, so per-tensor work stays in them, and many tensors
are gathered or scattered by one numpy fancy-indexing call (``gather_rows`` / ``scatter_rows``): a read
costs a handful of hand-offs however many tensors the file holds (``benchmarks/diag_first_read.py``).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from loraplex.adapters.errors import AdapterFormatError

SAFETENSORS_NAME = "adapter_model.safetensors"
STORED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
"""The safetensors dtypes an adapter may store (floating point), as torch dtypes."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in ``adapter_model.safetensors`` (from its JSON header).

    - ``dtype``: safetensors dtype string (``"BF16"``, ``"F32"``, ...); ``shape``: its shape.
    - ``offset_bytes``: absolute file offset of the first byte; ``nbytes``: byte count.
    """

    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


FileIdentity = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)`` of a file (``file_identity``)."""


def file_identity(path: str | os.PathLike[str]) -> FileIdentity | None:
    """``(st_dev, st_ino, st_size, st_mtime_ns)`` of ``path`` (one ``stat``): another value means the file was
    replaced (another inode) or rewritten (size, modification time) in between. None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# -- whether the file changed since its header was checked: decided here, for every read --------------------
# ``peft_format`` checks a header (names, dtypes, shapes) parsed through another open of the file than the data
# read: a first read compares the header it parses for the places with the one checked (``check_same_header``)
# and the file's identity before the check with the one after the data read (``check_same_file``); a re-read
# compares a header kept from an earlier read (or parsed again) with the layout's shapes (``check_listed``).


def check_same_file(path: str | os.PathLike[str], identity: FileIdentity | None) -> None:
    """The file ``path`` is the one whose ``file_identity`` was ``identity`` (not replaced or rewritten since).
    Raises ``AdapterFormatError`` otherwise, or when either could not be stat'ed."""
    if identity is None or file_identity(path) != identity:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: changed while it was read (replaced or rewritten)")


def check_same_header(stored: dict[str, StoredTensor], header: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """``stored`` (``stored_tensors``) lists exactly the tensors of ``header`` (name -> (dtype, shape), the
    header checked, parsed through another open of the file). Raises ``AdapterFormatError`` otherwise."""
    if {name: (ref.dtype, ref.shape) for name, ref in stored.items()} != header:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: changed while it was read (its header is not the one checked)")


def check_listed(stored: dict[str, StoredTensor], expected: Iterable[tuple[str, tuple[int, ...] | None]]) -> None:
    """``stored`` (a header parsed again, or kept from an earlier read) still lists each tensor ``(name, shape)``
    of ``expected`` as it was checked, and ``read_tensor_data`` can read them: first, every one is listed in
    ``shape`` (None: any shape); then, in the same order, each is a float of ``STORED_DTYPES`` whose byte count
    matches its shape.

    Raises ``AdapterFormatError`` naming the first tensor that is missing, of another shape or not a float
    (``changed since it was checked``), or whose byte count does not match its shape.
    """
    expected = list(expected)
    for name, shape in expected:
        if name not in stored or (shape is not None and stored[name].shape != shape):
            raise _changed(name)
    for name, _ in expected:
        ref = stored[name]
        if ref.dtype not in STORED_DTYPES:
            raise _changed(name)
        if ref.nbytes != math.prod(ref.shape) * STORED_DTYPES[ref.dtype].itemsize:
            raise AdapterFormatError(f"tensor {name!r}: {ref.nbytes} bytes stored for shape {list(ref.shape)}")


def _changed(name: str) -> AdapterFormatError:
    return AdapterFormatError(f"tensor {name!r}: {SAFETENSORS_NAME} changed since it was checked")


_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def stored_tensors(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """name -> ``StoredTensor`` for the safetensors file ``path`` (header only), in the header's order.

    For reading tensors straight into preallocated (e.g. pinned) memory. Every tensor's
    byte range must lie inside the data section and no two may overlap (as the
    ``safetensors`` library requires). Raises ``AdapterFormatError`` for an unreadable
    or malformed header.
    """
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length}")
            header = json.loads(handle.read(length))
            data_bytes = os.fstat(handle.fileno()).st_size - 8 - length
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        tensors = {name: _stored(entry, 8 + length, data_bytes) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise AdapterFormatError(
            f"{SAFETENSORS_NAME}: unreadable header ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    _check_disjoint(tensors)
    return tensors


def _stored(entry: dict[str, Any], data_start: int, data_bytes: int) -> StoredTensor:
    begin, end = entry["data_offsets"]
    if not all(type(v) is int for v in (begin, end)) or not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"data_offsets {entry['data_offsets']!r}: must be integers within the {data_bytes}-byte data section")
    dtype, shape = entry["dtype"], tuple(entry["shape"])
    # as the safetensors library reads them: a string, and integers >= 0 (``int()`` of a JSON 1e400 raised
    # OverflowError, of 4.9 gave 4)
    if type(dtype) is not str or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"dtype {dtype!r}, shape {list(shape)!r}: expected a string and integers >= 0")
    return StoredTensor(dtype=dtype, shape=shape, offset_bytes=data_start + begin, nbytes=end - begin)


def _check_disjoint(tensors: dict[str, StoredTensor]) -> None:
    spans = sorted((t.offset_bytes, t.offset_bytes + t.nbytes, name) for name, t in tensors.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise AdapterFormatError(f"{SAFETENSORS_NAME}: tensors {first!r} and {second!r} overlap in the file")


class TensorData:
    """Tensors of a safetensors file in host memory (made by :func:`read_tensor_data`).

    ``stored``: the header entries of the tensors held (name -> ``StoredTensor``, each a float dtype of
    ``STORED_DTYPES`` whose byte count matches its shape). Their bytes lie in runs, contiguous ranges of the
    file, each a ``[nbytes] uint8`` numpy array. Per-tensor work stays in numpy views (no GIL hand-off:
    every torch tensor object costs one or more, its op and its deallocation each releasing the GIL);
    ``rows`` / ``stack`` gather many tensors with one numpy call.
    """

    def __init__(self, stored: dict[str, StoredTensor], runs: list[tuple[int, np.ndarray, list[str]]]) -> None:
        self.stored = stored
        self._runs = [buffer for _, buffer, _ in runs]
        self._place: dict[str, tuple[int, int]] = {}  # name -> (run index, byte offset in the run)
        for index, (start, _, names) in enumerate(runs):
            for name in names:
                self._place[name] = index, stored[name].offset_bytes - start

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor ``name``."""
        return STORED_DTYPES[self.stored[name].dtype]

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as stored: ``[nbytes] uint8`` (a view). Raises ``KeyError`` if not held."""
        index, offset = self._place[name]
        return self._runs[index][offset : offset + self.stored[name].nbytes]

    def rows(self, names: list[str]) -> np.ndarray:
        """The bytes of tensors ``names`` (of one byte count ``n``) as ``[len(names), n] uint8``, a copy made
        by one numpy call per run they lie in."""
        nbytes = self.stored[names[0]].nbytes
        by_run: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            by_run.setdefault(self._place[name][0], []).append(i)
        if len(by_run) == 1:
            (index,) = by_run
            return gather_rows(self._runs[index], [self._place[name][1] for name in names], nbytes)
        out = np.empty((len(names), nbytes), dtype=np.uint8)
        for index, positions in by_run.items():
            out[positions] = gather_rows(self._runs[index], [self._place[names[i]][1] for i in positions], nbytes)
        return out

    def stack(self, names: list[str]) -> Stacked:
        """Tensors ``names`` (one stored dtype and shape) stacked (``Stacked``): one numpy call however many; one
        tensor is a view of the data (copied only when misaligned for its dtype)."""
        ref = self.stored[names[0]]
        if len(names) > 1:
            return Stacked(self.rows(names), ref.dtype, ref.shape)
        raw = self.raw(names[0])
        if raw.ctypes.data % STORED_DTYPES[ref.dtype].itemsize:
            raw = raw.copy()
        return Stacked(raw[None], ref.dtype, ref.shape)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its stored shape and dtype (a view of the data, or a copy if misaligned)."""
        return self.stack([name]).tensor()[0]

    def copy_into(self, names: list[str], dest: np.ndarray, offsets: list[int]) -> None:
        """Copy each tensor of ``names`` to ``dest[offset : offset + nbytes]`` (``dest``: a ``uint8`` array;
        ``offsets``: byte offsets, one per name): two numpy calls per distinct byte count."""
        by_size: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            by_size.setdefault(self.stored[name].nbytes, []).append(i)
        for nbytes, positions in by_size.items():
            if len(positions) == 1:  # no gathered copy (a [V, H] modules_to_save copy is large)
                dest[offsets[positions[0]] : offsets[positions[0]] + nbytes] = self.raw(names[positions[0]])
            elif nbytes:
                scatter_rows(dest, [offsets[i] for i in positions], self.rows([names[i] for i in positions]))


_INT_OF_SIZE = {2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}  # numpy has no bfloat16


@dataclass(frozen=True)
class Stacked:
    """K tensors of one stored dtype (``dtype``, a ``STORED_DTYPES`` key) and shape ``S`` (``shape``), their bytes
    as stored in the rows of ``rows [K, nbytes] uint8`` (a copy of the file's data)."""

    rows: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        """``[K, *S]`` in the stored dtype, sharing ``rows``' memory (one torch op)."""
        flat = torch.frombuffer(self.rows, dtype=STORED_DTYPES[self.dtype])  # no op: the GIL kept
        return torch.reshape(flat, (len(self.rows), *self.shape))

    def abs_max(self, dim: int | None) -> np.ndarray:
        """``max |value|`` over dimension ``dim`` of ``S`` (None: all of it) per tensor, as float64 (exact):
        ``[K, *S without dim]`` (``[K]`` for None). NaN where a NaN was, else Inf where an Inf was.

        Computed on the bits (two numpy calls, each releasing the GIL once): with the sign bit cleared, IEEE floats
        order as their integer bits, and NaNs lie above Inf."""
        itemsize = STORED_DTYPES[self.dtype].itemsize
        bits = self.rows.view(_INT_OF_SIZE[itemsize])
        bits = bits.reshape(len(self.rows), -1) if dim is None else bits.reshape(len(self.rows), *self.shape)
        magnitude = np.bitwise_and(bits, np.iinfo(bits.dtype).max)
        top = np.max(magnitude, axis=1 if dim is None else 1 + dim, initial=0)
        if self.dtype == "BF16":  # bfloat16 is the high half of a float32
            return (top.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return top.view(_NUMPY_FLOATS[self.dtype]).astype(np.float64)


def gather_rows(buffer: np.ndarray, offsets: list[int], nbytes: int) -> np.ndarray:
    """``[len(offsets), nbytes] uint8``: row ``i`` a copy of ``buffer[offsets[i] : offsets[i] + nbytes]``
    (``buffer``: 1-D ``uint8``; one numpy call, which releases the GIL once)."""
    windows = as_strided(buffer, (len(buffer) - nbytes + 1, nbytes), (1, 1), writeable=False)
    return windows[np.asarray(offsets, dtype=np.intp)]


def scatter_rows(buffer: np.ndarray, offsets: list[int], rows: np.ndarray) -> None:
    """``buffer[offsets[i] : offsets[i] + n] = rows[i]`` for ``rows [len(offsets), n] uint8`` (the ranges
    disjoint; one numpy call)."""
    nbytes = rows.shape[1]
    windows = as_strided(buffer, (len(buffer) - nbytes + 1, nbytes), (1, 1))
    windows[np.asarray(offsets, dtype=np.intp)] = rows


def read_tensor_data(path: str | os.PathLike[str], stored: dict[str, StoredTensor], names: Iterable[str], *,
                     into: tuple[int, torch.Tensor] | None = None) -> TensorData:
    """Read tensors ``names`` of the safetensors file ``path`` (``stored``: its header, ``stored_tensors``; the
    entries of ``names`` passed ``check_listed``): tensors that touch in the file form one run, read by one
    ``pread_exact`` into a new buffer.

    ``into``: ``(offset_bytes, buffer)``, a 1-D contiguous CPU tensor that receives the file's bytes
    ``[offset_bytes, offset_bytes + buffer.nbytes)`` (e.g. a slot image that is the file's data verbatim);
    the tensors of ``names`` inside that range are held there.

    Raises ``AdapterFormatError`` naming the tensor when a tensor straddles the edge of ``into``, or when the
    file cannot be opened or ends early (truncated).
    """
    spans = sorted((stored[name].offset_bytes, stored[name].offset_bytes + stored[name].nbytes, name)
                   for name in names)
    low, high = (into[0], into[0] + into[1].numel() * into[1].element_size()) if into is not None else (-1, -1)
    inside: list[str] = []
    runs: list[list[Any]] = []  # [start, end, names] of the tensors outside ``into``
    for begin, end, name in spans:
        if low <= begin and end <= high:
            inside.append(name)
        elif end > low and begin < high:  # straddles an edge of ``into``
            raise _changed(name)
        elif runs and runs[-1][1] == begin:
            runs[-1][1] = end
            runs[-1][2].append(name)
        else:
            runs.append([begin, end, [name]])
    fd = _open(Path(path))
    try:
        buffers = []
        for start, end, run_names in runs:
            buffer = np.empty(end - start, dtype=np.uint8)
            pread_exact(fd, memoryview(buffer), start, run_names[0])
            buffers.append((start, buffer, run_names))
        if into is not None:
            buffer = into[1].view(torch.uint8).numpy()
            pread_exact(fd, memoryview(buffer), low, inside[0] if inside else "(data section)")
            buffers.append((low, buffer, inside))
    finally:
        os.close(fd)
    return TensorData({name: stored[name] for _, _, name in spans}, buffers)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: cannot be opened ({exc})") from exc


# A read of at least PARALLEL_READ_MIN_BYTES is split into PARALLEL_READ_PARTS parts read side by side (os.preadv
# releases the GIL): one thread copies files from the page cache at ~5 GB/s (an H200 host: a 16.8 MB adapter's
# pread took 3.2 ms of its 6.9 ms disk -> slot; benchmarks/diag_disk_to_slot.py, RESULTS.md session 14).
PARALLEL_READ_MIN_BYTES = 4 << 20
PARALLEL_READ_PARTS = 4
PARALLEL_READ_ALIGN_BYTES = 4096  # parts start on page boundaries of the destination
_read_pool: concurrent.futures.ThreadPoolExecutor | None = None
_read_pool_lock = threading.Lock()


def pread_exact(fd: int, view: memoryview, offset_bytes: int, name: str) -> None:
    """Read ``len(view)`` bytes at ``offset_bytes`` of ``fd`` into the writable byte buffer ``view`` (in
    ``PARALLEL_READ_PARTS`` parts on as many threads from ``PARALLEL_READ_MIN_BYTES`` on).
    Raises ``AdapterFormatError`` naming ``name`` if the file ends first."""
    if len(view) < PARALLEL_READ_MIN_BYTES or PARALLEL_READ_PARTS < 2:
        _pread_part(fd, view, offset_bytes, name)
        return
    per_part = -(-len(view) // PARALLEL_READ_PARTS)
    step = -(-per_part // PARALLEL_READ_ALIGN_BYTES) * PARALLEL_READ_ALIGN_BYTES
    parts = [(start, min(start + step, len(view))) for start in range(0, len(view), step)]
    futures = []
    try:
        try:
            pool = _parallel_read_pool()
            for start, end in parts[1:]:
                futures.append(pool.submit(_pread_part, fd, view[start:end], offset_bytes + start, name))
        except RuntimeError:  # the interpreter is shutting down (no new threads): the rest on this thread
            for start, end in parts[1 + len(futures):]:
                _pread_part(fd, view[start:end], offset_bytes + start, name)
        _pread_part(fd, view[parts[0][0]:parts[0][1]], offset_bytes, name)
    finally:
        # every part has ended before the caller closes fd or reuses the buffer, whichever part failed
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()  # a later part's error (truncated file)


def _pread_part(fd: int, view: memoryview, offset_bytes: int, name: str) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset_bytes + done)
        if count <= 0:
            raise AdapterFormatError(f"tensor {name!r}: {SAFETENSORS_NAME} is truncated")
        done += count


def _parallel_read_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = concurrent.futures.ThreadPoolExecutor(PARALLEL_READ_PARTS - 1,
                                                               thread_name_prefix="loraplex-pread")
        return _read_pool


def _forget_read_pool_in_child() -> None:
    """After ``fork`` the parent's pool has no threads in the child: the child starts its own."""
    global _read_pool, _read_pool_lock
    _read_pool, _read_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_read_pool_in_child)
