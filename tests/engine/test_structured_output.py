"""Structured output (xgrammar bitmasks): the sampler's mask against a loop, schemas on
SmolLM2 with and without an adapter validated by an independent validator (jsonschema_rs),
unconstrained rows unchanged by constrained neighbours, n > 1 forks and preemption."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.llm_engine import InvalidRequestError
from loraplex.engine.sampler import Sampler, SamplingBatch, SamplingRow, apply_token_bitmask_
from loraplex.engine.structured_output import StructuredOutputsParams

ADAPTERS = Path(__file__).resolve().parents[2] / "examples" / "adapters"


# -- the sampler's mask ----------------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_token_bitmask_matches_a_loop(device):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    num_rows, vocab = 5, 77  # 3 words, the last one partly past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, 3), dtype=torch.int32, generator=gen)
    bitmask[2] = -1  # an unconstrained row
    logits = torch.randn(num_rows, vocab, generator=gen)
    expected = logits.clone()
    for b in range(num_rows):
        for t in range(vocab):
            if (int(bitmask[b, t // 32]) >> (t % 32)) & 1 == 0:
                expected[b, t] = float("-inf")
    out = apply_token_bitmask_(logits.clone().to(device), bitmask.to(device)).cpu()
    assert torch.equal(out, expected)
    assert torch.equal(out[2], logits[2])


def test_sampler_never_picks_a_masked_token():
    vocab = 64
    logits = torch.randn(4, vocab)
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    allowed = [5, 40, 63, 0]
    for b, t in enumerate(allowed):
        bit = 1 << (t % 32)
        bitmask[b, t // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32
    rows = [SamplingRow(SamplingParams(temperature=t), [1], []) for t in (0.0, 1.0, 0.7, 1.5)]
    batch = SamplingBatch.build(rows, vocab, "cpu")
    batch.grammar_bitmask = bitmask
    assert Sampler()(logits, batch).token_ids == allowed


# -- params ------------------------------------------------------------------------------------------
def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a+"))


# -- SmolLM2 ------------------------------------------------------------------------------------------
def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
COLOR = {"enum": ["red", "green", "blue"]}

SCHEMAS: list[dict] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"enum": ["yes", "no", "maybe"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    {"type": "string", "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
    {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 2},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 0},
    _obj({"name": NAME, "age": SMALL_INT}),
    _obj({"ok": {"type": "boolean"}, "color": COLOR}),
    _obj({"name": NAME, "nickname": NAME}, required=["name"]),
    _obj({"point": _obj({"x": SMALL_INT, "y": SMALL_INT})}),
    _obj({"outer": _obj({"inner": _obj({"leaf": {"type": "boolean"}})})}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2}}),
    _obj({"pairs": {"type": "array", "items": _obj({"k": COLOR, "v": SMALL_INT}), "maxItems": 2}}),
    _obj({"answer": {"type": "string", "maxLength": 10}, "confidence": {"enum": ["high", "medium", "low"]}}),
    _obj({"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}}),
    _obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    _obj({"kind": {"const": "circle"}, "radius": SMALL_INT}),
    _obj({"status": {"enum": ["active", "inactive"]}, "count": {"type": "integer", "minimum": 1, "maximum": 3}}),
    {"$defs": {"color": COLOR}, **_obj({"fg": {"$ref": "#/$defs/color"}, "bg": {"$ref": "#/$defs/color"}})},
    {"$defs": {"pt": _obj({"x": SMALL_INT, "y": SMALL_INT})},
     **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    {"definitions": {"name": NAME}, **_obj({"first": {"$ref": "#/definitions/name"}})},
    {"$defs": {"item": _obj({"id": SMALL_INT})},
     "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
    {"oneOf": [_obj({"cat": NAME}), _obj({"dog": SMALL_INT})]},
    {"type": "number", "minimum": 0, "maximum": 10},
    _obj({"grid": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                   "minItems": 1, "maxItems": 2}}),
    _obj({"user": _obj({"name": NAME, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]},
                                                "minItems": 1, "maxItems": 2}})}),
]


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    return LLM(str(smollm2_dir), max_model_len=512, max_num_seqs=32, enable_lora=True, max_loras=2, max_lora_rank=8)


def _chat_ids(llm: LLM, text: str) -> dict:
    return {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": text}])}


@pytest.mark.smollm2
def test_every_constrained_output_validates_with_and_without_adapter(smol_llm):
    json_answer = LoRARequest("json-answer", 1, str(ADAPTERS / "json-answer"))
    # One batch: every schema once, every other one on the adapter (schemas alternate in kind).
    cases = [(schema, json_answer if i % 2 else None) for i, schema in enumerate(SCHEMAS)]
    prompts = [_chat_ids(smol_llm, f"Reply with JSON for this schema: {json.dumps(s)}") for s, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=s))
              for s, _ in cases]
    outs = smol_llm.generate(prompts, params, lora_request=[lora for _, lora in cases])
    for (schema, lora), out in zip(cases, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, lora, completion.text)
        value = json.loads(completion.text)
        assert jsonschema_rs.is_valid(schema, value), (schema, lora, completion.text)


@pytest.mark.smollm2
def test_json_object_regex_choice_and_grammar(smol_llm):
    constraints = {
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=r"[a-z]{3,6}-[0-9]{2}"),
        "choice": StructuredOutputsParams(choice=["Paris", "Lyon", "Nice"]),
        "grammar": StructuredOutputsParams(grammar='root ::= "The answer is " ("yes" | "no") "."'),
    }
    prompts = [_chat_ids(smol_llm, "What is the capital of France? Answer in JSON.")] * len(constraints)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c) for c in constraints.values()]
    texts = dict(zip(constraints, (o.outputs[0].text for o in smol_llm.generate(prompts, params))))
    assert isinstance(json.loads(texts["json_object"]), dict)
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", texts["regex"])
    assert texts["choice"] in ("Paris", "Lyon", "Nice")
    assert re.fullmatch(r"The answer is (yes|no)\.", texts["grammar"])


@pytest.mark.smollm2
def test_unconstrained_rows_get_the_tokens_they_get_alone(smol_llm):
    base = [_chat_ids(smol_llm, q) for q in ("Name a fruit.", "Count to five.", "Say hi.")]
    free = [SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=0.9, seed=3, max_tokens=12),
            SamplingParams(temperature=0.0, max_tokens=12)]
    alone = [o.outputs[0].token_ids for o in smol_llm.generate(base, free)]
    schema = SCHEMAS[10]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    mixed = smol_llm.generate([base[0], base[0], base[1], base[1], base[2]],
                              [constrained, free[0], constrained, free[1], free[2]])
    assert [mixed[i].outputs[0].token_ids for i in (1, 3, 4)] == alone
    assert jsonschema_rs.is_valid(schema, json.loads(mixed[0].outputs[0].text))


@pytest.mark.smollm2
def test_bad_constraints_are_refused_with_the_problem(smol_llm):
    bad = {"the JSON schema cannot be compiled: Unsupported type \"objet\"": StructuredOutputsParams(json={"type": "objet"}),
           "the regex cannot be compiled: Regex parsing error": StructuredOutputsParams(regex="a("),
           "the EBNF grammar cannot be compiled": StructuredOutputsParams(grammar="root ::= ")}
    for i, (message, constraint) in enumerate(bad.items()):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            smol_llm.engine.add_request(f"bad-{i}", [1, 2, 3], SamplingParams(structured_outputs=constraint))
    assert not smol_llm.engine.has_unfinished_requests()


# -- tiny model: forks, preemption --------------------------------------------------------------------
PATTERN = r"[a-z]{2,6}(,[a-z]{2,6}){0,3}"


def _tiny_prompts(tiny_llama_dir, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    rng = random.Random(5)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    return [[rng.choice(vocab) for _ in range(rng.randint(5, 30))] for _ in range(count)]


@pytest.mark.parametrize("swap_space", [0.0, 0.01])  # preemption by recompute, by swap
def test_forks_and_preemption_keep_each_matcher_in_step(tiny_llama_dir, swap_space):
    prompts = _tiny_prompts(tiny_llama_dir, 8)
    regex = StructuredOutputsParams(regex=PATTERN)
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=40, structured_outputs=regex) for i in range(4)]
    params += [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4  # unconstrained neighbours

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]

    big = LLM(str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=400)
    expected = run(big)
    small = LLM(str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=20, enable_prefix_caching=False,
                swap_space=swap_space)
    assert run(small) == expected
    assert small.engine.get_stats().num_preemptions > 0
    for group in expected[:4]:
        assert len(group) == 2
        for _, text, finish in group:
            assert finish == "stop" and re.fullmatch(PATTERN, text), text
    # Completion i of an n=2 group equals a solo request seeded seed + i.
    solo = big.generate({"prompt_token_ids": prompts[0]},
                        SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=regex))[0]
    assert solo.outputs[0].token_ids == expected[0][1][0]


def test_stop_strings_and_max_tokens_end_a_constrained_output(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=200)
    prompt = {"prompt_token_ids": _tiny_prompts(tiny_llama_dir, 1)[0]}
    words = StructuredOutputsParams(regex=r"[a-z]{4,8}(,[a-z]{4,8}){3}")
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=words))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and re.fullmatch(r"[a-z,]+", cut.text)
    whole = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=words))[0]
    assert whole.outputs[0].finish_reason == "stop" and re.fullmatch(r"[a-z]{4,8}(,[a-z]{4,8}){3}",
                                                                     whole.outputs[0].text)
    assert whole.outputs[0].token_ids[:3] == cut.token_ids
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, stop=[","],
                                                  structured_outputs=words))[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", ",")
    assert stopped.text == whole.outputs[0].text.split(",")[0]
