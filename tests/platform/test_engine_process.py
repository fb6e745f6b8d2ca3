"""The engine in a process of its own (``serve --engine-process``, ``engine_process.py``).

References: HF transformers / PEFT greedy generation for the tokens served through the official
``openai`` client, the in-process ``AsyncEngine`` over the same model for the engine client's
outputs, and the engine's own exception types (raised in the gateway with their fields).
"""

from __future__ import annotations

import asyncio
import logging
import pickle

import openai
import pytest
from platform_testlib import make_peft_adapter, make_settings, new_tenant, peft_reference_greedy, run_server
from test_adapter_lifecycle import upload_zip
from transformers import AutoTokenizer

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.config import ConfigError
from loraplex.engine.input_processor import (
    ContextLengthExceededError,
    EmptyPromptError,
    InvalidRequestError,
    ProcessedPrompt,
    PromptTooLongError,
    TokenIdOutOfVocabError,
)
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.async_engine import AsyncEngine, EngineStoppedError
from loraplex.platform.engine_process import ProcessEngineClient, picklable

PROMPT = "The quick brown fox"
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4, num_kv_blocks=96, max_num_seqs=8,
              block_size=16)


@pytest.fixture
def settings(tmp_path, tiny_llama_dir):
    return make_settings(tmp_path, model=str(tiny_llama_dir), served_model_name="tiny", **ENGINE)  # the default


@pytest.fixture
def client(settings):
    engine = ProcessEngineClient(settings)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter"), r=8, alpha=16, seed=3)


def _greedy(max_tokens: int, kind: str = "delta") -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


async def _collect(engine, request_id, prompt, params, lora=None):
    outputs = []
    async for output in engine.generate(request_id, prompt, params, lora):
        outputs.append(output)
    return outputs


def _joined(outputs) -> tuple[list[int], str]:
    return [t for o in outputs for t in o.outputs[0].token_ids], "".join(o.outputs[0].text for o in outputs)


def test_outputs_equal_the_in_process_engine(client, tiny_llama_dir, adapter_dir):
    """Same requests (base and adapter, delta and cumulative), same step-by-step outputs as an
    AsyncEngine in this process over the same model."""
    from loraplex.platform.main import build_engine

    settings = make_settings(tiny_llama_dir.parent, model=str(tiny_llama_dir), **ENGINE)
    local = AsyncEngine(build_engine(settings))
    local.start()
    lora = LoRARequest("poet", 1, str(adapter_dir))
    prompt = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(PROMPT)

    with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="delta",
                                          prompt_logprobs=2, n=2)

    async def both():
        results = []
        for engine in (client, local):
            results.append(await asyncio.gather(
                _collect(engine, "a", prompt, _greedy(12)), _collect(engine, "b", prompt, _greedy(12), lora),
                _collect(engine, "c", prompt[:2], _greedy(5, "cumulative"), lora),
                _collect(engine, "d", ProcessedPrompt(PROMPT, prompt, 6), with_prompt_logprobs)))
        return results

    def fields(output):  # everything but queued_s (a time) and the logprobs' float noise (batching differs)
        return (output.request_id, output.prompt, output.prompt_token_ids, output.finished, output.lora_name,
                output.num_cached_tokens, output.error,
                [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in output.outputs],
                [round(c.cumulative_logprob, 3) for c in output.outputs],
                None if output.prompt_logprobs is None else
                [None if p is None else {t: round(v, 3) for t, v in p.items()} for p in output.prompt_logprobs])

    try:
        remote, here = asyncio.run(both())
    finally:
        local.shutdown()
    for got, want in zip(remote, here):
        assert [fields(o) for o in got] == [fields(o) for o in want]
    assert remote[3][-1].prompt == PROMPT and len(remote[3][-1].prompt_logprobs) == len(prompt)
    assert _joined(remote[0])[0] != _joined(remote[1])[0]  # the adapter changes the tokens
    assert len(_joined(remote[0])[0]) == 12 and remote[0][-1].finished


