"""The ``loraplex`` command line (``[project.scripts] loraplex = "loraplex.cli:main"``).

Commands defined here need only the engine's dependencies:

    loraplex models prepare smollm2 [--cache-dir DIR] [--force]
    loraplex models list [--cache-dir DIR]

``--cache-dir`` defaults to the platform settings' ``cache_dir`` (env
``LORAPLEX_CACHE_DIR``, else ``./.cache`` in a source checkout as ``make serve``,
else ``~/.cache/loraplex``) when the ``serve`` extra is installed, else to
``~/.cache/loraplex``; it is resolved when a command runs, so that ``--help``
imports nothing heavy (no torch, transformers, pydantic, gradio: < 1 s).

User errors (a bad value, a missing file or folder, a refused request) print one
``error: ...`` line to stderr and exit with status 2, as argparse's usage errors;
no traceback.

The platform adds its commands (``serve``, ``tenant``, ``key``, ``adapter``, ``demo``)
through ``loraplex.platform.cli.add_commands(subparsers, mount_console=fn)``;
``fn(app)`` mounts the Gradio console (``loraplex.ui``) on the app that ``serve``
and ``demo up`` run, so the platform never imports the console. Contract: for each
command it calls ``subparsers.add_parser(...)`` and
``set_defaults(handler=fn)`` with ``fn(args: argparse.Namespace) -> int`` (the
exit status). When that module exists but one of the ``serve`` extra's
packages is missing, the platform commands are still listed and each prints
the ``pip install 'loraplex[serve]'`` hint and exits with status 2; which
packages belong to the ``serve`` extra is read from the installed package's
metadata (``importlib.metadata``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from loraplex.engine.demo_models import (
    DEMO_MODEL_ALIASES,
    DEMO_MODELS,
    canonical_demo_name,
    default_cache_dir,
    demo_alias,
    demo_model_dir,
    is_prepared,
)
from loraplex.platform.core.signals import exit_now
from loraplex.platform.user_errors import fail

logger = logging.getLogger(__name__)

PLATFORM_CLI_MODULE = "loraplex.platform.cli"
PLATFORM_COMMANDS = ("serve", "tenant", "key", "adapter", "demo")
"""Commands the platform provides; listed with an install hint when its dependencies are missing."""

SERVE_EXTRA_HINT = "pip install 'loraplex[serve]'"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``loraplex`` command line; returns the exit status.

    ``argv`` defaults to ``sys.argv[1:]``. Usage errors exit through argparse (status 2). Ctrl-C before a server
    listens ends the command at once with status 130 (:func:`_interrupted`); a server, once it listens, shuts down
    gracefully on it (uvicorn's handlers replace ours meanwhile).
    """
    previous = _exit_on_ctrl_c()
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "accepts_any_arguments", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return args.handler(args)
    except USER_ERRORS as exc:
        return fail(str(exc))
    except KeyboardInterrupt:  # SIGINT handled by Python after all (our handler not installed, or raised by hand)
        print(INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


INTERRUPTED = "loraplex: interrupted"
"""The one line Ctrl-C before a server listens prints (exit status 130)."""


def _exit_on_ctrl_c():
    """Install :func:`_interrupted` as the SIGINT handler; returns the handler it replaced, or None when it left
    SIGINT alone (ignored, as in a shell's background job; already customised; or not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None
    signal.signal(signal.SIGINT, _interrupted)
    return previous


def _interrupted(signum, frame) -> None:
    """Ctrl-C while a command prepares (imports, model download or load): say so, terminate the processes it
    started (the engine process) and exit with status 130 at once. Not a ``KeyboardInterrupt``: raised inside a C
    extension's import (torch, numpy) that can abort the process or leave modules half-imported, and raised inside
    a finalizer it is dropped."""
    exit_now(INTERRUPTED)


USER_ERRORS = (ValueError, OSError)
"""Exceptions that mean a bad argument or a missing/unreadable file (``FileNotFoundError``,
``pydantic.ValidationError`` included): reported in one line, exit status 2."""
def build_parser(cache_dir_default: Path | None = None) -> argparse.ArgumentParser:
    """The full parser: ``models`` commands plus the platform's, if present.

    ``cache_dir_default`` is the ``--cache-dir`` default; None = resolved when the command runs
    (:func:`cache_dir_of`).
    """
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_model_commands(subparsers, cache_dir_default)
    add_platform_commands(subparsers)
    return parser


def add_model_commands(subparsers: argparse._SubParsersAction, cache_dir_default: Path | None) -> None:
    """``models prepare NAME`` and ``models list``."""
    models = subparsers.add_parser("models", help="prepare and list the offline demo models")
    actions = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    names = sorted(DEMO_MODELS) + sorted(DEMO_MODEL_ALIASES)

    prepare = actions.add_parser("prepare", help="build a demo model folder in the cache")
    prepare.add_argument("name", choices=names, help="demo model name")
    prepare.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    _add_cache_dir_option(prepare, cache_dir_default)
    prepare.set_defaults(handler=_prepare_model)

    listing = actions.add_parser("list", help="list demo models and whether they are prepared")
    _add_cache_dir_option(listing, cache_dir_default)
    listing.set_defaults(handler=_list_models)


def add_platform_commands(subparsers: argparse._SubParsersAction) -> None:
    """Let ``loraplex.platform.cli`` add its commands, or add hint-printing stand-ins when its extra is missing."""
    module, missing = _import_platform_cli()
    if module is not None:
        module.add_commands(subparsers, mount_console=mount_console_if_installed)
        return
    if missing is None:
        return  # this build has no platform package
    for command in PLATFORM_COMMANDS:
        stub = subparsers.add_parser(command, add_help=False, help=f"(needs {SERVE_EXTRA_HINT})")
        stub.set_defaults(handler=functools.partial(_missing_extra, command, missing), accepts_any_arguments=True)


def _import_platform_cli() -> tuple[ModuleType | None, str | None]:
    """``(module, None)``; ``(None, missing_module)`` when a ``serve`` extra package is absent;
    ``(None, None)`` when the platform CLI module does not exist. Any other import error propagates.
    """
    try:
        return importlib.import_module(PLATFORM_CLI_MODULE), None
    except ModuleNotFoundError as exc:
        if exc.name in ("loraplex.platform", PLATFORM_CLI_MODULE):
            return None, None
        if _is_serve_extra(exc.name):
            return None, exc.name
        raise


def mount_console_if_installed(app: Any) -> None:
    """Mount the Gradio console at ``/ui`` on ``app`` (a FastAPI app); without Gradio the API runs alone."""
    try:
        from loraplex.ui import mount_console
    except ImportError as exc:
        logger.warning("console not mounted at /ui (%s): install 'loraplex[serve]'", exc)
        return
    mount_console(app)


@functools.cache
def serve_extra_distributions() -> frozenset[str]:
    """Canonical names of the ``serve`` extra's distributions, from loraplex's installed metadata.

    Empty when loraplex is not installed (a source tree on ``PYTHONPATH``): import errors then propagate.
    """
    try:
        requirements = [Requirement(line) for line in importlib.metadata.requires("loraplex") or []]
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    return frozenset(
        canonicalize_name(req.name)
        for req in requirements
        if req.marker is not None and req.marker.evaluate({"extra": "serve"}) and not req.marker.evaluate({"extra": ""})
    )


def _is_serve_extra(module: str | None) -> bool:
    """True for a module of one of the ``serve`` extra's distributions (``"sqlalchemy.orm"``, ``"multipart"``).

    An installed module is mapped to its distribution; a missing one is taken as its own distribution name.
    """
    if module is None:
        return False
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top) or [top]
    return any(canonicalize_name(dist) in serve_extra_distributions() for dist in dists)


def _missing_extra(command: str, missing: str, args: argparse.Namespace) -> int:
    return fail(f"`loraplex {command}` needs the platform's optional dependencies "
                f"(module {missing!r} is not installed): {SERVE_EXTRA_HINT}")


def _add_cache_dir_option(parser: argparse.ArgumentParser, default: Path | None) -> None:
    shown = default or "LORAPLEX_CACHE_DIR, else ./.cache in a loraplex checkout, else ~/.cache/loraplex"
    parser.add_argument("--cache-dir", type=Path, default=default, help=f"cache root holding models/ (default: {shown})")


def cache_dir_of(args: argparse.Namespace) -> Path:
    """``--cache-dir`` if given, else :func:`_cache_dir_default`."""
    return args.cache_dir if args.cache_dir is not None else _cache_dir_default()


def _cache_dir_default() -> Path:
    """Default ``--cache-dir``: ``Settings().cache_dir`` of the platform (which reads
    ``LORAPLEX_CACHE_DIR``), or ``default_cache_dir()`` when the ``serve`` extra is not installed.
    """
    try:
        from loraplex.platform.settings import Settings
    except ModuleNotFoundError as exc:
        if exc.name in ("loraplex.platform", "loraplex.platform.settings") or _is_serve_extra(exc.name):
            return default_cache_dir()
        raise
    return Settings().cache_dir


def _prepare_model(args: argparse.Namespace) -> int:
    name = canonical_demo_name(args.name)
    try:
        DEMO_MODELS[name](cache_dir_of(args), force=args.force, progress=_stage_printer("prepare"))
    except ModuleNotFoundError as exc:
        return fail(str(exc))
    return 0


def _stage_printer(label: str):
    """``print`` with the seconds elapsed since this call: ``[prepare +12s] ...``."""
    start = time.monotonic()
    return lambda line: print(f"[{label} +{time.monotonic() - start:.0f}s] {line}", flush=True)


def _list_models(args: argparse.Namespace) -> int:
    rows = [("NAME", "ALIAS", "STATUS", "PATH")]
    cache_dir = cache_dir_of(args)
    for name in sorted(DEMO_MODELS):
        folder = demo_model_dir(name, cache_dir)
        rows.append((name, demo_alias(name), "prepared" if is_prepared(folder) else "not prepared", str(folder)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
