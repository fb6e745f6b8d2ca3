"""Structured output that the grammar engine cannot honour is refused, end to end through the official
``openai`` client against SmolLM2-135M-Instruct served live (session 32's review: each of these was served
before, at 937a218): schema keywords xgrammar does not enforce (200 with output breaking the schema), a
constraint that admits no output (200 with ``choices: []``), a deeply nested ``structured_outputs.json``
string (500), and ``tool_choice: "required"`` over tools whose parameters use ``$defs`` (400)."""

from __future__ import annotations

import openai
import pytest
from platform_testlib import make_settings, new_tenant, run_server
from pydantic import BaseModel

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a city.",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}},
                                                             "required": ["city"], "additionalProperties": False},
                                              "strict": True}}


@pytest.fixture(scope="module")
def live(smollm2_dir, tmp_path_factory):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.platform.main import create_app

    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    max_model_len=1024, max_num_seqs=4))
    server = run_server(create_app(make_settings(tmp_path_factory.mktemp("structured_refusals")), engine))
    key = new_tenant(server, "acme")
    client = openai.OpenAI(api_key=key, base_url=server.url + "/v1", max_retries=0, timeout=300)
    server.key = key
    yield server, client, client.models.list().data[0].id
    server.stop()


# -- JSON schema keywords xgrammar does not enforce --------------------------------------------------
# Each schema is satisfiable; the server answered 200 with finish_reason "stop" and JSON that violated it
# (xgrammar ignores allOf / contains / if-then-else / required names missing from properties / not /
# uniqueItems). README: "nothing is silently ignored"; such a schema is now a 400.
UNENFORCED = {
    "allOf": {"allOf": [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"]},
                        {"type": "object", "properties": {"population": {"type": "integer"}},
                         "required": ["population"]}]},
    "contains": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "contains": {"const": 7},
                 "minItems": 1, "maxItems": 3},
    "if_then_else": {"type": "object", "properties": {"kind": {"enum": ["number", "word"]}, "value": {}},
                     "required": ["kind", "value"], "if": {"properties": {"kind": {"const": "number"}}},
                     "then": {"properties": {"value": {"type": "integer"}}},
                     "else": {"properties": {"value": {"type": "string", "maxLength": 10}}}},
    "required_not_in_properties": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                   "required": ["country"]},
    "not": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12, "not": {"const": "Paris"}}},
            "required": ["city"]},
    "uniqueItems": {"type": "array", "items": {"enum": ["Paris", "Rome"]}, "uniqueItems": True, "minItems": 2,
                    "maxItems": 2},
}


@pytest.mark.parametrize("name", sorted(UNENFORCED))
def test_schema_keywords_the_grammar_cannot_enforce_are_refused_not_ignored(live, name):
    _, client, model = live
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNENFORCED[name], "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, response_format=fmt, max_tokens=60,
                                       temperature=0)
    assert "does not enforce" in info.value.body["message"], info.value.body


# -- a constraint no output can satisfy --------------------------------------------------------------
@pytest.mark.parametrize("constraint", [{"grammar": "root ::= root"}, {"regex": "[^\\x00-\\U0010FFFF]"}])
def test_constraint_with_no_valid_output_is_an_error_not_a_reply_without_choices(live, constraint):
    """The mask allows no token, the sampler picks token 0, the grammar refuses it and the
    sequence was aborted: 200 with ``choices: []``. Now a 400 before the request is queued."""
    _, client, model = live
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                       extra_body={"structured_outputs": constraint})
    assert "admits no output" in info.value.body["message"]


def test_deeply_nested_structured_outputs_json_text_is_400_not_500(live):
    _, client, model = live
    schema = '{"type": "integer"}'
    for _ in range(600):
        schema = '{"type": "object", "properties": {"a": ' + schema + '}}'
    with pytest.raises(openai.BadRequestError):  # was a 500 (RecursionError in json.loads)
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2,
                                       extra_body={"structured_outputs": {"json": schema}})


# -- tool calling ------------------------------------------------------------------------------------
class Address(BaseModel):
    city: str
    country: str


class Shipment(BaseModel):
    to: Address
    weight_kg: int


def test_required_tool_choice_takes_tools_whose_parameters_use_defs(live):
    """``openai.pydantic_function_tool`` of a nested model gives ``$defs`` + ``$ref: #/$defs/...``: the
    named choice worked, ``required`` was a 400 (the refs were embedded under the array schema, whose root
    had no ``$defs``); now the tools' ``$defs`` move to the root, as vLLM does."""
    _, client, model = live
    tool = openai.pydantic_function_tool(Shipment, name="ship")
    messages = [{"role": "user", "content": "Ship 3 kg to Paris, France."}]
    named = client.chat.completions.create(model=model, messages=messages, tools=[tool], max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "ship"}})
    assert named.choices[0].message.tool_calls  # works
    out = client.chat.completions.create(model=model, messages=messages, tools=[tool], tool_choice="required",
                                         max_tokens=60, temperature=0)  # was a 400 "Cannot find field '$defs'"
    (call,) = out.choices[0].message.tool_calls
    Shipment.model_validate_json(call.function.arguments)
