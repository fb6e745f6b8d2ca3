"""Platform commands of the ``loraplex`` CLI, added by ``loraplex.cli`` through
:func:`add_commands`:

    loraplex serve --model DIR_OR_DEMO [--host H --port P --served-model-name N ...engine flags] [--no-engine-process | --replicas N]
    loraplex tenant create NAME [--requests-per-minute N --tokens-per-minute N --max-adapters N --max-upload-mb X]
    loraplex tenant list
    loraplex key create TENANT
    loraplex adapter upload TENANT NAME PATH [--model DIR_OR_DEMO]
    loraplex demo up [--host H --port P --cache-dir DIR --data-dir DIR]   (loraplex.platform.demo)

``add_commands(subparsers, mount_console=fn)``: ``serve`` and ``demo up`` call
``fn(app)`` on the app they run (``loraplex.cli`` passes the Gradio console's
mounter; the platform never imports the console).

Engine flags are generated from ``EngineConfig``'s fields (``engine_options.add_engine_flags``:
``--block-size``, ...) and checked by its rules when parsed. Flags left out fall back to ``LORAPLEX_*``
environment variables, then to defaults (``Settings``): every flag defaults
to ``argparse.SUPPRESS`` so only the flags given reach ``Settings(**flags)``.
Run in a source checkout, the storage defaults are ``make serve``'s (``.cache/data``,
``.cache``; see ``Settings``), so these commands act on the demo server's registry.
Errors print one ``error: ...`` line and exit with status 2 (``loraplex.platform.user_errors.fail``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.platform.engine_options import add_engine_flags
from loraplex.platform.user_errors import fail
from loraplex.platform.demo import add_demo_command

_S = argparse.SUPPRESS


MountConsole = Callable[[Any], None]
"""``fn(app: FastAPI) -> None``: mounts a console on the app that ``serve`` / ``demo up`` run."""


def add_commands(subparsers: argparse._SubParsersAction, *, mount_console: MountConsole | None = None) -> None:
    """Add ``serve``, ``tenant``, ``key``, ``adapter`` and ``demo``; each sets ``handler(args) -> exit status``.

    ``mount_console``: called on the app of ``serve`` and ``demo up`` (None: the API runs alone).
    """
    _add_serve(subparsers, mount_console)
    tenant = subparsers.add_parser("tenant", help="manage tenants").add_subparsers(
        dest="tenant_command", required=True, metavar="ACTION")
    create = tenant.add_parser("create", help="create a tenant")
    create.add_argument("name")
    create.add_argument("--requests-per-minute", type=int, default=None)
    create.add_argument("--tokens-per-minute", type=int, default=None)
    create.add_argument("--max-adapters", type=int, default=None)
    create.add_argument("--max-upload-mb", type=float, default=None)
    create.add_argument("--weight", type=float, default=None, help="fair-scheduler share (default 1)")
    create.add_argument("--max-concurrent-requests", type=int, default=None)
    create.add_argument("--max-queued-requests", type=int, default=None)
    create.add_argument("--max-queue-time-s", type=float, default=None)
    _add_storage_flags(create)
    create.set_defaults(handler=_tenant_create)
    listing = tenant.add_parser("list", help="list tenants (name, limits, adapter and key counts)")
    _add_storage_flags(listing)
    listing.set_defaults(handler=_tenant_list)

    key = subparsers.add_parser("key", help="manage tenant API keys").add_subparsers(
        dest="key_command", required=True, metavar="ACTION")
    key_create = key.add_parser("create", help="create an API key (printed once)")
    key_create.add_argument("tenant")
    _add_storage_flags(key_create)
    key_create.set_defaults(handler=_key_create)

    adapter = subparsers.add_parser("adapter", help="manage adapters").add_subparsers(
        dest="adapter_command", required=True, metavar="ACTION")
    upload = adapter.add_parser("upload", help="validate and store a PEFT adapter (folder, .zip or .tar.gz)")
    upload.add_argument("tenant")
    upload.add_argument("name")
    upload.add_argument("path", type=Path)
    upload.add_argument("--model", default=_S,
                        help="base model to validate against: HF folder or demo model name such as smollm2 "
                             "(default: LORAPLEX_MODEL)")
    upload.add_argument("--served-model-name", default=_S)
    upload.add_argument("--max-lora-rank", type=int, default=_S)
    upload.add_argument("--lora-target-modules", default=_S,
                        help="the modules the server serves LoRA on, comma-separated (LORAPLEX_LORA_TARGET_MODULES; "
                             "default: every module)")
    upload.add_argument("--cache-dir", type=Path, default=_S, help="prepared demo models (LORAPLEX_CACHE_DIR)")
    _add_storage_flags(upload)
    upload.set_defaults(handler=_adapter_upload)

    add_demo_command(subparsers, mount_console)


def _add_storage_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=_S, help="registry and adapters (LORAPLEX_DATA_DIR)")
    parser.add_argument("--database-url", default=_S, help="SQLAlchemy URL (LORAPLEX_DATABASE_URL)")
    parser.add_argument("--redis-url", default=_S, help="redis://... (LORAPLEX_REDIS_URL)")


def _add_serve(subparsers: argparse._SubParsersAction, mount_console: MountConsole | None) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("--model", default=_S, help="HF model folder or demo model name (env LORAPLEX_MODEL)")
    serve.add_argument("--served-model-name", default=_S,
                       help="the base model's id in the API (env LORAPLEX_SERVED_MODEL_NAME; default: the model's)")
    serve.add_argument("--host", default=_S, help="address to listen on (env LORAPLEX_HOST; default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=_S, help="port to listen on (env LORAPLEX_PORT; default 8000)")
    add_engine_flags(serve)  # one flag per EngineConfig field (engine_options.py)
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=_S,
                       help="run the engine in a process of its own (env LORAPLEX_ENGINE_PROCESS; default: yes "
                            "unless --replicas; --no-engine-process: a thread of the server)")
    serve.add_argument("--replicas", type=int, default=_S,
                       help="N engine replicas on Ray Serve with adapter-aware routing (needs loraplex[cluster])")
    serve.add_argument("--ray-address", default=_S, help="Ray cluster to join (default: start a local one)")
    serve.add_argument("--replica-num-gpus", type=float, default=_S, help="GPUs per replica (default 1 on CUDA)")
    serve.add_argument("--replica-num-cpus", type=float, default=_S, help="CPUs Ray reserves per replica (default 1)")
    serve.add_argument("--replica-max-ongoing-requests", type=int, default=_S,
                       help="engine requests one replica takes at once; more wait in the router (default: max-num-seqs)")
    serve.add_argument("--routing-max-imbalance", type=int, default=_S,
                       help="requests in flight by which a replica holding the adapter may exceed the least loaded "
                            "one and still be preferred (default 4)")
    serve.add_argument("--shutdown-stream-grace-s", type=float, default=_S,
                       help="on Ctrl-C / SIGTERM, streams still open may go on this long, then end with a "
                            "server_shutting_down error event (env LORAPLEX_SHUTDOWN_STREAM_GRACE_S; default 20)")
    serve.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=_S,
                       help="after start-up, freeze the heap out of the garbage collector's walks (env "
                            "LORAPLEX_GC_FREEZE; default: yes)")
    serve.add_argument("--cache-dir", type=Path, default=_S, help="prepared models (LORAPLEX_CACHE_DIR)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=_S,
                       help="server log level (env LORAPLEX_LOG_LEVEL; default info)")
    _add_storage_flags(serve)
    serve.set_defaults(handler=functools.partial(_serve, mount_console=mount_console))


_TENANT_FLAGS = ("requests_per_minute", "tokens_per_minute", "max_adapters", "max_upload_mb", "weight",
                 "max_concurrent_requests", "max_queued_requests", "max_queue_time_s")
_NOT_SETTINGS = {"command", "handler", "tenant_command", "key_command", "adapter_command", "name", "tenant",
                 "path", "accepts_any_arguments", *_TENANT_FLAGS}


def settings_from_args(args: argparse.Namespace):
    """``Settings`` from the flags given (others: environment, then defaults).

    Raises ``pydantic.ValidationError`` naming the bad field.
    """
    from loraplex.platform.settings import Settings

    return Settings(**{k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS})


STARTUP_FAILURE = 3
"""Exit status of ``serve`` when the server never listened (as ``uvicorn.run``'s)."""


def _fail(message: str) -> int:
    return fail(message)


def _error_text(exc: ValueError | OSError) -> str:
    """One line for ``exc``: an engine option's error names its flag and env var (``option_error_text``)."""
    from loraplex.engine.config import ConfigError
    from loraplex.platform.engine_options import option_error_text

    return option_error_text(exc) if isinstance(exc, ConfigError) else str(exc)


def _serve(args: argparse.Namespace, *, mount_console: MountConsole | None = None) -> int:
    import uvicorn
    from pydantic import ValidationError

    from loraplex.platform.core.signals import python_ctrl_c, uvicorn_server
    from loraplex.platform.main import create_app
    from loraplex.platform.settings import validation_error_text

    try:
        settings = settings_from_args(args)
        if not settings.model:
            return _fail("--model (or LORAPLEX_MODEL) is required")
        app = create_app(settings)
    except ValidationError as exc:
        return _fail(validation_error_text(exc))
    except (ValueError, FileNotFoundError) as exc:
        return _fail(_error_text(exc))
    if mount_console is not None:
        mount_console(app)
    server = uvicorn_server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level))
    try:
        python_ctrl_c()
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down: not an error
        pass
    if not server.started:  # it logged why (the port is taken, the engine failed to start): uvicorn.run's status
        return STARTUP_FAILURE
    return 0


