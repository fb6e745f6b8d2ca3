"""Hermes ``<tool_call>`` parsing, whole and streamed in arbitrary pieces, and the forced-call grammars."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest

from loraplex.platform.errors import InvalidRequest
from loraplex.platform.openai_schemas import ChatCompletionRequest
from loraplex.platform.services.tool_calls import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}}]

TEXT = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def plan(**fields) -> ToolPlan:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **fields)
    return ToolPlan.from_request(body)


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_auto_parses_hermes_blocks_and_keeps_text_before_them():
    content, calls = plan().parse(TEXT)
    assert content == "Let me compute."
    assert _calls(calls) == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    assert plan().parse("no calls here") == ("no calls here", [])
    broken = 'x <tool_call>{"name": oops}</tool_call>'
    assert plan().parse(broken) == (broken, [])


@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_give_the_same_content_and_calls(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    pieces = [TEXT[i:j] for i, j in zip([0, *cuts], [*cuts, len(TEXT)])]
    p = plan()
    content, calls = "", []
    for k, piece in enumerate(pieces):
        delta = p.delta(0, piece, finished=k == len(pieces) - 1) or {}
        assert TEXT.find("<tool_call>") < 0 or "<tool" not in delta.get("content", "")
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    assert content == "Let me compute."  # as the whole response's
    assert [c["index"] for c in calls] == [0, 1]
    assert _calls(calls) == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert p.finish_reason(0, "stop") == "tool_calls" and p.finish_reason(0, "length") == "length"


def test_unclosed_block_is_returned_as_text_when_the_stream_ends():
    p = plan()
    first = p.delta(0, "hi <tool_call>{\"name\": \"add\"", finished=False)
    assert first == {"content": "hi"}  # its trailing space held back until text follows
    assert p.delta(0, ", \"argu", finished=True) == {"content": ' <tool_call>{"name": "add", "argu'}


def test_forced_choices_constrain_to_the_parameters_schema():
    named = plan(tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.constraint().json == TOOLS[0]["function"]["parameters"]
    content, calls = named.parse('{"a": 3, "b": 4}')
    assert content is None and _calls(calls) == [("add", {"a": 3, "b": 4})]
    # a named call ends with "stop", streamed or not (OpenAI's answer); required and auto with "tool_calls"
    choice = named.final_choice({"message": {"content": '{"a": 3, "b": 4}'}, "finish_reason": "stop"})
    assert choice["finish_reason"] == "stop" and _calls(choice["message"]["tool_calls"]) == [("add", {"a": 3, "b": 4})]
    assert named.delta(0, '{"a": 3, "b": 4}', finished=True) is not None
    assert named.finish_reason(0, "stop") == "stop"
    required = plan(tool_choice="required", parallel_tool_calls=False)
    schema = required.constraint().json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    assert jsonschema_rs.is_valid(schema, good)
    assert not jsonschema_rs.is_valid(schema, [{"name": "add", "parameters": {"a": "x", "b": 2}}])
    assert not jsonschema_rs.is_valid(schema, [{"name": "sub", "parameters": {}}])
    assert _calls(required.parse(json.dumps(good))[1]) == [("add", {"a": 1, "b": 2})]
    assert required.final_choice({"message": {"content": json.dumps(good)}, "finish_reason": "stop"}
                                 )["finish_reason"] == "tool_calls"
    assert plan(tool_choice="none").parse(TEXT) == (TEXT, [])


def test_bad_tool_requests_are_refused():
    with pytest.raises(InvalidRequest, match="functions is not supported: use tools") as info:
        plan(functions=[{"name": "add"}])
    assert info.value.param == "functions"
    with pytest.raises(InvalidRequest, match="'sub' is not among tools"):
        plan(tool_choice={"type": "function", "function": {"name": "sub"}})
    with pytest.raises(InvalidRequest, match="names must be unique"):
        ToolPlan.from_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    tools=[TOOLS[0], TOOLS[0]]))


def test_chatml_tool_template_renders_the_qwen25_hermes_layout(smollm2_dir):
    from transformers import AutoTokenizer

    from loraplex.platform.services.tool_calls import CHATML_TOOLS_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "CET"}'}}
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
                {"role": "tool", "tool_call_id": "call_2", "content": "13:00"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOLS[1]], chat_template=CHATML_TOOLS_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
        'tags:\n<tools>\n{"type": "function", "function": {"name": "now"}}\n</tools>\n\nFor each function call, '
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text, parallel, content, names", [
    # text after and between calls, and a malformed block: content, the same streamed and whole
    ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> Done.\n', True,
     "Sure.  Done.", ["add"]),
    ('A <tool_call>oops</tool_call> B <tool_call>{"name": "now", "arguments": {}}</tool_call>', True,
     "A <tool_call>oops</tool_call> B", ["now"]),
    # a function the request did not offer is no call: its block stays text
    ('<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>', True,
     '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>', []),
    # parallel_tool_calls false: the first call only
    (TEXT, False, "Let me compute.", ["add"]),
    ("\n" + TEXT.split("\n", 1)[1], True, None, ["add", "now"]),
])
def test_auto_content_and_calls_are_the_same_streamed_and_whole(text, parallel, content, names):
    whole_content, whole_calls = plan(parallel_tool_calls=parallel).parse(text)
    assert whole_content == content
    assert [c["function"]["name"] for c in whole_calls] == names
    for seed in range(4):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
        p = plan(parallel_tool_calls=parallel)
        streamed, calls = "", []
        for k, (i, j) in enumerate(zip([0, *cuts], [*cuts, len(text)])):
            delta = p.delta(0, text[i:j], finished=j == len(text)) or {}
            streamed += delta.get("content", "")
            calls += delta.get("tool_calls", [])
        assert streamed == (content or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]


def test_a_named_call_cut_by_max_tokens_is_a_call_streamed_and_whole():
    named = plan(tool_choice={"type": "function", "function": {"name": "add"}})
    content, calls = named.parse('{"a": 3, "b"')
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"a": 3, "b"']
    streamed = named.delta(0, '{"a": 3, "b"', finished=True)
    assert streamed["tool_calls"][0]["function"]["arguments"] == '{"a": 3, "b"'
