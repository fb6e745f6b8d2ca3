"""The serving platform: OpenAI-compatible API, tenants and keys, adapter registry,
cache and rate limits, metrics, CLI commands.

Layout (FastAPI full-stack template style)::

    settings.py        Settings (pydantic-settings; the only reader of LORAPLEX_* variables)
    models.py          SQLAlchemy tables; migrations/ is generated from Base.metadata
    schemas.py         registry request/response models (TenantCreate, AdapterPublic, ...)
    openai_schemas.py  OpenAI request/response models
    crud.py            keyword-only database functions (no commits)
    services/          business logic shared by the API, the CLI and the console
    api/               deps.py (SessionDep, CurrentTenant, AdminDep), routes/<resource>.py
    core/security.py   API keys
    cache.py           Store (Redis or in-process): lookup cache, rate limits, live stats
    async_engine.py    the engine loop in a background thread, per-request output streams
    metrics.py         Prometheus metrics in a per-app registry
    context.py         PlatformContext: what services receive
    main.py            create_app(settings, engine=None)
    engine_options.py  the engine's knobs as serve flags / LORAPLEX_* settings, generated from EngineConfig
    cli.py             serve / tenant / key / adapter commands

Nothing is imported here, so ``import loraplex.platform.settings`` stays light.
"""
