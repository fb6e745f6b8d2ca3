"""``loraplex tenant/key/adapter`` commands and settings precedence (flags > env > defaults)."""

from __future__ import annotations

import json

import pytest
from platform_testlib import adapter_members, make_peft_adapter, tar_gz_bytes

from loraplex import cli
from loraplex.platform.cli import settings_from_args


def parse(argv: list[str]):
    return cli.build_parser(cache_dir_default=cli.default_cache_dir()).parse_args(argv)


def test_flags_override_environment_override_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "3")
    monkeypatch.setenv("LORAPLEX_PORT", "9001")
    settings = settings_from_args(parse(["serve", "--model", "m", "--max-loras", "5", "--no-enable-prefix-caching",
                                         "--max-model-len", "256"]))
    assert settings.max_loras == 5  # flag beats env
    assert settings.port == 9001  # env beats default
    assert settings.data_dir == tmp_path / "from-env"
    assert settings.enable_prefix_caching is False and settings.max_model_len == 256
    assert settings.host == "127.0.0.1" and settings.block_size is None  # defaults (None = the engine's)
    assert settings.model_id == "m"


def test_serve_refuses_tensor_parallel(capsys, tmp_path):
    status = cli.main(["serve", "--model", "m", "--tensor-parallel-size", "2", "--data-dir", str(tmp_path)])
    assert status == 1
    assert "tensor_parallel_size=2: only 1 is supported" in capsys.readouterr().err


def test_tenant_key_and_adapter_commands(capsys, tmp_path, tiny_llama_dir):
    common = ["--data-dir", str(tmp_path / "data")]
    assert cli.main(["tenant", "create", "acme", "--requests-per-minute", "7", *common]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["requests_per_minute"] == 7
    assert "generated admin key" in out.err  # first start: printed once, on stderr for CLI commands
    assert cli.main(["tenant", "create", "acme", *common]) == 1
    assert "already exists" in capsys.readouterr().err

    assert cli.main(["key", "create", "acme", *common]) == 0
    key = json.loads(capsys.readouterr().out)["key"]
    assert key.startswith("lpx-")

    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "adapter", r=4)
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     *common]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["name"], first["version"], first["rank"]) == ("poet", 1, 4)
    archive = tmp_path / "adapter.tar.gz"
    archive.write_bytes(tar_gz_bytes(adapter_members(adapter, "x/")))
    assert cli.main(["adapter", "upload", "acme", "poet", str(archive), "--model", str(tiny_llama_dir),
                     *common]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 2
    assert cli.main(["adapter", "upload", "acme", "poet", str(tmp_path / "missing"), "--model",
                     str(tiny_llama_dir), *common]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     "--max-lora-rank", "2", *common]) == 1
    assert "max_lora_rank=2" in capsys.readouterr().err

    # the server sees what the CLI wrote
    from platform_testlib import make_settings

    from loraplex.platform.context import build_context
    from loraplex.platform.services.tenants import authenticate_tenant

    ctx = build_context(make_settings(tmp_path, admin_key=None), None)
    assert authenticate_tenant(ctx=ctx, token=key).tenant_name == "acme"
    ctx.db.dispose()


@pytest.mark.parametrize("argv", [["tenant", "create", "bad/name"], ["key", "create", "nobody"]])
def test_cli_errors_name_the_problem(argv, capsys, tmp_path):
    assert cli.main([*argv, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "bad/name" in err or "nobody" in err
