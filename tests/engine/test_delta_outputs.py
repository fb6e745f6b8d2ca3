"""Delta outputs (``output_kind="delta"``): after every step, the deltas received so far joined
equal the cumulative output of the same step (token ids, text, logprobs, text ends, finish),
with seeded sampling, ``n = 2`` forks, logprobs and a stop string that cuts the text."""

from __future__ import annotations

import dataclasses

from loraplex import LLM, SamplingParams
from loraplex.engine.outputs import CompletionOutput


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> list[dict]:
    """Per step: request id -> that step's RequestOutput."""
    engine = llm.engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append({o.request_id: o for o in engine.step()})
    return steps


def _join(acc: dict[int, CompletionOutput], delta: CompletionOutput) -> CompletionOutput:
    have = acc.get(delta.index) or CompletionOutput(delta.index, logprobs=[] if delta.logprobs is not None else None,
                                                     token_text_ends=[] if delta.token_text_ends is not None else None)
    joined = CompletionOutput(
        delta.index, have.text + delta.text, have.token_ids + delta.token_ids,
        None if delta.logprobs is None else have.logprobs + delta.logprobs, delta.cumulative_logprob,
        delta.finish_reason, delta.stop_reason,
        None if delta.token_text_ends is None else have.token_text_ends + delta.token_text_ends)
    acc[delta.index] = joined
    return joined


def test_deltas_join_to_the_cumulative_output_of_every_step(tiny_llama_dir):
    # no prefix caching: a cached prompt takes another float32 path (logprobs differ in the 7th digit)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=256,
              enable_prefix_caching=False)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": [20, 21, 22, 23]}
    base = {"a": SamplingParams(temperature=0.9, seed=1, max_tokens=14, ignore_eos=True, logprobs=2),
            "b": SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=10, ignore_eos=True, logprobs=0),
            "c": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)}
    # the stop string: two characters from the middle of c's unconstrained text
    plain = _run(llm, {"c0": (prompts["c"], base["c"])})[-1]["c0"].outputs[0].text
    assert len(plain) >= 8
    base["c"] = dataclasses.replace(base["c"], stop=[plain[4:6]])
    cumulative = _run(llm, {k: (prompts[k], p) for k, p in base.items()})
    delta = _run(llm, {k: (prompts[k], dataclasses.replace(p, output_kind="delta")) for k, p in base.items()})
    assert len(delta) == len(cumulative) and [set(s) for s in delta] == [set(s) for s in cumulative]
    joined: dict[str, dict[int, CompletionOutput]] = {k: {} for k in base}
    sent_tokens = 0
    for step_cum, step_delta in zip(cumulative, delta):
        for rid, out in step_delta.items():
            got = [_join(joined[rid], c) for c in out.outputs]
            assert got == step_cum[rid].outputs
            assert out.finished == step_cum[rid].finished
            sent_tokens += sum(len(c.token_ids) for c in out.outputs)
    final_c = cumulative[-1].get("c") or next(s["c"] for s in reversed(cumulative) if "c" in s)
    assert final_c.outputs[0].finish_reason == "stop" and final_c.outputs[0].stop_reason == plain[4:6]
    assert final_c.outputs[0].text == plain[:plain.index(plain[4:6])]
    assert [len(joined["b"][i].token_ids) for i in (0, 1)] == [10, 10] and len(joined["a"][0].token_ids) == 14
    assert sent_tokens == 14 + 20 + len(joined["c"][0].token_ids)  # each token sent exactly once
    assert llm.engine._sent == {}


def test_outputs_pickle_by_position_with_every_field():
    """The engine process pickles every step's outputs: a round trip keeps every field (each set to a value
    unlike its default and its neighbours', so a field order mix-up shows), and the pickle carries values,
    not field names (the positional form, ``_pickled_by_position``)."""
    import copy
    import pickle

    from loraplex.engine.outputs import RequestOutput

    completion = CompletionOutput(index=2, text="hé", token_ids=[7, 8], logprobs=[{7: -0.5}, {8: -1.5}],
                                  cumulative_logprob=-2.0, finish_reason="stop", stop_reason="\n",
                                  token_text_ends=[1, 2])
    output = RequestOutput("req-1", "prompt", [1, 2, 3], [completion], True, [None, {2: -0.25}], "poet", 16,
                           "an error", 0.125)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        data = pickle.dumps(output, protocol=protocol)
        assert pickle.loads(data) == output
        assert b"token_text_ends" not in data and b"num_cached_tokens" not in data
    assert copy.deepcopy(output) == output and copy.deepcopy(output).outputs[0] is not completion
