"""Upload checks in a worker process, under a deadline and a memory cap.

Checking an upload runs code on attacker-chosen input: archive directories, JSON, the
safetensors header, regular expressions from ``adapter_config.json``, tensor scans and
hashing. In the server process, pure-Python or C work that holds the GIL (a regex match,
``json.loads``) stops the event loop and the engine thread with it. So the parent only
copies the uploaded bytes to files (I/O, the GIL released) and waits; a worker process
does everything else and is killed at the deadline.

Flow of :meth:`UploadValidator.run` (called from a threadpool thread):

1. the parts are copied to ``<staging>/incoming/<i>``;
2. a worker process, forked from a ``multiprocessing`` forkserver that has imported this
   module (and so torch and ``loraplex.adapters``) once, runs ``check`` (default
   :func:`check_upload`): ``uploads.stage_upload`` into ``<staging>/adapter`` then
   ``validate_adapter_dir`` against the served base model and dtype; its address space is
   capped at its size at fork plus ``memory_bytes`` (``RLIMIT_AS``), torch at one thread;
3. the parent waits at most ``deadline_s`` for the answer, then kills the worker.

At most ``max_concurrent`` workers run at once; an upload that finds none free within
``deadline_s`` gets 503.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import shutil
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from loraplex.platform.core.signals import sigint_blocked
from loraplex.platform.errors import InvalidRequest, PlatformError, ServiceUnavailable
from loraplex.platform.services.uploads import UploadLimits, UploadPart, stage_upload

if TYPE_CHECKING:  # torch and the adapters package load in the worker (and at the first upload) only
    import torch

    from loraplex.adapters import AdapterInfo, BaseModelSpec

logger = logging.getLogger(__name__)
_COPY_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class StagedPart:
    """An uploaded file copied to ``path`` (``filename``/``content_type`` as the client sent them)."""

    filename: str
    content_type: str | None
    path: str
    size_bytes: int


@dataclass(frozen=True)
class UploadCheck:
    """What a worker checks (picklable): the staged ``parts``, the folder ``dest`` to extract the
    two PEFT files into, the upload ``limits``, and the model / rank / dtype to validate against."""

    parts: tuple[StagedPart, ...]
    dest: str
    limits: UploadLimits
    spec: BaseModelSpec
    max_lora_rank: int
    serving_dtype: torch.dtype


def check_upload(job: UploadCheck) -> AdapterInfo:
    """Extract and validate an upload (runs in the worker). Raises the ``PlatformError`` of
    ``stage_upload`` or the ``AdapterError`` of ``validate_adapter_dir``."""
    from loraplex.adapters import validate_adapter_dir

    dest = Path(job.dest)
    dest.mkdir()
    with _opened(job.parts) as parts:
        stage_upload(parts, dest, job.limits)
    return validate_adapter_dir(dest, job.spec, job.max_lora_rank, serving_dtype=job.serving_dtype)


class _opened:
    """Context manager: ``StagedPart``s as ``UploadPart``s with open files, closed on exit."""

    def __init__(self, parts: tuple[StagedPart, ...]) -> None:
        self.parts = parts
        self.files: list = []

    def __enter__(self) -> list[UploadPart]:
        opened = []
        for part in self.parts:
            handle = open(part.path, "rb")  # noqa: SIM115 - closed in __exit__
            self.files.append(handle)
            opened.append(UploadPart(part.filename, part.content_type, handle, part.size_bytes))
        return opened

    def __exit__(self, *exc: object) -> None:
        for handle in self.files:
            handle.close()


def stage_parts(parts: list[UploadPart], folder: Path) -> tuple[StagedPart, ...]:
    """Copy each part's bytes (from its start) to ``folder/<i>`` (created). Raises ``OSError``."""
    folder.mkdir(parents=True)
    staged = []
    for index, part in enumerate(parts):
        path = folder / str(index)
        part.fileobj.seek(0)
        with open(path, "xb") as out:
            shutil.copyfileobj(part.fileobj, out, _COPY_CHUNK_BYTES)
        staged.append(StagedPart(part.filename, part.content_type, str(path), path.stat().st_size))
    return tuple(staged)


