"""Async scheduling and streamed outputs: a step's output never carries the placeholder
(``PLACEHOLDER_TOKEN``) of the step launched after it, so the deltas joined equal the final
token ids, and each cumulative output lists real tokens only."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

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
    # HF transformers' greedy tokens, EOS not stopping them (ignore_eos)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = [5, 6, 7, 8, 9]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert final == ids[5:]
