"""The engine's knobs as the platform spells them: ``--block-size`` flags and ``LORAPLEX_BLOCK_SIZE``
settings, generated from :class:`loraplex.engine.config.EngineConfig` (the one source; see
:func:`loraplex.engine.config.config_fields`).

``settings.py`` builds one ``Settings`` field per option and ``cli.py`` one ``serve`` flag per
option; a field added to ``EngineConfig`` becomes both without an edit here. Imports only the
standard library and ``engine/config.py`` (no torch, no pydantic), so ``loraplex --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from loraplex.engine.config import ConfigError, ConfigField, config_fields

ENV_PREFIX = "LORAPLEX_"
OWNED_BY_SETTINGS = {
    "model": "Settings.model (optional there: without one only the admin API runs)",
    "download_dir": "Settings.cache_dir",
}
"""EngineConfig fields the platform fills from settings of its own, so they get no generated option."""
SERVER_DEFAULTS: dict[str, Any] = {"enable_lora": True, "scheduling_policy": "fair"}
"""Where the server's default differs from the engine's (the offline ``LLM`` keeps the engine's)."""


def engine_options() -> list[ConfigField]:
    """The EngineConfig fields that are settings / ``serve`` flags, in declaration order."""
    return [f for f in config_fields() if f.name not in OWNED_BY_SETTINGS]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def option_error_text(exc: ConfigError) -> str:
    """``"block_size=24 (--block-size / LORAPLEX_BLOCK_SIZE): must be one of 1, 2, ..."``."""
    return f"{exc.field}={exc.value!r} ({flag_name(exc.field)} / {env_name(exc.field)}): {exc.rule}"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :func:`engine_options` entry, default ``argparse.SUPPRESS`` (left out: the
    env var, then the default). A value is parsed and checked by its field's rule when the flag is
    read, so ``--block-size 24`` fails at once: ``argument --block-size: 24: must be one of ...``."""
    for option in engine_options():
        default = SERVER_DEFAULTS.get(option.name, option.default)
        help_text = f"{option.help} (env {env_name(option.name)}; default: {default})".replace("%", "%%")
        if option.type is bool:
            parser.add_argument(flag_name(option.name), action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
            continue
        metavar = "{" + ",".join(map(str, option.choices)) + "}" if option.choices else option.name.upper()
        parser.add_argument(flag_name(option.name), type=_flag_value(option), default=argparse.SUPPRESS,
                            metavar=metavar, help=help_text)


def _flag_value(option: ConfigField):
    def parse(text: str) -> Any:
        try:
            value = option.parse(text)
            option.check(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{text}: {exc.rule}") from None
        return value

    parse.__name__ = option.type.__name__  # argparse names the type in its own messages
    return parse
