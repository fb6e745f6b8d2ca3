"""``loraplex tenant/key/adapter`` commands and settings precedence (flags > env > defaults)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

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


def test_serve_refuses_tensor_parallel_size_not_dividing_kv_heads(capsys, tmp_path, tiny_llama_dir):
    status = cli.main(["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--tensor-parallel-size", "4",
                       "--data-dir", str(tmp_path)])
    assert status == 2
    assert "tensor_parallel_size=4 does not divide the model's num_key_value_heads=2" in capsys.readouterr().err


def test_replica_flags_reach_the_settings(monkeypatch):
    monkeypatch.setenv("LORAPLEX_REPLICA_NUM_CPUS", "2")
    settings = settings_from_args(parse(["serve", "--model", "m", "--replicas", "3", "--ray-address", "auto",
                                         "--replica-num-gpus", "0.5", "--replica-max-ongoing-requests", "64",
                                         "--routing-max-imbalance", "7"]))
    assert (settings.replicas, settings.ray_address, settings.replica_num_gpus) == (3, "auto", 0.5)
    assert (settings.replica_num_cpus, settings.replica_max_ongoing_requests, settings.routing_max_imbalance) == \
        (2.0, 64, 7)
    assert settings_from_args(parse(["serve", "--model", "m"])).replicas is None  # one engine in-process


def test_gc_freeze_flag_reaches_the_settings(monkeypatch):
    assert settings_from_args(parse(["serve", "--model", "m"])).gc_freeze is True  # the server's default
    assert settings_from_args(parse(["serve", "--model", "m", "--no-gc-freeze"])).gc_freeze is False
    monkeypatch.setenv("LORAPLEX_GC_FREEZE", "false")
    assert settings_from_args(parse(["serve", "--model", "m"])).gc_freeze is False
    assert settings_from_args(parse(["serve", "--model", "m", "--gc-freeze"])).gc_freeze is True


def test_engine_process_flag_reaches_the_settings_and_refuses_replicas(monkeypatch, capsys, tmp_path):
    assert settings_from_args(parse(["serve", "--model", "m", "--engine-process"])).engine_process is True
    default = settings_from_args(parse(["serve", "--model", "m"]))
    assert (default.engine_process, default.engine_in_own_process) == (None, True)  # a process by default
    thread = settings_from_args(parse(["serve", "--model", "m", "--no-engine-process"]))
    assert (thread.engine_process, thread.engine_in_own_process) == (False, False)
    replicas = settings_from_args(parse(["serve", "--model", "m", "--replicas", "2"]))
    assert (replicas.engine_process, replicas.engine_in_own_process) == (None, False)  # replicas are processes
    monkeypatch.setenv("LORAPLEX_ENGINE_PROCESS", "0")
    assert settings_from_args(parse(["serve", "--model", "m"])).engine_in_own_process is False
    monkeypatch.setenv("LORAPLEX_ENGINE_PROCESS", "1")
    assert settings_from_args(parse(["serve", "--model", "m"])).engine_process is True
    monkeypatch.setenv("LORAPLEX_ENGINE_PROCESS", "")  # empty = unset: the default (a process)
    assert settings_from_args(parse(["serve", "--model", "m"])).engine_process is None
    monkeypatch.setenv("LORAPLEX_PORT", "")
    assert settings_from_args(parse(["serve", "--model", "m"])).port == 8000
    assert cli.main(["serve", "--model", "m", "--engine-process", "--replicas", "2", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--engine-process / LORAPLEX_ENGINE_PROCESS) cannot be combined with replicas (--replicas" in err


def test_ctrl_c_before_the_server_runs_exits_130_without_a_traceback(monkeypatch, capsys, tmp_path):
    """Ctrl-C while `serve` still prepares (imports, model load) is reported in one line, exit status 130."""
    def interrupted(args):
        raise KeyboardInterrupt

    import loraplex.platform.cli as platform_cli

    monkeypatch.setattr(platform_cli, "settings_from_args", interrupted)
    assert cli.main(["serve", "--model", "m", "--data-dir", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "loraplex: interrupted\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_ctrl_c_while_serve_prepares_ends_the_process_at_once(tmp_path):
    """A real SIGINT while `serve` prepares (here: inside settings_from_args, standing in for the torch imports and
    the model load) goes to the CLI's handler, not a KeyboardInterrupt: one line, exit status 130, no traceback;
    a child process it started is terminated. In a subprocess: the handler ends the process."""
    script = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a terminal
        "import multiprocessing, os, sys, time\n"
        "import loraplex.platform.cli as platform_cli\n"
        "from loraplex import cli\n"
        "def preparing(args):\n"
        "    child = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(300,))\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
        "platform_cli.settings_from_args = preparing\n"
        "sys.exit(cli.main(['serve', '--model', 'm', '--data-dir', sys.argv[1]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "loraplex: interrupted" and "Traceback" not in out.stderr
    child = int(out.stdout.split()[0])
    for _ in range(200):  # terminated, not necessarily reaped yet by anyone: gone or a zombie
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child} still running")


def test_serve_refuses_zero_replicas(capsys, tmp_path):
    assert cli.main(["serve", "--model", "m", "--replicas", "0", "--data-dir", str(tmp_path)]) == 2
    assert "replicas" in capsys.readouterr().err


def test_shutdown_stream_grace_flag_reaches_settings():
    assert settings_from_args(parse(["serve", "--model", "m"])).shutdown_stream_grace_s == 20.0
    assert settings_from_args(parse(["serve", "--model", "m", "--shutdown-stream-grace-s", "0"])
                              ).shutdown_stream_grace_s == 0.0


def test_tensor_parallel_flags_reach_settings():
    settings = settings_from_args(parse(["serve", "--model", "m", "--tensor-parallel-size", "2",
                                         "--tensor-parallel-all-reduce", "nccl"]))
    assert (settings.tensor_parallel_size, settings.tensor_parallel_all_reduce) == (2, "nccl")


def test_tenant_key_and_adapter_commands(capsys, tmp_path, tiny_llama_dir):
    common = ["--data-dir", str(tmp_path / "data")]
    assert cli.main(["tenant", "create", "acme", "--requests-per-minute", "7", *common]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["requests_per_minute"] == 7
    assert "generated admin key" in out.err  # first start: printed once, on stderr for CLI commands
    assert cli.main(["tenant", "create", "beta", *common]) == 0
    capsys.readouterr()
    assert cli.main(["tenant", "list", *common]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["requests_per_minute"]) for t in listed] == [("acme", 7), ("beta", None)]
    assert cli.main(["tenant", "create", "acme", *common]) == 2
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
                     str(tiny_llama_dir), *common]) == 2
    assert "does not exist" in capsys.readouterr().err
    pickled = tmp_path / "pickled"  # a PEFT folder saved with safe_serialization=False
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    assert cli.main(["adapter", "upload", "acme", "poet", str(pickled), "--model", str(tiny_llama_dir),
                     *common]) == 2
    assert ("adapter_model.bin': pickle weights are refused; upload adapter_model.safetensors (safetensors only)"
            in capsys.readouterr().err)
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     "--max-lora-rank", "2", *common]) == 2
    assert "max_lora_rank=2" in capsys.readouterr().err
    # Checked against the modules the server serves (lora_target_modules): q_proj serves the whole q/k/v linear.
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     "--lora-target-modules", "q_proj", *common]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 3
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     "--lora-target-modules", "o_proj,down_proj", *common]) == 2
    assert re.search(r"LoRA on [qv]_proj is not served by this server: its lora_target_modules setting serves "
                     r"o_proj, down_proj only", capsys.readouterr().err)
    assert cli.main(["adapter", "upload", "acme", "poet", str(adapter), "--model", str(tiny_llama_dir),
                     "--lora-target-modules", "qkv_proj", *common]) == 2
    assert ("lora_target_modules='qkv_proj' (--lora-target-modules / LORAPLEX_LORA_TARGET_MODULES): 'qkv_proj' is "
            "not a module this model serves LoRA on") in capsys.readouterr().err

    # the server sees what the CLI wrote
    from platform_testlib import make_settings

    from loraplex.platform.context import build_context
    from loraplex.platform.services.tenants import authenticate_tenant

    ctx = build_context(make_settings(tmp_path, admin_key=None), None)
    assert authenticate_tenant(ctx=ctx, token=key).tenant_name == "acme"
    ctx.db.dispose()


@pytest.mark.parametrize("argv", [["tenant", "create", "bad/name"], ["key", "create", "nobody"]])
def test_cli_errors_name_the_problem(argv, capsys, tmp_path):
    assert cli.main([*argv, "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad/name" in err or "nobody" in err


REPO = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "transformers", "gradio", "fastapi", "uvicorn", "alembic", "loraplex.engine.llm",
                 "loraplex.platform.main")


def run_cli(argv: list[str], cwd: Path, env: dict | None = None) -> tuple[int, str, str, list[str]]:
    """Run ``loraplex.cli.main(argv)`` in a fresh interpreter: (status, stdout, stderr, heavy modules imported)."""
    code = ("import json, sys\nfrom loraplex.cli import main\ntry:\n    status = main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    status = exc.code\n"
            f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
            "print('HEAVY=' + json.dumps(heavy), file=sys.stderr)\nsys.exit(status)")
    environment = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_DATA_DIR", "LORAPLEX_DATABASE_URL")}
    environment["PYTHONPATH"] = str(REPO)
    environment.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=120)
    err, _, heavy = proc.stderr.rpartition("HEAVY=")
    return proc.returncode, proc.stdout, err, json.loads(heavy)


def test_help_and_registry_commands_import_nothing_heavy(tmp_path):
    """Issue 15: every CLI call took 3-4 s importing torch; `--help` and registry commands must not."""
    status, out, _, heavy = run_cli(["--help"], tmp_path)
    assert status == 0 and "tenant" in out and heavy == []
    data = ["--data-dir", str(tmp_path / "data")]
    assert run_cli(["tenant", "create", "acme", *data], tmp_path)[0] == 0  # first run migrates (alembic)
    status, out, _, heavy = run_cli(["tenant", "list", *data], tmp_path)
    assert (status, [t["name"] for t in json.loads(out)], heavy) == (0, ["acme"], [])
    status, out, _, heavy = run_cli(["key", "create", "acme", *data], tmp_path)
    assert (status, heavy) == (0, []) and json.loads(out)["key"].startswith("lpx-")


@pytest.mark.parametrize("argv, message", [
    (["adapter", "upload", "acme", "poet", "examples/adapters/pirate"], "pass --model (the demo server's is --model smollm2)"),
    (["adapter", "upload", "acme", "poet", "nowhere", "--model", "TINY"], "path 'nowhere' does not exist"),
    (["adapter", "upload", "nobody", "poet", "examples/adapters/pirate", "--model", "TINY"], "nobody"),
    (["adapter", "upload", "acme", "poet", "examples/adapters/pirate", "--model", "smollm2", "--cache-dir", "EMPTY"],
     "demo model not prepared in 'EMPTY/models/smollm2-135m-instruct'; run `loraplex models prepare smollm2"),
    (["serve", "--model", "smollm2", "--port", "99999"], "port"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, tmp_path, tiny_llama_dir):
    """Issue 15: a missing model was a raw traceback naming the wrong folder. User errors are one line, status 2."""
    empty = tmp_path / "empty"
    argv = [str(tiny_llama_dir) if a == "TINY" else str(empty) if a == "EMPTY" else a for a in argv]
    status, out, err, _ = run_cli([*argv, "--data-dir", str(tmp_path / "data")], REPO)
    assert status == 2, err
    assert "Traceback" not in err and message.replace("EMPTY", str(empty)) in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [err.splitlines()[-1]]


def test_defaults_in_a_source_checkout_are_make_serves_folders(tmp_path, monkeypatch):
    """Run in the repository, the CLI acts on `make serve`'s registry and models (.cache/data, .cache)."""
    from loraplex.platform.settings import Settings

    for name in ("LORAPLEX_DATA_DIR", "LORAPLEX_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    settings = Settings()
    assert (settings.data_dir, settings.cache_dir) == (REPO / ".cache" / "data", REPO / ".cache")
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert (settings.data_dir, settings.cache_dir) == (Path("data"), Path.home() / ".cache" / "loraplex")


def test_ctrl_c_once_serve_listens_is_a_graceful_shutdown_with_status_0(tmp_path, tiny_llama_dir):
    """After the server listens Ctrl-C is uvicorn's (graceful shutdown), and the signal uvicorn raises again at its
    end reaches Python's handler, not the preparation's exit-now one: exit status 0, no "interrupted" line."""
    import os
    import signal

    proc = _serve_process(tmp_path, tiny_llama_dir)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Uvicorn running on" in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "Application shutdown complete" in output and "interrupted" not in output and "Traceback" not in output


def _serve_process(tmp_path, tiny_llama_dir, port: str = "0") -> subprocess.Popen:
    script = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a terminal
        "import sys\n"
        "from loraplex import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    return subprocess.Popen([sys.executable, "-c", script, "serve", "--model", str(tiny_llama_dir), "--port", port,
                             "--data-dir", str(tmp_path / "data"), "--no-engine-process"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_second_ctrl_c_during_the_graceful_shutdown_exits_at_once_in_one_line(tmp_path, tiny_llama_dir):
    """A request still open (its body never sent) holds the graceful shutdown; the second Ctrl-C ends the process
    with one line and status 130: no traceback of cancelled tasks."""
    import os
    import re
    import signal
    import socket

    proc = _serve_process(tmp_path, tiny_llama_dir)
    lines, conn = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            listening = re.search(r"Uvicorn running on http://[^:]+:(\d+)", line)
            if listening:
                conn = socket.create_connection(("127.0.0.1", int(listening.group(1))))
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{")  # the rest of the body never comes
                os.killpg(proc.pid, signal.SIGINT)
                break
        for line in proc.stdout:  # the graceful shutdown waits for the open request
            lines.append(line)
            if "Waiting for connections to close" in line or "Shutting down" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if conn is not None:
            conn.close()
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "loraplex: interrupted again: exiting now (open requests and streams are cut)" in output
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_serve_on_a_port_in_use_exits_with_uvicorns_startup_failure_status(tmp_path, tiny_llama_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _serve_process(tmp_path, tiny_llama_dir, str(taken.getsockname()[1]))
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, output
    assert "address already in use" in output.lower(), output
