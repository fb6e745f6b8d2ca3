"""Child processes end when the process that started them is killed: a tensor-parallel worker rank waiting for a
rendezvous that will never come, and the platform's engine process while its engine loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 60  # a liveness bound (the watch polls every 0.5 s); without the watch the child outlives it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped by its new parent yet) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _orphan_child(body: str, folder: Path) -> int:
    """Run ``body`` (a script file: spawn re-imports it in the child) in a parent process that starts a child and
    prints ``child <pid> <alive>``, then SIGKILL the parent; returns the child's pid."""
    script = folder / "parent.py"
    script.write_text(textwrap.dedent(body))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    line = parent.stdout.readline()
    assert line.startswith("child ") and line.split()[2] == "True", line  # the child runs when its parent dies
    child = int(line.split()[1])
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return child


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_tensor_parallel_rank_exits_when_its_driver_is_killed_during_the_rendezvous(tiny_llama_dir, tmp_path):
    """The rank waits for rank 0's store at a port nobody listens on (gloo would wait 30 minutes)."""
    child = _orphan_child(f"""
        import multiprocessing, socket, time
        from loraplex.engine.config import EngineConfig
        from loraplex.engine.worker import _worker_main
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = EngineConfig(model={str(tiny_llama_dir)!r}, device="cpu", tensor_parallel_size=2)
        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(
                target=_worker_main, args=(config, {str(tiny_llama_dir)!r}, 1, f"tcp://127.0.0.1:{{port}}", True))
            p.start()
            time.sleep(3)  # the rank is importing or waiting for the store
            print("child", p.pid, p.is_alive(), flush=True)
            time.sleep(600)
    """, tmp_path)
    assert _wait_gone(child), "the worker rank outlived its killed driver"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_engine_process_exits_when_its_gateway_is_killed_while_the_engine_loads(tmp_path):
    """The engine factory blocks (a model that takes long to load); the gateway is SIGKILLed."""
    child = _orphan_child(f"""
        import multiprocessing, time
        from loraplex.platform.engine_process import _child_main
        from loraplex.platform.settings import Settings

        def slow_factory(settings):
            time.sleep(600)

        if __name__ == "__main__":
            ours, theirs = multiprocessing.get_context("spawn").Pipe()
            settings = Settings(model="tiny", data_dir={str(tmp_path / "data")!r})
            p = multiprocessing.get_context("spawn").Process(target=_child_main, args=(theirs, settings, slow_factory))
            p.start()
            time.sleep(3)
            print("child", p.pid, p.is_alive(), flush=True)
            time.sleep(600)
    """, tmp_path)
    assert _wait_gone(child), "the engine process outlived its killed gateway"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_a_child_whose_parent_died_before_the_watch_started_still_exits(tmp_path):
    """The parent is killed while the child is still starting (importing, as a loaded CI machine's engine process
    was): the watch, started after, must still know the parent it was started under (CI, session 15: os.getppid()
    at the call was already the subreaper's pid, and the engine process lived on)."""
    child = _orphan_child("""
        import multiprocessing, time

        def target():
            time.sleep(2)  # still starting when the parent is killed
            from loraplex.engine.parent_watch import exit_when_parent_exits
            exit_when_parent_exits("test child", poll_s=0.1)
            time.sleep(600)

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=target)
            p.start()
            print("child", p.pid, p.is_alive(), flush=True)
            time.sleep(600)
    """, tmp_path)
    assert _wait_gone(child), "the child outlived the parent that died before its watch started"
