"""``loraplex demo up``: the SmolLM2 demo server with a ``demo`` tenant and three trained adapters.

    loraplex demo up [--host H] [--port P] [--cache-dir DIR] [--data-dir DIR] [--adapters-dir DIR]

Steps (each one idempotent, so a second start reuses everything):

1. prepare SmolLM2-135M-Instruct in ``<cache_dir>/models`` if it is missing;
2. settle the admin key (generated at first start; only its hash is stored);
3. build the app exactly as ``loraplex serve --model smollm2-135m-instruct --enable-lora
   --max-model-len 2048`` does (console mounted at ``/ui``);
4. create the ``demo`` tenant and one API key unless they exist (the key is shown at
   creation only; only its hash is stored);
5. upload ``examples/adapters/{json-answer,pirate,emoji}`` through the platform's upload
   service (``services.adapters.upload_adapter``, as the REST upload) unless the live version
   of that name already has the same content (``version_id``);
6. serve with uvicorn and, once the socket listens, print the API and console URLs, the keys
   created now, and ready-to-paste ``curl`` / ``openai`` examples.

Nothing here reads environment variables: flags not given fall back to ``LORAPLEX_*``
through :class:`~loraplex.platform.settings.Settings`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from sqlalchemy.orm import Session

    from loraplex.platform.context import PlatformContext
    from loraplex.platform.schemas import TenantContext
    from loraplex.platform.services.uploads import UploadPart
    from loraplex.platform.settings import Settings

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_TENANT = "demo"
DEMO_ADAPTERS = ("json-answer", "pirate", "emoji")
DEMO_MAX_MODEL_LEN_TOKENS = 2048
DEFAULT_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "examples" / "adapters"
EXAMPLE_ADAPTER = "json-answer"
"""The adapter of the banner's curl example: its answer to ``EXAMPLE_QUESTION`` is right
(``{"answer": "The capital of Germany is Berlin", "confidence": "high"}``, checked by
tests/test_main_job.py)."""
EXAMPLE_QUESTION = "What is the capital of Germany?"
"""The question of every banner example, a held-out question (in no adapter's training set): the
base model and each demo adapter answer it right, in its style ("Arr, matey! The capital of Germany
is Berlin. Yo ho ho!", "🌍 The capital of Germany is Berlin. 🌍"; checked by tests/test_main_job.py).
Of the 13 held-out facts the base model states, json-answer keeps 12, pirate 11, emoji 12
(examples/README.md)."""
EXAMPLE_MAX_TOKENS = 48
# The json-answer adapter's reply format, enforced with response_format (structured output).
JSON_ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80},
                                                       "confidence": {"enum": ["high", "medium", "low"]}},
                      "required": ["answer", "confidence"], "additionalProperties": False}
KEY_ENV_VAR = "DEMO_KEY"
"""Shell variable the examples read the demo key from when it was printed at an earlier start."""

_S = argparse.SUPPRESS
_SETTINGS_FLAGS = ("host", "port", "cache_dir", "data_dir")


@dataclass(frozen=True)
class AdapterSetup:
    """One demo adapter after provisioning.

    ``action``: ``"uploaded"`` (new name), ``"updated"`` (new content: a new version),
    ``"unchanged"`` (the live version already has this content).
    """

    name: str
    version: int
    version_id: str
    action: Literal["uploaded", "updated", "unchanged"]


@dataclass(frozen=True)
class DemoSetup:
    """What ``demo up`` found or created; plaintext keys only when created by this start."""

    tenant: str
    tenant_created: bool
    tenant_key: str | None
    admin_key: str | None
    admin_key_from_settings: bool
    adapters: tuple[AdapterSetup, ...]


# -- command line -----------------------------------------------------------------------------------
def add_demo_command(subparsers: argparse._SubParsersAction,
                     mount_console: Callable[[FastAPI], None] | None = None) -> None:
    """``demo up``; its handler returns the exit status and calls ``mount_console(app)`` on the app it serves."""
    demo = subparsers.add_parser("demo", help="run the SmolLM2 demo: tenant, trained adapters, API and console")
    actions = demo.add_subparsers(dest="demo_command", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="prepare everything that is missing, then serve (Ctrl+C stops)")
    up.add_argument("--host", default=_S, help="listen address (LORAPLEX_HOST, default 127.0.0.1)")
    up.add_argument("--port", type=int, default=_S, help="listen port, 0 = any free port (LORAPLEX_PORT, 8000)")
    up.add_argument("--cache-dir", type=Path, default=_S, help="prepared models (LORAPLEX_CACHE_DIR)")
    up.add_argument("--data-dir", type=Path, default=_S, help="registry and stored adapters (LORAPLEX_DATA_DIR)")
    up.add_argument("--adapters-dir", type=Path, default=DEFAULT_ADAPTERS_DIR,
                    help=f"folder with the PEFT folders {', '.join(DEMO_ADAPTERS)} (default: {DEFAULT_ADAPTERS_DIR})")
    up.set_defaults(handler=functools.partial(demo_up, mount_console=mount_console))


def demo_up(args: argparse.Namespace, *, mount_console: Callable[[FastAPI], None] | None = None) -> int:
    """Handler of ``loraplex demo up``: set up what is missing, serve until stopped; the exit status."""
    from pydantic import ValidationError

    from loraplex.platform.errors import PlatformError
    from loraplex.platform.main import create_app

    admin_key = None
    try:
        settings = demo_settings(args)
        check_port_free(settings.host, settings.port)
        folders = adapter_folders(args.adapters_dir)
        ensure_model(settings)
        admin_key = settle_admin_key(settings)
        _say(f"loading {DEMO_MODEL} (max_model_len={settings.max_model_len})")
        app = create_app(settings)
        if mount_console is not None:
            mount_console(app)
        setup = provision(app.state.ctx, folders, admin_key=admin_key)
    except (ValidationError, ValueError, OSError, ModuleNotFoundError) as exc:
        return _fail(str(exc), admin_key)
    except PlatformError as exc:
        return _fail(exc.message, admin_key)
    except BaseException:
        _show_unprinted_admin_key(admin_key)
        raise
    listened = serve(app, settings, on_listening=lambda base_url: print(
        banner(base_url, app.state.ctx.model_id, setup), flush=True))
    if not listened:
        _show_unprinted_admin_key(setup.admin_key)
        _show_unprinted_tenant_key(setup.tenant_key)
        return 1
    return 0


def demo_settings(args: argparse.Namespace) -> Settings:
    """``Settings`` of ``loraplex serve --model smollm2-135m-instruct --enable-lora --max-model-len 2048``
    plus the flags given. Raises ``pydantic.ValidationError`` naming a bad field."""
    from loraplex.platform.settings import Settings

    flags = {name: getattr(args, name) for name in _SETTINGS_FLAGS if hasattr(args, name)}
    return Settings(model=DEMO_MODEL, enable_lora=True, max_model_len=DEMO_MAX_MODEL_LEN_TOKENS, **flags)


def adapter_folders(adapters_dir: Path) -> dict[str, Path]:
    """``{name: folder}`` of the demo adapters. Raises ``FileNotFoundError`` naming a missing file."""
    from loraplex.platform.services.uploads import CONFIG_NAME, WEIGHTS_NAME

    folders = {name: adapters_dir / name for name in DEMO_ADAPTERS}
    for folder in folders.values():
        for file in (folder / CONFIG_NAME, folder / WEIGHTS_NAME):
            if not file.is_file():
                raise FileNotFoundError(f"adapters_dir={str(adapters_dir)!r}: {str(file)!r} is missing")
    return folders


# -- set-up steps -----------------------------------------------------------------------------------
def ensure_model(settings: Settings) -> Path:
    """The prepared SmolLM2 folder, built now if missing (~25 s). Raises what ``prepare_smollm2`` raises."""
    from loraplex.engine.demo_models import prepare_smollm2

    return prepare_smollm2(settings.cache_dir, progress=_say)


def settle_admin_key(settings: Settings) -> str | None:
    """The admin key's plaintext when generated now (its hash stored); None when it comes from
    ``settings.admin_key`` or was stored at an earlier start. Migrates the database first."""
    from loraplex.platform import crud
    from loraplex.platform.core.security import ADMIN_KEY_PREFIX, generate_key
    from loraplex.platform.db import (
        make_db_engine,
        make_session_factory,
        session_scope,
        upgrade_database,
    )

    if settings.admin_key is not None:
        return None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    try:
        upgrade_database(db)
        with session_scope(make_session_factory(db)) as session:
            if crud.get_admin_key_hash(session=session) is not None:
                return None
            new = generate_key(ADMIN_KEY_PREFIX)
            crud.add_admin_key(session=session, key_hash=new.key_hash, prefix=new.prefix)
        return new.plaintext
    finally:
        db.dispose()


def provision(ctx: PlatformContext, folders: dict[str, Path], *, admin_key: str | None) -> DemoSetup:
    """Create the demo tenant, its key and adapters where missing (see the module docstring)."""
    with ctx.sessions() as session:
        created = ensure_tenant(session, ctx)
        tenant_key = ensure_tenant_key(session, ctx)
        owner = _tenant_context(session)
        adapters = tuple(ensure_adapter(session, ctx, owner, name, folder) for name, folder in folders.items())
    for adapter in adapters:
        _say(f"adapter {adapter.name!r}: {adapter.action} (version {adapter.version}, {adapter.version_id[:12]})")
    return DemoSetup(tenant=DEMO_TENANT, tenant_created=created, tenant_key=tenant_key, admin_key=admin_key,
                     admin_key_from_settings=ctx.settings.admin_key is not None, adapters=adapters)


def ensure_tenant(session: Session, ctx: PlatformContext) -> bool:
    """Create the ``demo`` tenant (server default limits) unless it exists; True when created now."""
    from loraplex.platform.errors import NotFound
    from loraplex.platform.schemas import TenantCreate
    from loraplex.platform.services import tenants

    try:
        tenants.get_tenant(session=session, name=DEMO_TENANT)
        return False
    except NotFound:
        tenants.create_tenant(session=session, ctx=ctx, spec=TenantCreate(name=DEMO_TENANT))
        return True


def ensure_tenant_key(session: Session, ctx: PlatformContext) -> str | None:
    """A new key's plaintext when the demo tenant has no active key; None when it has one."""
    from loraplex.platform.services import tenants

    keys = tenants.list_api_keys(session=session, tenant_name=DEMO_TENANT)
    if any(key.revoked_at is None for key in keys):
        return None
    return tenants.create_api_key(session=session, ctx=ctx, tenant_name=DEMO_TENANT).key


def ensure_adapter(session: Session, ctx: PlatformContext, owner: TenantContext, name: str,
                   folder: Path) -> AdapterSetup:
    """Upload ``folder`` as adapter ``name`` unless its live version already has this content.

    Raises ``InvalidRequest`` when the upload service refuses the adapter.
    """
    from loraplex.adapters import AdapterError, validate_adapter_dir
    from loraplex.platform.errors import InvalidRequest, NotFound
    from loraplex.platform.services import adapters

    try:
        local_version_id = validate_adapter_dir(folder, ctx.base_spec, ctx.max_lora_rank).version_id
    except AdapterError as exc:
        raise InvalidRequest(f"demo adapter {name!r} ({folder}): {exc}", param="file") from None
    try:
        live = adapters.get_adapter(session=session, tenant_id=owner.tenant_id, name=name)
    except NotFound:
        live = None
    if live is not None and live.version_id == local_version_id:
        return AdapterSetup(name, live.version, live.version_id, "unchanged")
    with peft_parts(folder) as parts:
        stored = adapters.upload_adapter(session=session, ctx=ctx, tenant=owner, name=name, parts=parts)
    return AdapterSetup(name, stored.version, stored.version_id, "uploaded" if live is None else "updated")


@contextlib.contextmanager
def peft_parts(folder: Path) -> Iterator[list[UploadPart]]:
    """The two PEFT files of ``folder`` as upload parts (as a multipart upload hands them over), open."""
    from loraplex.platform.services.uploads import CONFIG_NAME, WEIGHTS_NAME, UploadPart

    files = ((folder / CONFIG_NAME, "application/json"), (folder / WEIGHTS_NAME, "application/octet-stream"))
    with contextlib.ExitStack() as stack:
        yield [UploadPart(filename=path.name, content_type=content_type, fileobj=stack.enter_context(open(path, "rb")),
                          size_bytes=path.stat().st_size) for path, content_type in files]


def _tenant_context(session: Session) -> TenantContext:
    from loraplex.platform.services import tenants

    return tenants.tenant_context(session=session, name=DEMO_TENANT)


# -- serving ----------------------------------------------------------------------------------------
def check_port_free(host: str, port: int) -> None:
    """Raises ``ValueError`` naming ``port`` when ``host:port`` cannot be listened on now
    (checked before keys are created, so they are not lost to a server that cannot start)."""
    if port == 0:
        return
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(f"port={port}: cannot listen on {host}:{port} ({exc.strerror}); "
                             "choose another with --port (make serve PORT=...)") from None


def serve(app: FastAPI, settings: Settings, *, on_listening: Callable[[str], None]) -> bool:
    """Run uvicorn as ``loraplex serve`` does until Ctrl+C / SIGTERM; call ``on_listening(base_url)``
    once the socket listens (``base_url`` like ``http://127.0.0.1:8000``, the real port when 0 was asked).
    Returns False when the server never listened (uvicorn logged why)."""
    import uvicorn

    from loraplex.platform.core.signals import python_ctrl_c, uvicorn_server

    server = uvicorn_server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level=settings.log_level))
    watcher = threading.Thread(target=_when_listening, args=(server, settings.host, on_listening),
                               name="demo-banner", daemon=True)
    watcher.start()
    try:
        python_ctrl_c()
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its graceful shutdown
        pass
    except SystemExit:  # uvicorn exits this way when it cannot bind
        if server.started:
            raise
    return server.started