class UploadValidator:
    """Runs ``check(job)`` in a worker process (see the module docstring).

    - ``deadline_s``: wall-clock limit of one check (worker start excluded); past it the
      worker is killed and the upload refused.
    - ``max_concurrent``: workers at once.
    - ``memory_bytes``: address space a worker may add to what it had at fork (None: no cap).
    - ``check``: a picklable (module-level) function ``UploadCheck -> AdapterInfo``.
    """

    def __init__(self, *, deadline_s: float, max_concurrent: int, memory_bytes: int | None,
                 check: Callable[[UploadCheck], AdapterInfo] = check_upload) -> None:
        self.deadline_s = deadline_s
        self.memory_bytes = memory_bytes
        self.check = check
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload([__name__, "torch", "loraplex.adapters"])

    def warm_up(self) -> None:
        """Start the forkserver now (it imports torch once), so the first upload does not wait for it. Started
        with SIGINT blocked: a Ctrl-C while it imports does not kill it with a traceback (it ignores SIGINT
        once its imports are done; the workers it forks keep the mask: the server stops them)."""
        from multiprocessing import forkserver

        with sigint_blocked():
            forkserver.ensure_running()

    def run(self, job: UploadCheck) -> AdapterInfo:
        """``check(job)`` in a worker. Raises what the check raises (``AdapterError``,
        ``PlatformError``), ``InvalidRequest`` (400: deadline passed, memory cap hit, worker
        died or failed unexpectedly; details logged) or ``ServiceUnavailable`` (503: no free
        worker within ``deadline_s``, or no worker process could be started)."""
        if not self._slots.acquire(timeout=self.deadline_s):
            raise ServiceUnavailable("too many uploads are being validated right now; retry shortly",
                                     code="upload_validation_busy")
        try:
            return self._run(job)
        finally:
            self._slots.release()

    def _run(self, job: UploadCheck) -> AdapterInfo:
        receiver, sender = self._mp.Pipe(duplex=False)
        try:
            worker = self._mp.Process(target=_worker_main, args=(sender, self.check, job, self.memory_bytes),
                                      name="loraplex-upload-check", daemon=True)
            with sigint_blocked():  # in case this starts the forkserver (see warm_up)
                worker.start()
        except OSError as exc:  # no process could be started (fork limits, memory, the forkserver gone)
            receiver.close()
            sender.close()
            logger.error("upload check could not start a worker: %s", exc)
            raise ServiceUnavailable("the adapter checker could not be started; retry shortly",
                                     code="upload_validation_unavailable") from None
        except BaseException:
            receiver.close()
            sender.close()
            raise
        sender.close()
        try:
            if not receiver.poll(self.deadline_s):
                logger.warning("upload check (pid %s) passed its %.3g s deadline: killed", worker.pid,
                               self.deadline_s)
                raise InvalidRequest(f"checking the adapter took longer than {self.deadline_s:g} s; the upload is "
                                     "refused (very large or deliberately slow to check?)", param="file",
                                     code="validation_timeout")
            try:
                kind, value = receiver.recv()
            except (EOFError, OSError):
                worker.join(5)
                logger.error("upload check (pid %s) died with exit code %s", worker.pid, worker.exitcode)
                raise InvalidRequest("the adapter could not be checked (the checker stopped)", param="file",
                                     code="validation_failed") from None
        finally:
            receiver.close()
            if worker.is_alive():
                worker.kill()
            worker.join(5)
        if kind == "ok":
            return value
        if kind == "refused":
            raise value
        if kind == "memory":
            raise InvalidRequest(f"checking the adapter needs more than {self.memory_bytes} bytes of memory; "
                                 "the upload is refused", param="file", code="validation_memory")
        logger.error("upload check failed unexpectedly:\n%s", value)
        raise InvalidRequest("the adapter could not be checked", param="file", code="validation_failed")


def _worker_main(conn: multiprocessing.connection.Connection, check: Callable[[UploadCheck], AdapterInfo],
                 job: UploadCheck, memory_bytes: int | None) -> None:
    """The worker: bound threads and memory, run ``check``, send ``(kind, value)`` back."""
    import torch

    from loraplex.adapters import AdapterError

    torch.set_num_threads(1)
    try:
        if memory_bytes is not None:
            _cap_address_space(memory_bytes)
        message = ("ok", check(job))
    except (AdapterError, PlatformError) as exc:
        message = ("refused", exc)
    except MemoryError:
        message = ("memory", None)
    except RecursionError:
        message = ("refused", InvalidRequest("the upload is nested too deeply to be checked", param="file",
                                             code="invalid_adapter"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which logs it
        message = ("crashed", traceback.format_exc())
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):  # the server went away meanwhile (shut down): nobody to tell
        pass
    finally:
        conn.close()


def _cap_address_space(extra_bytes: int) -> None:
    import resource

    try:
        with open("/proc/self/statm") as handle:  # Linux: the address space's size in pages
            pages = int(handle.read().split()[0])
    except OSError:
        return
    limit = pages * resource.getpagesize() + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
