"""Platform settings: the ONLY module of loraplex that reads environment variables.

Precedence: explicit keyword arguments (the CLI passes the flags it was given)
> environment variables ``LORAPLEX_<FIELD>`` (e.g. ``LORAPLEX_DATA_DIR``,
``LORAPLEX_DATABASE_URL``, ``LORAPLEX_REDIS_URL``, ``LORAPLEX_ADMIN_KEY``)
> the defaults below. Values are validated once, at construction
(``pydantic.ValidationError`` names the field and the value).

The engine's settings are not declared here: ``Settings`` gets one field per
``EngineConfig`` field (``engine_options.py``), checked by ``EngineConfig.validate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, create_model, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.engine.config import ConfigError, EngineConfig
from loraplex.platform.engine_options import SERVER_DEFAULTS, engine_options, env_name, flag_name, option_error_text

CHECKOUT_CACHE_DIR = Path(".cache")
"""Cache folder of ``make serve``, relative to a loraplex source checkout (git-ignored)."""


def in_source_checkout(folder: Path | None = None) -> bool:
    """True when ``folder`` (default: the working directory) is a loraplex source checkout,
    i.e. holds the ``pyproject.toml`` of project ``loraplex``. There the storage defaults are
    ``make serve``'s folders, so that CLI commands run in the repository act on the demo server."""
    pyproject = (folder or Path.cwd()) / "pyproject.toml"
    try:
        return 'name = "loraplex"' in pyproject.read_text(encoding="utf-8")
    except OSError:
        return False


def default_data_dir() -> Path:
    """``./.cache/data`` in a source checkout (as ``make serve``), else ``./data``."""
    return (CHECKOUT_CACHE_DIR / "data").resolve() if in_source_checkout() else Path("data")


def default_cache_dir() -> Path:
    """``./.cache`` in a source checkout (as ``make serve``), else ``~/.cache/loraplex``."""
    return CHECKOUT_CACHE_DIR.resolve() if in_source_checkout() else Path.home() / ".cache" / "loraplex"


