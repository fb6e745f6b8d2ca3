"""Turn an upload into a folder holding exactly ``adapter_config.json`` and
``adapter_model.safetensors``, safely.

Accepted: one ``.zip`` / ``.tar.gz`` archive, or the two PEFT files. Archives
are checked before anything is extracted:

- every member name is relative, without ``..`` components, backslashes or
  drive letters; members are regular files or folders (no symlinks, hard
  links, devices, FIFOs);
- at most ``max_members`` members; the summed uncompressed size fits the
  byte limit; for zip, no member's uncompressed/compressed ratio exceeds
  ``max_compression_ratio`` (zip bombs); for tar.gz the headers are read in a
  first pass over a decompressed stream capped at the byte limit;
- the two PEFT files are present once each; pickle weights (``.bin``, ``.pt``,
  ``.pth``, ``.pkl``, ``.ckpt``) are refused ("safetensors only"); other
  members (e.g. README.md) are ignored.

Only the two files are written, under fixed names inside the staging folder
(never an archive path), with their actual byte counts checked again while
copying (archive headers can lie).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from loraplex.platform.errors import InvalidRequest, PayloadTooLarge, ServiceUnavailable, UnsupportedMediaType

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_NAME, WEIGHTS_NAME)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
GZIP_MAGIC = b"\x1f\x8b"
ARCHIVE_CONTENT_TYPES = {
    "application/zip", "application/x-zip-compressed", "application/x-zip", "application/gzip",
    "application/x-gzip", "application/x-tar", "application/x-gtar", "application/x-compressed-tar",
    "application/x-tgz", "application/octet-stream",
}
FILE_CONTENT_TYPES = {
    CONFIG_NAME: {"application/json", "text/plain", "application/octet-stream"},
    WEIGHTS_NAME: {"application/octet-stream", "application/x-safetensors"},
}
_COPY_CHUNK_BYTES = 1 << 20
_TAR_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class UploadPart:
    """One uploaded file: ``filename`` and ``content_type`` as sent by the client,
    ``fileobj`` positioned anywhere (it is rewound), ``size_bytes`` its length."""

    filename: str
    content_type: str | None
    fileobj: BinaryIO
    size_bytes: int


@dataclass(frozen=True)
class UploadLimits:
    """``max_bytes``: largest upload and largest uncompressed content (bytes);
    ``max_members``: most archive members; ``max_compression_ratio``: zip-bomb guard."""

    max_bytes: int
    max_members: int
    max_compression_ratio: float


def stage_upload(parts: list[UploadPart], dest: Path, limits: UploadLimits) -> None:
    """Write the two PEFT files of ``parts`` into the (existing, empty) folder ``dest``.

    Raises ``InvalidRequest`` (400: wrong file set, unsafe or malformed archive),
    ``PayloadTooLarge`` (413: size or member limits, zip bomb) or
    ``UnsupportedMediaType`` (415: content type, pickle weights, not an archive).
    """
    total = sum(p.size_bytes for p in parts)
    if total > limits.max_bytes:
        raise PayloadTooLarge(f"upload is {total} bytes; the limit is {limits.max_bytes} bytes", param="file")
    if len(parts) == 1 and parts[0].filename in PEFT_FILES:  # one of the two plain files, not an archive
        raise InvalidRequest(f"only {parts[0].filename!r} was sent: send both {list(PEFT_FILES)} in `files`, or one "
                             ".zip or .tar.gz archive of them in `file`", param="files")
    if len(parts) == 1:
        _stage_archive(parts[0], dest, limits)
    elif len(parts) == 2:
        _stage_files(parts, dest, limits)
    else:
        raise InvalidRequest(f"expected one archive in `file` or the two files {list(PEFT_FILES)} in `files`; "
                             f"got {len(parts)} files", param="files")


# -- two plain files -------------------------------------------------------------------------------
def _stage_files(parts: list[UploadPart], dest: Path, limits: UploadLimits) -> None:
    by_name: dict[str, UploadPart] = {}
    for part in parts:
        name = part.filename or ""
        if name.lower().endswith(PICKLE_SUFFIXES):
            raise UnsupportedMediaType(f"{name!r}: pickle weights are refused; upload {WEIGHTS_NAME} "
                                       "(safetensors only)", param="files")
        if name not in PEFT_FILES:
            raise InvalidRequest(f"unexpected file {name!r}: the two files must be named {list(PEFT_FILES)}",
                                 param="files")
        if name in by_name:
            raise InvalidRequest(f"{name!r} was sent twice", param="files")
        _check_content_type(part.content_type, FILE_CONTENT_TYPES[name], name)
        by_name[name] = part
    for name, part in by_name.items():
        part.fileobj.seek(0)
        _copy_bounded(part.fileobj, dest / name, part.size_bytes, name)


# -- archives --------------------------------------------------------------------------------------
def _stage_archive(part: UploadPart, dest: Path, limits: UploadLimits) -> None:
    _check_content_type(part.content_type, ARCHIVE_CONTENT_TYPES, part.filename or "file")
    part.fileobj.seek(0)
    head = part.fileobj.read(4)
    part.fileobj.seek(0)
    name = (part.filename or "").lower()
    if name.endswith(PICKLE_SUFFIXES):
        raise UnsupportedMediaType(f"{part.filename!r}: pickle weights are refused (safetensors only)", param="file")
    if head.startswith(ZIP_MAGIC):
        _extract_zip(part, dest, limits)
    elif head.startswith(GZIP_MAGIC):
        _extract_tar_gz(part, dest, limits)
    else:
        raise UnsupportedMediaType(f"{part.filename!r} is neither a .zip nor a .tar.gz archive (by its content)",
                                   param="file")


def _extract_zip(part: UploadPart, dest: Path, limits: UploadLimits) -> None:
    try:
        archive = zipfile.ZipFile(part.fileobj)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InvalidRequest(f"{part.filename!r}: not a readable zip archive ({exc})", param="file") from None
    with archive:
        infos = archive.infolist()
        _check_member_count(len(infos), limits)
        chosen: dict[str, zipfile.ZipInfo] = {}
        total = 0
        for info in infos:
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            _check_member_name(info.filename)
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise InvalidRequest(f"archive member {info.filename!r} is a {_kind_name(kind)}; only regular "
                                     "files are accepted", param="file")
            if info.is_dir():
                continue
            total += info.file_size
            _check_total(total, limits)
            if info.file_size > 1 << 20 and info.file_size > limits.max_compression_ratio * max(1, info.compress_size):
                raise PayloadTooLarge(f"archive member {info.filename!r} expands {info.file_size} bytes from "
                                      f"{info.compress_size}: compression ratio above "
                                      f"{limits.max_compression_ratio:g} (zip bomb?)", param="file")
            _choose(chosen, info.filename, info)
        _require_peft_files(chosen)
        for base, info in chosen.items():
            try:
                with archive.open(info) as src:
                    _copy_bounded(src, dest / base, info.file_size, info.filename)
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise InvalidRequest(f"archive member {info.filename!r} is corrupt ({exc})", param="file") from None


def _extract_tar_gz(part: UploadPart, dest: Path, limits: UploadLimits) -> None:
    max_stream = limits.max_bytes + (limits.max_members + 2) * 1024 + _TAR_OVERHEAD_BYTES
    chosen: dict[str, tarfile.TarInfo] = {}
    count = total = 0
    for member, _ in _tar_members(part, max_stream):  # pass 1: headers only
        count += 1
        _check_member_count(count, limits)
        _check_member_name(member.name)
        if not (member.isreg() or member.isdir()):
            raise InvalidRequest(f"archive member {member.name!r} is a {_tar_kind(member)}; only regular files "
                                 "are accepted", param="file")
        if member.isreg():
            total += member.size
            _check_total(total, limits)
            _choose(chosen, member.name, member)
    _require_peft_files(chosen)
    wanted = {m.name: base for base, m in chosen.items()}
    for member, tar in _tar_members(part, max_stream):  # pass 2: copy the two files
        if member.isreg() and member.name in wanted:
            src = tar.extractfile(member)
            _copy_bounded(src, dest / wanted[member.name], member.size, member.name)


def _tar_members(part: UploadPart, max_stream_bytes: int) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """Stream the members of a .tar.gz (decompression capped at ``max_stream_bytes``)."""
    part.fileobj.seek(0)
    stream = _CappedReader(gzip.GzipFile(fileobj=part.fileobj, mode="rb"), max_stream_bytes, part.filename)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                yield member, tar
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as exc:
        raise InvalidRequest(f"{part.filename!r}: not a readable .tar.gz archive ({exc})", param="file") from None


class _CappedReader(io.RawIOBase):
    """A read-only stream that raises ``PayloadTooLarge`` past ``limit`` bytes."""

    def __init__(self, inner: BinaryIO, limit: int, filename: str) -> None:
        self.inner, self.limit, self.filename, self.seen = inner, limit, filename, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        self.seen += len(data)
        if self.seen > self.limit:
            raise PayloadTooLarge(f"{self.filename!r} decompresses to more than {self.limit} bytes (archive bomb?)",
                                  param="file")
        buffer[: len(data)] = data
        return len(data)


# -- checks ----------------------------------------------------------------------------------------
def _check_content_type(content_type: str | None, allowed: set[str], what: str) -> None:
    base = (content_type or "application/octet-stream").split(";")[0].strip().lower()
    if base not in allowed:
        raise UnsupportedMediaType(f"{what!r} has content type {base!r}; expected one of {sorted(allowed)}",
                                   param="file")


def _check_member_name(name: str) -> None:
    if not name or "\\" in name or "\x00" in name:
        raise InvalidRequest(f"archive member name {name!r} is not a plain relative path", param="file")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise InvalidRequest(f"archive member {name!r} has an absolute path", param="file")
    if ".." in PurePosixPath(name).parts:
        raise InvalidRequest(f"archive member {name!r} escapes the archive with '..' (path traversal)",
                             param="file")


def _check_member_count(count: int, limits: UploadLimits) -> None:
    if count > limits.max_members:
        raise PayloadTooLarge(f"archive has more than {limits.max_members} members", param="file")


def _check_total(total: int, limits: UploadLimits) -> None:
    if total > limits.max_bytes:
        raise PayloadTooLarge(f"archive content is more than {limits.max_bytes} bytes uncompressed "
                              f"(at least {total})", param="file")


def _choose(chosen: dict, name: str, member) -> None:
    base = PurePosixPath(name).name
    if base.lower().endswith(PICKLE_SUFFIXES):
        raise UnsupportedMediaType(f"archive member {name!r}: pickle weights are refused (safetensors only)",
                                   param="file")
    if base in PEFT_FILES:
        if base in chosen:
            raise InvalidRequest(f"archive holds {base} more than once", param="file")
        chosen[base] = member


def _require_peft_files(chosen: dict) -> None:
    missing = [n for n in PEFT_FILES if n not in chosen]
    if missing:
        raise InvalidRequest(f"archive lacks {missing}; a PEFT adapter needs {list(PEFT_FILES)}", param="file")


def _copy_bounded(src: BinaryIO, target: Path, expected_bytes: int, what: str) -> None:
    """Copy ``src`` to the new file ``target``, refusing more or fewer than ``expected_bytes``.
    A failure to write (disk full) is ``ServiceUnavailable`` (503), not the uploader's fault."""
    written = 0
    with _writing(target) as out:
        while chunk := src.read(_COPY_CHUNK_BYTES):
            written += len(chunk)
            if written > expected_bytes:
                raise PayloadTooLarge(f"{what!r} holds more bytes than its declared {expected_bytes}", param="file")
            out(chunk)
    if written != expected_bytes:
        raise InvalidRequest(f"{what!r} is truncated: {written} of {expected_bytes} bytes", param="file")


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[Callable[[bytes], object]]:
    try:
        out = open(target, "xb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise _storage_error(exc) from None

    def write(chunk: bytes) -> None:
        try:
            out.write(chunk)
        except OSError as exc:
            raise _storage_error(exc) from None

    try:
        yield write
    finally:
        try:
            out.close()
        except OSError as exc:
            raise _storage_error(exc) from None


def _storage_error(exc: OSError) -> ServiceUnavailable:
    logger.error("writing an upload failed: %s", exc)
    return ServiceUnavailable("the server could not store the upload; retry later", code="storage_unavailable")


def _kind_name(kind: int) -> str:
    return {stat.S_IFLNK: "symlink", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
            stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket"}.get(kind, f"special file (mode {kind:o})")


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk():
        return "device"
    if member.isfifo():
        return "FIFO"
    return f"special member (type {member.type!r})"


def remove_tree(path: Path) -> None:
    """Delete a staging or stored folder if it exists."""
    shutil.rmtree(path, ignore_errors=True)
