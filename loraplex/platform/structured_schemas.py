"""Request/response models of structured output and tool calling (OpenAI + vLLM names).

- OpenAI ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}``.
- vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema), ``json_object``,
  ``regex``, ``choice``, ``grammar`` (EBNF, xgrammar's GBNF dialect), plus
  ``disable_any_whitespace`` (accepted for compatibility; JSON is compact either way unless
  ``any_whitespace`` is true). Other vLLM keys (``structural_tag``, ``whitespace_pattern``, ...)
  are refused. vLLM's older top-level ``guided_json``/``guided_regex``/``guided_choice``/
  ``guided_grammar``/``guided_decoding_backend``/``guided_whitespace_pattern`` are refused
  with a 400 pointing at ``structured_outputs``.
- OpenAI ``tools`` (``type: "function"`` only), ``tool_choice`` and ``parallel_tool_calls``;
  assistant ``tool_calls`` and ``tool`` messages in the history.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` request field (set exactly one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    any_whitespace: bool = False


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant message's tool call (request history and responses)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