def _with_context(args: argparse.Namespace, action) -> int:
    from pydantic import ValidationError

    from loraplex.platform.context import build_context
    from loraplex.platform.errors import PlatformError
    from loraplex.platform.settings import validation_error_text

    try:
        ctx = build_context(settings_from_args(args), None, out=sys.stderr)
    except ValidationError as exc:
        return _fail(validation_error_text(exc))
    except ValueError as exc:
        return _fail(_error_text(exc))
    try:
        with ctx.sessions() as session:
            result = action(ctx, session)
    except PlatformError as exc:
        return _fail(exc.message)
    except ValidationError as exc:  # a bad field value: one line naming it, not pydantic's report
        return _fail(validation_error_text(exc))
    except (ValueError, OSError) as exc:
        return _fail(_error_text(exc))
    finally:
        ctx.db.dispose()
    if isinstance(result, list):
        print(json.dumps([item.model_dump(mode="json") for item in result], indent=2))
    else:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    return 0


def _tenant_create(args: argparse.Namespace) -> int:
    from loraplex.platform.schemas import TenantCreate
    from loraplex.platform.services import tenants

    fields = {k: getattr(args, k) for k in _TENANT_FLAGS if getattr(args, k) is not None}
    return _with_context(args, lambda ctx, s: tenants.create_tenant(
        session=s, ctx=ctx, spec=TenantCreate(name=args.name, **fields)))