def test_engine_errors_reach_the_gateway_with_their_fields(client):
    async def refused(prompt, params):
        with pytest.raises(InvalidRequestError) as info:
            await client.add_request("r", prompt, params)
        return info.value

    exc = asyncio.run(refused([5, client.vocab_size + 7], _greedy(4)))
    assert type(exc) is TokenIdOutOfVocabError and (exc.token_id, exc.vocab_size) == (client.vocab_size + 7,
                                                                                       client.vocab_size)
    exc = asyncio.run(refused([5] * client.max_model_len, _greedy(4)))
    assert type(exc) is PromptTooLongError and exc.num_prompt_tokens == client.max_model_len

    async def duplicate():
        stream = await client.add_request("dup", [5, 6], _greedy(50))
        with pytest.raises(InvalidRequestError, match="already in use"):
            await client.add_request("dup", [5, 6], _greedy(50))
        stream.close()

    asyncio.run(duplicate())


@pytest.mark.parametrize("exc", [EmptyPromptError(), TokenIdOutOfVocabError(9, 8),
                                 ContextLengthExceededError(10, 5, 12), PromptTooLongError(12, None, 12),
                                 ConfigError("block_size", 3, "must be one of 8, 16, 32")])
def test_engine_exceptions_survive_pickling(exc):
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and vars(again) == vars(exc)
    assert picklable(exc) is exc


def test_an_exception_that_cannot_be_pickled_arrives_as_runtime_error():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    stand_in = picklable(Odd(1, 2))
    assert type(stand_in) is RuntimeError and str(stand_in) == "Odd: 1/2"


def test_close_aborts_and_on_done_runs_once(client):
    done = []

    async def run():
        stream = await client.add_request("long", [5, 6, 7], _greedy(400), on_done=lambda: done.append(1))
        first = await stream.__anext__()
        stream.close()
        for _ in range(3000):  # the engine process confirms the abort with the request's "done"
            if done:
                break
            await asyncio.sleep(0.01)
        return first

    first = asyncio.run(run())
    assert not first.finished and done == [1]
    assert "long" not in client._requests


def test_preload_and_retire_adapters(client, adapter_dir, tmp_path):
    assert client.preload_lora(LoRARequest("poet", 1, str(adapter_dir))).result(60) is True
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError):
        client.preload_lora(LoRARequest("bad", 2, str(bad))).result(60)
    released = []
    client.retire_lora(1, lambda: released.append(1))
    for _ in range(3000):
        if released:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert released == [1]


