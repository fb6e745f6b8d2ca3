"""Issue 22.2: one EngineConfig is the source of the ``serve`` flags and the settings (env vars),
validated once by ``EngineConfig.validate`` with errors that name the flag / env var."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from loraplex import cli
from loraplex.engine.config import ConfigError, EngineConfig, config_fields
from loraplex.platform.cli import settings_from_args
from loraplex.platform.engine_options import OWNED_BY_SETTINGS, SERVER_DEFAULTS, engine_options
from loraplex.platform.settings import Settings, validation_error_text

BLOCK_SIZE_RULE = "must be one of 1, 2, 4, 8, 16, 32, 64, 128"


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(cache_dir_default=cli.default_cache_dir()).parse_args(argv)


def serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser(cache_dir_default=cli.default_cache_dir())
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_serve_block_size_24_fails_at_once_naming_the_flag_and_the_allowed_values(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model", "m", "--block-size", "24", "--data-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert f"argument --block-size: 24: {BLOCK_SIZE_RULE}" in capsys.readouterr().err
    assert not (tmp_path / "registry.db").exists()  # refused while parsing: nothing started


def test_block_size_24_from_the_environment_names_the_env_var(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LORAPLEX_BLOCK_SIZE", "24")
    assert cli.main(["serve", "--model", "m", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: block_size=24 (--block-size / LORAPLEX_BLOCK_SIZE): {BLOCK_SIZE_RULE}"
    assert not (tmp_path / "registry.db").exists()


def test_the_engine_refuses_the_same_value_with_the_same_rule():
    with pytest.raises(ConfigError) as caught:
        EngineConfig(model="m", block_size=24)
    assert (caught.value.field, caught.value.value, caught.value.rule) == ("block_size", 24, BLOCK_SIZE_RULE)
    assert str(caught.value) == f"EngineConfig.block_size=24: {BLOCK_SIZE_RULE}"


def test_rules_across_fields_name_the_flag_and_env_var():
    with pytest.raises(ValidationError) as caught:
        settings_from_args(parse(["serve", "--model", "m", "--max-loras", "8", "--max-cpu-loras", "4"]))
    assert validation_error_text(caught.value) == (
        "max_cpu_loras=4 (--max-cpu-loras / LORAPLEX_MAX_CPU_LORAS): must be >= max_loras=8")


def test_an_adapter_setting_without_lora_is_refused_naming_it():
    with pytest.raises(ValidationError) as caught:
        settings_from_args(parse(["serve", "--model", "m", "--no-enable-lora", "--max-lora-rank", "64"]))
    assert validation_error_text(caught.value) == (
        "max_lora_rank=64 (--max-lora-rank / LORAPLEX_MAX_LORA_RANK): needs enable_lora (an adapter setting of an "
        "engine that serves no adapters)")


@pytest.mark.parametrize("values, field", [
    ({"max_loras": 9}, "max_loras"), ({"max_lora_rank": 64}, "max_lora_rank"),
    ({"lora_page_rows": 8}, "lora_page_rows"),
    ({"max_lora_pages": 3}, "max_lora_pages"), ({"max_cpu_loras": 8}, "max_cpu_loras"),
    ({"max_adapter_wait_steps": 3}, "max_adapter_wait_steps"),
])
def test_the_engine_refuses_every_adapter_setting_without_lora(values, field):
    with pytest.raises(ConfigError) as caught:
        EngineConfig(model="m", **values)
    assert (caught.value.field, caught.value.rule) == (
        field, "needs enable_lora (an adapter setting of an engine that serves no adapters)")
    EngineConfig(model="m", enable_lora=True, **values)  # the same value is served with LoRA on
    plain = EngineConfig(model="m")  # defaults (max_cpu_loras resolved to max_loras) pass again, as replace() does
    assert dataclasses.replace(plain, block_size=plain.block_size).max_cpu_loras == plain.max_loras


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: 1.5: must be in (0.0, 1.0]"),
    (["--max-lora-rank", "12"], "argument --max-lora-rank: 12: must be one of 1, 2, 4, 8, 16, 32, 64, 128, 256"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0: must be > 0"),
    (["--swap-space", "-1"], "argument --swap-space: -1: must be >= 0"),
    (["--scheduling-policy", "lottery"], "argument --scheduling-policy: lottery: must be one of fcfs, fair"),
    (["--block-size", "sixteen"], "argument --block-size: sixteen: must be an int"),
])
def test_each_bad_flag_names_itself(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_every_engine_field_is_a_flag_and_a_setting_with_its_help_and_default():
    """The generator picks up every EngineConfig field: a new one needs no edit in the platform."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    options = [o.name for o in engine_options()]
    assert options == [n for n in names if n not in OWNED_BY_SETTINGS]
    flags = {a.dest: a for a in serve_parser()._actions}
    for option in engine_options():
        assert option.help, f"EngineConfig.{option.name} needs a docstring (its --help)"
        assert option.name in flags and option.help.replace("%", "%%") in flags[option.name].help
        setting = Settings.model_fields[option.name]
        assert setting.default == SERVER_DEFAULTS.get(option.name)
        assert option.help in setting.description
    assert [f.name for f in config_fields()] == names


def test_flags_and_env_reach_the_engine_config(monkeypatch):
    monkeypatch.setenv("LORAPLEX_BLOCK_SIZE", "32")
    monkeypatch.setenv("LORAPLEX_ENFORCE_EAGER", "true")
    settings = settings_from_args(parse(["serve", "--model", "m", "--max-lora-rank", "64",
                                         "--no-enable-prefix-caching", "--scheduling-policy", "fcfs"]))
    config = EngineConfig(model="m", **settings.engine_values())
    assert (config.block_size, config.enforce_eager, config.max_lora_rank, config.enable_lora,
            config.enable_prefix_caching, config.scheduling_policy) == (32, True, 64, True, False, "fcfs")
    assert config.max_num_seqs == 256  # not given: the engine's default
    server = EngineConfig(model="m", **Settings().engine_values())
    assert (server.enable_lora, server.scheduling_policy) == (True, "fair")  # the server's defaults
