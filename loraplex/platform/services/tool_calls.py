"""Tool calling: ``tools``/``tool_choice`` into the chat template, calls out of the text.

Supported chat templates (else ``tools`` is a 400, never dropped):

- a model template that renders ``tools`` itself and whose calls are Hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2/2.5/3, Hermes 2/3):
  used as is, with ``tools`` passed to ``apply_chat_template``;
- a ChatML template (``<|im_start|>``) without tool support (SmolLM2): loraplex renders
  with :data:`CHATML_TOOLS_TEMPLATE`, a Hermes/Qwen2.5-style ChatML template that lists
  the tools in the system message and renders assistant ``tool_calls`` and ``tool``
  messages (as ``<tool_response>``).

``tool_choice`` (default ``auto`` with tools, ``none`` without):

- ``none``: tools are shown to the model, the text is returned as content.
- ``auto``: the text is parsed; each well-formed ``<tool_call>`` block naming an offered
  function becomes a ``tool_calls`` entry (only the first with ``parallel_tool_calls:
  false``); the text outside them is ``content`` (without trailing whitespace once a call
  is made), streamed or not.
- a named function: the output is constrained (xgrammar) to that function's
  ``parameters`` JSON schema and returned as its arguments (as vLLM does).
- ``required``: the output is constrained to a JSON array (``minItems`` 1; at most 1
  with ``parallel_tool_calls: false``) of ``{"name": <a tool>, "parameters": <its
  schema>}`` objects (as vLLM does), each one becoming a call.

``finish_reason`` is ``tool_calls`` when a call was returned and generation stopped
(not when it ran out of ``max_tokens``), except for a named function, where it stays ``stop``
as OpenAI's API answers (measured there, streamed and not: vLLM pull request 25054). Streaming
sends text as ``content`` deltas and each call as ``tool_calls`` deltas (``index``, ``id``, ``function.name``, then
``function.arguments`` pieces; a named choice streams the arguments as they come).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.structured_output import StructuredOutputsParams
from loraplex.platform.errors import InvalidRequest

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Written for transformers' jinja settings (trim_blocks, lstrip_blocks): a newline right after a
# block tag would be dropped, so those are emitted as {{ '\n' }}.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>{{ '\\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}"
    "{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_template_inputs(tokenizer, body) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages as dicts, extra ``apply_chat_template`` kwargs) for a chat request.

    Raises ``InvalidRequest`` when tools or tool messages are given and the model's template
    is neither tool-aware nor ChatML.
    """
    messages = [_message_dict(m) for m in body.messages]
    uses_tools = bool(body.tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not uses_tools:
        return messages, {}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    kwargs: dict[str, Any] = {}
    if body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if "tools" in template and TOOL_CALL_START in template:
        return messages, kwargs
    if "<|im_start|>" in template:
        return messages, {**kwargs, "chat_template": CHATML_TOOLS_TEMPLATE}
    raise InvalidRequest("tools: this model's chat template neither renders tools in the Hermes <tool_call> "
                         "format nor is ChatML, so loraplex cannot offer tools to it", param="tools",
                         code="unsupported_parameter")


def _message_dict(m) -> dict[str, Any]:
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
    out: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


@dataclass
class ToolPlan:
    """How one chat request's output becomes ``content``/``tool_calls``.

    ``mode``: ``none`` | ``auto`` | ``required`` | ``named``; ``schemas``: tool name ->
    parameters schema; ``named``: the forced tool (mode ``named``).
    """

    mode: str
    schemas: dict[str, dict[str, Any]]
    named: str | None = None
    parallel: bool = True
    _streams: dict[int, _StreamState] = field(default_factory=dict)

    @classmethod
    def from_request(cls, body) -> ToolPlan | None:
        """None when the request has no tools. Raises ``InvalidRequest`` for a bad ``tool_choice``
        and for OpenAI's retired ``functions``/``function_call`` (use ``tools``/``tool_choice``)."""
        for retired in ("functions", "function_call"):
            if getattr(body, retired, None) is not None:
                raise InvalidRequest(f"{retired} is not supported: use tools and tool_choice", param=retired,
                                     code="unsupported_parameter")
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise InvalidRequest("tool_choice needs tools", param="tool_choice")
            return None
        schemas = {t.function.name: t.function.parameters or {"type": "object", "properties": {}}
                   for t in body.tools}
        if len(schemas) != len(body.tools):
            raise InvalidRequest("tools: function names must be unique", param="tools")
        parallel = body.parallel_tool_calls is not False
        if choice is None or isinstance(choice, str):
            return cls(choice or "auto", schemas, parallel=parallel)
        if choice.function.name not in schemas:
            raise InvalidRequest(f"tool_choice: function {choice.function.name!r} is not among tools",
                                 param="tool_choice")
        return cls("named", schemas, named=choice.function.name, parallel=parallel)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces the call(s) (``named``/``required``), else None."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.schemas[self.named])
        if self.mode == "required":
            # each tool's "$defs"/"definitions" move to the array's root, where its "#/$defs/..." refs now point
            shared: dict[str, dict[str, Any]] = {}
            items = []
            for name, schema in self.schemas.items():
                schema = dict(schema)
                for key in ("$defs", "definitions"):
                    for def_name, definition in (schema.pop(key, None) or {}).items():
                        if shared.setdefault(key, {}).setdefault(def_name, definition) != definition:
                            raise InvalidRequest(f"tools: two functions define {key}/{def_name} differently; "
                                                 "tool_choice required needs one meaning for each", param="tools")
                items.append({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                              "required": ["name", "parameters"]})
            array = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items},
                     **shared}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    # -- whole responses ---------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished completion's text."""
        if self.mode == "named":  # the grammar forces the arguments: text that is no JSON was cut by max_tokens,
            return None, [_call(self.named, text)] if text else []  # and streaming sent it as arguments too
        if self.mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "none":
            return text, []
        return self._state().whole_hermes(text)

    def final_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chat choice dict (``message``, ``finish_reason``) with its text parsed into calls."""
        content, calls = self.parse(choice["message"]["content"] or "")
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = self.finish_reason(-1, choice["finish_reason"], called=True)
        return choice

    # -- streaming ---------------------------------------------------------------------------------
    def delta(self, index: int, new_text: str, finished: bool) -> dict[str, Any] | None:
        """The chat delta for choice ``index`` given its newly generated text; None = nothing to send."""
        state = self._streams.setdefault(index, self._state())
        state.text += new_text
        if self.mode == "none":
            return {"content": new_text} if new_text else None
        if self.mode == "named":
            return state.named_delta(self.named, finished)
        if self.mode == "required":
            return state.required_delta(finished)
        return state.hermes_delta(finished)

    def _state(self) -> _StreamState:
        return _StreamState(names=frozenset(self.schemas), parallel=self.parallel)

    def finish_reason(self, index: int, reason: str | None, *, called: bool | None = None) -> str | None:
        """Choice ``index``'s finish reason: ``tool_calls`` for a stop after a call (``called``; None = the
        streamed choice's calls so far), but ``stop`` for a named function, as OpenAI's API answers."""
        if called is None:
            state = self._streams.get(index)
            called = state is not None and bool(state.num_calls)
        return "tool_calls" if reason == "stop" and called and self.mode != "named" else reason


@dataclass
class _StreamState:
    """One choice's parse. Auto mode (Hermes blocks): a block is a call when it is JSON naming an offered function
    (``names``), else text; with ``parallel`` false, blocks after the first call are dropped. Content is the text
    outside calls; once a call is made, trailing whitespace is not content. Streamed, whitespace is held back
    until text follows, so the streamed content joined equals the whole response's."""

    text: str = ""
    pos: int = 0
    in_call: bool = False
    num_calls: int = 0
    call_id: str | None = None
    names: frozenset[str] = frozenset()
    parallel: bool = True
    held: str = ""  # trailing whitespace of the content so far, not sent yet

    def whole_hermes(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a whole response's text, as the joined stream of :meth:`hermes_delta` gives."""
        self.text = text
        delta = self.hermes_delta(finished=True) or {}
        calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls", [])]
        if not calls:
            return text, []
        return delta.get("content") or None, calls

    def named_delta(self, name: str, finished: bool) -> dict[str, Any] | None:
        piece = self.text[self.pos:]
        if not piece:
            return None
        self.pos = len(self.text)
        if self.call_id is None:
            self.call_id = _call_id()
            self.num_calls = 1
            return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                    "function": {"name": name, "arguments": piece}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}

    def required_delta(self, finished: bool) -> dict[str, Any] | None:
        if not finished:
            return None
        calls = _required_calls(self.text)
        if not calls:
            return {"content": self.text} if self.text else None
        self.num_calls = len(calls)
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}

    def hermes_delta(self, finished: bool) -> dict[str, Any] | None:
        content, calls = "", []
        while True:
            if not self.in_call:
                start = self.text.find(TOOL_CALL_START, self.pos)
                if start < 0:
                    end = len(self.text) if finished else len(self.text) - _partial_suffix(self.text, TOOL_CALL_START)
                    content += self.text[self.pos:end]
                    self.pos = max(self.pos, end)
                    break
                content += self.text[self.pos:start]
                self.pos, self.in_call = start + len(TOOL_CALL_START), True
            end = self.text.find(TOOL_CALL_END, self.pos)
            if end < 0:
                if finished:  # an unclosed block: give it back as text
                    content += TOOL_CALL_START + self.text[self.pos:]
                    self.pos, self.in_call = len(self.text), False
                break
            body = self.text[self.pos:end]
            call = _hermes_call(body)
            if call is None or call["function"]["name"] not in self.names:  # malformed, or no offered function
                content += TOOL_CALL_START + body + TOOL_CALL_END
            elif self.parallel or not self.num_calls:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            self.pos, self.in_call = end + len(TOOL_CALL_END), False
        content = self.held + content
        if finished:
            self.held = ""
            if self.num_calls:
                content = content.rstrip()
        else:
            sent = content.rstrip()
            content, self.held = sent, content[len(sent):]
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta or None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict[str, Any]]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item]


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