def _tenant_list(args: argparse.Namespace) -> int:
    from loraplex.platform.services import tenants

    return _with_context(args, lambda ctx, s: tenants.list_tenants(session=s))


def _key_create(args: argparse.Namespace) -> int:
    from loraplex.platform.services import tenants

    return _with_context(args, lambda ctx, s: tenants.create_api_key(session=s, ctx=ctx, tenant_name=args.tenant))


def _adapter_upload(args: argparse.Namespace) -> int:
    from loraplex.platform.context import attach_model_spec
    from loraplex.platform.services import adapters, tenants

    def action(ctx, session):
        attach_model_spec(ctx)
        files = _open_parts(args.path)
        try:
            owner = tenants.tenant_context(session=session, name=args.tenant)
            return adapters.upload_adapter(session=session, ctx=ctx, tenant=owner, name=args.name, parts=files)
        finally:
            for part in files:
                part.fileobj.close()

    return _with_context(args, action)


def _open_parts(path: Path):
    """The upload parts of a folder (its two PEFT files) or of one archive file."""
    from loraplex.platform.services.uploads import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME, UploadPart

    if not path.exists():
        raise ValueError(f"path {str(path)!r} does not exist")
    if path.is_dir():
        pickled = sorted(f.name for f in path.iterdir() if f.name.lower().endswith(PICKLE_SUFFIXES))
        if pickled and not (path / WEIGHTS_NAME).is_file():  # as the REST upload says it
            raise ValueError(f"{str(path / pickled[0])!r}: pickle weights are refused; upload {WEIGHTS_NAME} "
                             "(safetensors only)")
        files = [(path / CONFIG_NAME, "application/json"), (path / WEIGHTS_NAME, "application/octet-stream")]
    else:
        files = [(path, "application/octet-stream")]
    parts = []
    for file, content_type in files:
        if not file.is_file():
            raise ValueError(f"{str(file)!r} is missing")
        parts.append(UploadPart(filename=file.name, content_type=content_type, fileobj=open(file, "rb"),
                                size_bytes=file.stat().st_size))
    return parts
