"""Async scheduling and streamed outputs: a step's output never carries the placeholder
(``PLACEHOLDER_TOKEN``) of the step launched after it, so the deltas joined equal the final
token ids, and each cumulative output lists real tokens only."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.sequence import PLACEHOLDER_TOKEN


@pytest.mark.parametrize("output_kind", ["delta", "cumulative"])
def test_async_outputs_carry_no_placeholder(tiny_llama_dir, output_kind):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64,
              async_scheduling=True)
    engine = llm.engine
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                            output_kind=output_kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0] for o in engine.step()]
    assert engine.num_overlapped_steps > 0
    final = outputs[-1].token_ids if output_kind == "cumulative" else [t for o in outputs for t in o.token_ids]
    for out in outputs:
        assert PLACEHOLDER_TOKEN not in out.token_ids
    assert len(final) == 6
    # the same tokens as the sync engine's
    sync = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64)
    expected = sync.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert final == expected