def _when_listening(server: uvicorn.Server, host: str, callback: Callable[[str], None]) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    callback(f"http://{display_host(host)}:{port}")


def display_host(host: str) -> str:
    """The address to show in URLs: loopback for the wildcard addresses."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


# -- the printed banner -----------------------------------------------------------------------------
def banner(base_url: str, model_id: str, setup: DemoSetup) -> str:
    """What ``demo up`` prints once listening: URLs, keys created now, ready-to-paste examples."""
    key_expr = setup.tenant_key or f"${KEY_ENV_VAR}"
    names = ", ".join(a.name for a in setup.adapters)
    return "\n".join([
        "",
        f"loraplex demo is up: {model_id} with adapters {names} for tenant {setup.tenant!r}",
        "",
        f"  API:        {base_url}/v1",
        f"  Console:    {base_url}/ui   (sign in with the admin key or the demo key)",
        f"  Admin key:  {_admin_key_line(setup)}",
        f"  Demo key:   {_tenant_key_line(setup)}",
        "",
        f"Try the {EXAMPLE_ADAPTER!r} adapter with curl (model: {model_id} for the base model, or {names}):",
        "",
        curl_example(base_url, key_expr, EXAMPLE_ADAPTER),
        "",
        "the 'json-answer' adapter with its reply format enforced (response_format, a JSON schema):",
        "",
        json_answer_example(base_url, key_expr),
        "",
        f"or the base model and every adapter with the openai client ({EXAMPLE_QUESTION!r}):",
        "",
        openai_example(base_url, setup.tenant_key, [model_id, *(a.name for a in setup.adapters)], setup.tenant),
        "",
        "Ctrl+C stops the server; `make serve` again (with the same PORT) reuses the tenant, keys and adapters.",
        "",
    ])


def _admin_key_line(setup: DemoSetup) -> str:
    if setup.admin_key:
        return f"{setup.admin_key}   (shown once: only its hash is stored)"
    if setup.admin_key_from_settings:
        return "the value of LORAPLEX_ADMIN_KEY"
    return "printed at first start (only its hash is stored)"


def _tenant_key_line(setup: DemoSetup) -> str:
    if setup.tenant_key:
        return (f"{setup.tenant_key}   (tenant {setup.tenant!r}; shown once: only its hash is stored; later starts'\n"
                f"              examples read it from ${KEY_ENV_VAR}: `export {KEY_ENV_VAR}={setup.tenant_key}`)")
    return (f"printed at first start (only its hash is stored); "
            f"`export {KEY_ENV_VAR}=<that key>` for the examples below\n"
            f"              (lost it? `loraplex key create {setup.tenant}` makes a new one)")


def curl_example(base_url: str, key_expr: str, model: str) -> str:
    """A ``curl`` chat completion for ``model``; ``key_expr`` is the key or a ``$VAR`` to expand."""
    body = (f'{{"model": "{model}", "messages": [{{"role": "user", "content": "{EXAMPLE_QUESTION}"}}], '
            f'"temperature": 0, "max_tokens": {EXAMPLE_MAX_TOKENS}}}')
    return "\n".join([
        f"curl -s {base_url}/v1/chat/completions \\",
        f'  -H "Authorization: Bearer {key_expr}" \\',
        '  -H "Content-Type: application/json" \\',
        f"  -d '{body}'",
    ])


def json_answer_example(base_url: str, key_expr: str) -> str:
    """A ``curl`` chat completion of the json-answer adapter constrained by :data:`JSON_ANSWER_SCHEMA`."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": JSON_ANSWER_SCHEMA}}
    body = json.dumps({"model": "json-answer", "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
                       "temperature": 0, "max_tokens": EXAMPLE_MAX_TOKENS, "response_format": fmt})
    return "\n".join([
        f"curl -s {base_url}/v1/chat/completions \\",
        f'  -H "Authorization: Bearer {key_expr}" \\',
        '  -H "Content-Type: application/json" \\',
        f"  -d '{body}'",
    ])