class PlatformSettings(BaseSettings):
    """The settings of the platform itself; :data:`Settings` adds the engine's (see below)."""

    # An empty variable (``LORAPLEX_X=``, as compose files and shell scripts leave them) counts as unset.
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="forbid", validate_default=True,
                                      env_ignore_empty=True)

    # --- storage -----------------------------------------------------------------------------
    data_dir: Path = Field(default_factory=default_data_dir,
                           description="Registry SQLite file and stored adapters live here.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Prepared models (e.g. SmolLM2) live here.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; None = SQLite file `<data_dir>/registry.db`.")
    redis_url: str | None = Field(
        None, description="redis://host:port/db for the lookup cache, rate limits and live stats; "
                          "None = an in-process implementation of the same interface.")
    admin_key: SecretStr | None = Field(
        None, description="Admin bearer key; None = generate one at first start, store its hash, print it once.")
    metrics_key: SecretStr | None = Field(
        None, description="Bearer key that may read /metrics only (the admin key always may); None = admin only.")

    # --- serving -----------------------------------------------------------------------------
    model: str | None = Field(None, description="Folder of a HF-format model; None = admin API only.")
    served_model_name: str | None = Field(None, description="Model id in the API; None = the model folder's name.")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # --- engine: one field per EngineConfig field, generated below (engine_options.py) -----------
    engine_process: bool | None = Field(
        None, description="Run the engine in a process of its own (the HTTP event loop and the engine thread "
                          "stop sharing one GIL; vLLM and SGLang split them the same way); false = a thread of "
                          "this process; None = a process of its own unless replicas are set (their engines are "
                          "processes already; true with replicas is refused).")
    gc_freeze: bool = Field(
        True, description="Once started, move every object alive into a permanent generation that Python's garbage "
                          "collector skips (engine/gc_heap.py; as vLLM): full collections while serving then walk "
                          "only what was made since (on an H200 host one took 302 ms before, 76 ms after); false: "
                          "the collector as Python sets it (tests that start many servers in one process).")
    # --- replicas on Ray Serve (`loraplex serve --replicas N`; the `cluster` extra) -----------------
    replicas: int | None = Field(
        None, ge=1, description="Engine replicas as Ray Serve deployments behind this gateway, routed by "
                                "adapter residency; None = one engine in this process.")
    ray_address: str | None = Field(
        None, description="Ray cluster to join (e.g. `auto`, `ray://head:10001`); None = start a local one.")
    replica_num_gpus: float | None = Field(
        None, ge=0, description="GPUs per replica; None = 1 when the device is CUDA (or `auto` on a GPU host), else 0.")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica.")
    replica_max_ongoing_requests: int | None = Field(
        None, ge=1, description="Engine requests one replica takes at once (more wait in the router); "
                                "None = max_num_seqs (256 by default).")
    routing_max_imbalance: int = Field(
        4, ge=0, description="Requests in flight by which a replica holding the adapter may exceed the least "
                             "loaded replica and still be preferred.")
    shutdown_stream_grace_s: float = Field(
        20.0, ge=0, description="On Ctrl-C / SIGTERM the server stops accepting requests and lets those in flight "
                                "finish; a streaming response still open this many seconds after the signal ends "
                                "with an in-band error event (type server_error, code server_shutting_down) and its "
                                "engine request is aborted (non-streaming requests are waited for).")
    chat_content_special_tokens: bool = Field(
        False, description="Let special-token strings in chat message content become control tokens (unsafe: "
                           "a user can forge turns); off = content is literal text.")

    # --- uploads -----------------------------------------------------------------------------
    max_upload_mb: float = Field(200.0, gt=0, description="Server-wide cap on one upload (MB = 10**6 bytes).")
    default_tenant_max_upload_mb: float = Field(
        50.0, gt=0, description="A new tenant's upload limit when none is given (at most max_upload_mb).")
    default_tenant_max_adapters: int = Field(10, ge=0)
    default_tenant_requests_per_minute: int | None = Field(None, ge=1)
    default_tenant_tokens_per_minute: int | None = Field(None, ge=1)
    max_archive_members: int = Field(16, ge=2, description="Most members an uploaded archive may hold.")
    max_compression_ratio: float = Field(200.0, gt=1.0, description="Largest uncompressed/compressed ratio.")
    upload_check_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of one upload's checks (extraction, config, header, regexes, tensors, "
                                "hash) in their worker process; past it the upload is refused (400).")
    upload_check_memory_mb: float | None = Field(
        2000.0, gt=0, description="Memory an upload's check process may use beyond its size at start (MB); "
                                  "None = no cap.")
    max_concurrent_upload_checks: int = Field(2, ge=1, description="Upload check processes at once.")

    # --- request limits and usage accounting ---------------------------------------------------
    max_json_body_mb: float = Field(
        4.0, gt=0, description="Largest JSON request body (every route but uploads); larger gets 413.")
    max_prompts_per_request: int = Field(
        128, ge=1, description="Most prompts in one /v1/completions request; more gets 400.")
    usage_buffer_max_entries: int = Field(
        10_000, ge=1, description="Most (tenant, day) usage rows buffered while the registry is unreachable.")
    usage_give_up_s: float = Field(
        3600.0, gt=0, description="Buffered usage not written for this long is dropped and logged as lost.")
    console_file_lifetime_s: int = Field(
        600, ge=60, description="Files uploaded through the console are deleted after this long.")

    # --- adapter evaluation (console Evaluate tab, /v1/evaluations) ------------------------------
    eval_max_file_bytes: int = Field(1_000_000, ge=1, description="Largest accepted evaluation set (JSONL) in bytes.")
    eval_max_items: int = Field(200, ge=1, description="Most items (JSONL lines) of one evaluation set.")
    eval_max_choices: int = Field(10, ge=2, description="Most choices of one multiple-choice item.")
    eval_max_new_tokens: int = Field(32, ge=1, description="Greedy tokens generated per {prompt, reference} item.")
    eval_max_concurrent_requests: int = Field(
        2, ge=1, description="Engine requests all adapter evaluations together keep in flight at most (so "
                             "they stay a low-priority trickle beside tenants' traffic).")
    eval_num_examples: int = Field(3, ge=0, description="Example outputs kept per model and evaluation.")

    # --- cache / stats -----------------------------------------------------------------------
    cache_ttl_s: int = Field(60, ge=1, description="Lifetime of a cached tenant/key/adapter lookup.")
    redis_retry_s: float = Field(5.0, gt=0, description="After a Redis failure, wait this long before retrying.")
    stats_interval_s: float = Field(1.0, gt=0, description="How often the engine publishes live stats.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _check_engine_process(self) -> PlatformSettings:
        if self.engine_process and self.replicas is not None:
            raise ValueError("engine_process (--engine-process / LORAPLEX_ENGINE_PROCESS) cannot be combined with "
                             "replicas (--replicas / LORAPLEX_REPLICAS): each replica's engine is a process already")
        return self

    @property
    def engine_in_own_process(self) -> bool:
        """True when one engine for ``model`` runs in a child process (``engine_process``, or its
        default: yes unless ``replicas`` are set)."""
        return self.engine_process if self.engine_process is not None else self.replicas is None

    @model_validator(mode="after")
    def _check_engine_options(self) -> PlatformSettings:
        """The engine options given, checked by ``EngineConfig.validate`` (the one validation)."""
        try:
            EngineConfig.validate(self.engine_values())
        except ConfigError as exc:
            raise ValueError(option_error_text(exc)) from None
        return self

    def engine_values(self) -> dict[str, Any]:
        """The engine options that are set (name -> value; None = the engine's default), for
        ``EngineConfig(model=..., **settings.engine_values())``."""
        names = [option.name for option in engine_options()]
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}

    @property
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL in use (the SQLite default made explicit)."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'registry.db').resolve()}"

    @property
    def adapters_dir(self) -> Path:
        """Root of the content-addressed adapter store: ``<data_dir>/adapters/<version_id>/``."""
        return self.data_dir / "adapters"

    @property
    def uploads_tmp_dir(self) -> Path:
        """Scratch space for uploads being validated (same filesystem, so the final move is a rename)."""
        return self.data_dir / "tmp"

    @property
    def model_id(self) -> str | None:
        """The base model's id in the API: ``served_model_name`` or the model folder's name."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else None


def validation_error_text(exc: ValidationError) -> str:
    """One line per error of ``exc``: ``"port=99999: Input should be ..."``; an engine option's
    error as ``option_error_text`` words it (it names the flag and the env var)."""
    lines = []
    for error in exc.errors(include_url=False):
        message = error["msg"].removeprefix("Value error, ")
        where = ".".join(map(str, error["loc"]))
        lines.append(f"{where}={error['input']!r}: {message}" if where else message)
    return "; ".join(lines)


def _engine_fields() -> dict[str, Any]:
    """One optional settings field per engine option: its type (a ``Literal``'s values are checked by
    ``EngineConfig.validate``, so every engine error reads the same), the server default or None
    (= the engine's default), the field's docstring as description."""
    fields = {}
    for option in engine_options():
        description = f"{option.help} (flag {flag_name(option.name)}, env {env_name(option.name)})"
        fields[option.name] = (option.type | None, Field(SERVER_DEFAULTS.get(option.name), description=description))
    return fields


Settings = create_model("Settings", __base__=PlatformSettings, __module__=__name__, **_engine_fields())
Settings.__doc__ = """Everything the server, the admin API and the CLI need to know: :class:`PlatformSettings`
plus one field per ``EngineConfig`` field (``LORAPLEX_BLOCK_SIZE``, ...; see ``engine_options.py``)."""