def test_a_dead_engine_process_fails_streams_and_requests(client, caplog):
    """Killed from outside: the stream fails with the signal named, new requests are refused, and the
    server log says so (once) with the process id and the signal."""
    async def run():
        stream = await client.add_request("x", [5, 6, 7], _greedy(400))
        await stream.__anext__()
        client._process.kill()
        with pytest.raises(EngineStoppedError, match="killed by signal 9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await client.add_request("y", [5, 6], _greedy(4))

    with caplog.at_level(logging.ERROR, logger="loraplex.platform.engine_process"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records] == [
        f"engine process (pid {client._process.pid}) stopped (killed by signal 9): requests fail with 503 until the "
        "server is restarted"]
    assert not client.is_running
    with pytest.raises(EngineStoppedError):
        client.preload_lora(LoRARequest("poet", 1, "/nowhere")).result(10)


def test_a_tensor_parallel_engine_runs_in_the_engine_process(tmp_path, tiny_llama_dir, adapter_dir):
    """The engine process may start processes of its own (2 tensor-parallel ranks on gloo): it is not
    a daemon. Tokens equal the 1-GPU engine's (an in-process AsyncEngine)."""
    from loraplex.platform.main import build_engine

    settings = make_settings(tmp_path, model=str(tiny_llama_dir), engine_process=True, tensor_parallel_size=2,
                             **ENGINE)
    prompt = [5, 6, 7, 8, 9]
    lora = LoRARequest("poet", 1, str(adapter_dir))
    remote = ProcessEngineClient(settings)
    local = AsyncEngine(build_engine(make_settings(tmp_path, model=str(tiny_llama_dir), **ENGINE)))
    local.start()
    try:
        got, want = (asyncio.run(_collect(engine, "r", prompt, _greedy(8), lora)) for engine in (remote, local))
    finally:
        remote.shutdown()
        local.shutdown()
    assert _joined(got) == _joined(want) and len(_joined(got)[0]) == 8
    assert not remote._process.is_alive()
    # uploads are checked against the engine's spec: sharded, it refuses embedding / LM-head adapters (review:
    # the gateway read the model folder's, which accepts them); on one device it takes them
    assert remote.base_spec.vocab_size is None and local.base_spec.vocab_size == remote.vocab_size


def test_a_queue_deadline_ends_the_stream_with_queue_timed_out(tmp_path, tiny_llama_dir):
    """One sequence at a time: the second request waits past its deadline; its stream raises
    QueueTimedOut (with its Retry-After) and on_done runs once (review: the "done" overtook the error
    and the stream hung)."""
    from loraplex.platform.errors import QueueTimedOut

    settings = make_settings(tmp_path, model=str(tiny_llama_dir), engine_process=True,
                             **{**ENGINE, "max_num_seqs": 1})
    engine = ProcessEngineClient(settings)
    done = []

    async def run():
        first = await engine.add_request("first", [5, 6, 7], _greedy(300))
        await first.__anext__()
        late = await engine.add_request("late", [5, 6], _greedy(4), queue_deadline=engine.clock() + 0.2,
                                        retry_after_s=7, on_done=lambda: done.append("late"))
        with pytest.raises(QueueTimedOut) as info:
            await asyncio.wait_for(late.__anext__(), 30)
        first.close()
        for _ in range(3000):
            if done:
                break
            await asyncio.sleep(0.01)
        return info.value

    try:
        exc = asyncio.run(run())
    finally:
        engine.shutdown()
    assert exc.retry_after_s == 7 and done == ["late"]


def test_a_cancelled_add_request_does_not_leave_the_request_running(client):
    """Cancelled while the engine process takes it: the request is aborted there, and a later answer
    does not break the client (review)."""
    async def run():
        task = asyncio.ensure_future(client.add_request("gone", [5, 6, 7], _greedy(400)))
        await asyncio.sleep(0)  # the "add" is sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        outputs = await _collect(client, "after", [5, 6], _greedy(3))
        await asyncio.sleep(3 * client.stats_interval_s)  # the snapshot taken when "after" finished arrives
        return client.stats_dict(), outputs

    stats, outputs = asyncio.run(run())
    # "gone" would still be running its 400 tokens
    assert stats["num_running"] + stats["num_waiting"] == 0 and stats["generated_tokens_total"] < 100
    assert client.is_running and outputs[-1].finished


def test_ctrl_c_does_not_stop_the_engine_process(client):
    """SIGINT reaches the whole process group; the engine process leaves stopping to the gateway."""
    import os
    import signal

    os.kill(client._process.pid, signal.SIGINT)
    outputs = asyncio.run(_collect(client, "still", [5, 6], _greedy(4)))
    assert outputs[-1].finished and client.is_running


def _crashing_engine(settings):
    """An engine whose thread dies at its first look for work (a BaseException escapes AsyncEngine._run)."""
    from loraplex.platform.main import build_engine

    engine = build_engine(settings)

    def crash():
        raise SystemExit("engine thread crash (test)")

    engine.has_unfinished_requests = crash
    return engine


def test_a_crashed_engine_thread_is_reported_as_not_running(settings):
    engine = ProcessEngineClient(settings, _crashing_engine)
    try:
        for _ in range(3000):
            if not engine.is_running:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert not engine.is_running and engine._process.is_alive()
        with pytest.raises(EngineStoppedError, match="engine thread"):
            asyncio.run(engine.add_request("x", [5, 6], _greedy(2)))
    finally:
        engine.shutdown()
    assert not engine._process.is_alive()


def test_a_bad_engine_config_is_raised_by_the_gateway(tmp_path, tiny_llama_dir):
    settings = make_settings(tmp_path, model=str(tmp_path / "no-such-model"), engine_process=True)
    with pytest.raises(Exception, match="no-such-model"):
        ProcessEngineClient(settings)


def test_engine_process_and_replicas_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="engine_process"):
        make_settings(tmp_path, engine_process=True, replicas=2)