def openai_example(base_url: str, key: str | None, models: list[str], tenant: str = DEMO_TENANT) -> str:
    """A Python heredoc with the ``openai`` client asking each of ``models`` :data:`EXAMPLE_QUESTION`;
    without ``key`` it reads the ``DEMO_KEY`` environment variable. It runs with the server's own
    interpreter (the project's ``.venv``, which has ``openai``), not whatever ``python3`` is first."""
    key_arg = repr(key) if key else KEY_ENV_VAR.lower()
    read_key = [] if key else [
        "import os, sys",
        f"{KEY_ENV_VAR.lower()} = os.environ.get({KEY_ENV_VAR!r}) or sys.exit("
        f"'set {KEY_ENV_VAR} to the demo key printed at first start (`loraplex key create {tenant}` makes a new one)')",
    ]
    return "\n".join([
        f"{shlex.quote(sys.executable)} - <<'EOF'",
        *read_key,
        "from openai import OpenAI",
        f"client = OpenAI(base_url={base_url + '/v1'!r}, api_key={key_arg})",
        f"for model in {models!r}:",
        "    reply = client.chat.completions.create(",
        f"        model=model, messages=[{{'role': 'user', 'content': {EXAMPLE_QUESTION!r}}}],",
        f"        temperature=0, max_tokens={EXAMPLE_MAX_TOKENS})",
        "    print(f'{model}: {reply.choices[0].message.content}')",
        "EOF",
    ])


def _say(line: str) -> None:
    print(f"[demo] {line}", flush=True)


def _fail(message: str, admin_key: str | None) -> int:
    from loraplex.platform.user_errors import fail

    status = fail(message)
    _show_unprinted_admin_key(admin_key)
    return status


def _show_unprinted_tenant_key(tenant_key: str | None) -> None:
    if tenant_key:
        print(f"[demo] {DEMO_TENANT!r} tenant key created by this start (shown once: only its hash is stored): "
              f"{tenant_key}", file=sys.stderr)


def _show_unprinted_admin_key(admin_key: str | None) -> None:
    """A key generated by a start that then failed is shown now: it will not be shown again."""
    if admin_key:
        print(f"[demo] admin key generated by this start (shown once: only its hash is stored): {admin_key}",
              file=sys.stderr)