def test_served_through_the_api_as_peft_generates(settings, tiny_llama_dir, adapter_dir):
    """``create_app`` with no engine and default settings (the engine in its own process): the
    official client, streamed and not,
    base model and an uploaded adapter, against HF/PEFT greedy tokens."""
    from loraplex.platform.main import create_app

    live = run_server(create_app(settings))
    try:
        assert isinstance(live.ctx.engine, ProcessEngineClient)
        key = new_tenant(live, "acme")
        with live.admin() as admin:
            assert upload_zip(admin, "acme", "poet", adapter_dir).status_code == 201
        client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=60)
        tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
        prompt_ids = tok.encode(PROMPT)
        for model, adapter in (("tiny", None), ("poet", adapter_dir)):
            want = tok.decode(peft_reference_greedy(tiny_llama_dir, adapter, prompt_ids, 10, ignore_eos=True),
                              skip_special_tokens=True)
            kwargs = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
            assert client.completions.create(**kwargs).choices[0].text == want
            chunks = list(client.completions.create(stream=True, **kwargs))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        with live.admin() as admin:
            stats = admin.get("/admin/stats").json()
        assert stats is not None
        live.ctx.engine._process.kill()  # the engine dies: a clear 503 in OpenAI's format, not a hang
        live.ctx.engine._reader.join(10)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert caught.value.status_code == 503
        assert caught.value.body["message"] == ("the model's engine has stopped (the server log says why); "
                                                "restart the server")
    finally:
        live.stop()


def _loading_forever(settings):
    """An engine factory that never finishes: marks that the child reached it, then waits (a long model load)."""
    import time
    from pathlib import Path

    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    (Path(settings.data_dir) / "loading").write_text("x")
    time.sleep(600)


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX signal masks")
def test_the_engine_process_is_spawned_with_sigint_blocked(tmp_path):
    """A Ctrl-C while the spawned child still imports (before it ignores SIGINT) stays pending there instead of
    raising a KeyboardInterrupt with a traceback; the gateway's own mask is restored after the spawn. In a fresh
    interpreter: there the spawn also starts multiprocessing's resource tracker, which unblocks SIGINT in the
    starting thread (sigint_blocked starts it first)."""
    import subprocess
    import sys

    script = tmp_path / "spawn_blocked.py"
    script.write_text(
        "import multiprocessing, signal\n"
        "from loraplex.platform.core.signals import sigint_blocked\n"
        "def report(conn):\n"
        "    conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
        "if __name__ == '__main__':\n"
        "    context = multiprocessing.get_context('spawn')\n"
        "    ours, theirs = context.Pipe()\n"
        "    with sigint_blocked():\n"
        "        child = context.Process(target=report, args=(theirs,))\n"
        "        child.start()\n"
        "    print('child blocked:', ours.recv(), flush=True)\n"
        "    child.join(60)\n"
        "    print('parent blocked:', signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "child blocked: True" in out.stdout and "parent blocked: False" in out.stdout, out.stderr


def test_ctrl_c_while_the_engine_loads_stops_the_child_at_once(tmp_path, tiny_llama_dir):
    """Ctrl-C (SIGINT to the process group) while the engine process builds its engine: the gateway's wait
    raises KeyboardInterrupt, the child is terminated then (no stop timeout: it is not reading its pipe), and
    neither process prints a traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = (
        # SIGINT as in a terminal: a shell runs background jobs (`.ci/run &`) with SIGINT ignored, inherited here
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import multiprocessing, sys\n"
        "from pathlib import Path\n"
        "import test_engine_process as t\n"
        "from platform_testlib import make_settings\n"
        "from loraplex.platform.engine_process import ProcessEngineClient\n"
        "settings = make_settings(Path(sys.argv[1]), model=sys.argv[2], served_model_name='tiny', **t.ENGINE)\n"
        "try:\n"
        "    ProcessEngineClient(settings, t._loading_forever)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted; children:', multiprocessing.active_children(), flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(tiny_llama_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = tmp_path / "data" / "loading"
    try:
        while not marker.exists() and proc.poll() is None:  # the child reached the engine factory
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "interrupted; children: []" in out
    assert "Traceback" not in err


def _failing_engine(settings):
    raise ValueError("no engine (test)")


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX signal masks")
def test_the_gateway_starts_the_engine_process_with_sigint_blocked(settings, monkeypatch):
    """ProcessEngineClient itself spawns inside sigint_blocked (the mask the child inherits at Process.start)."""
    import multiprocessing.context
    import signal

    masks = []
    start = multiprocessing.context.SpawnProcess.start

    def recording_start(self):
        masks.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return start(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", recording_start)
    with pytest.raises(ValueError, match="no engine"):
        ProcessEngineClient(settings, _failing_engine)
    assert masks == [True]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
