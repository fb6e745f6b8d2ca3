"""OpenAI-compatible request and response models (the subset loraplex serves).

Reference: https://platform.openai.com/docs/api-reference/completions and
/chat. ``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``, ``repetition_penalty``,
``stop_token_ids``, ``skip_special_tokens`` and ``prompt_logprobs`` are vLLM extensions. An unknown request field is
refused with a 400 ``Unrecognized request argument supplied: <field>`` (as OpenAI's API
answers), never ignored; fields loraplex knows but does not serve (``suffix``,
``logit_bias``, ``best_of`` > ``n``, vLLM's ``guided_*``) are refused with a 400 naming the
field. In ``messages``, OpenAI's response-only fields (``refusal``, ``audio``,
``function_call``, ``annotations``) are accepted when empty, so a previous reply's
``message.model_dump()`` can be sent back. Structured output (``response_format``,
``structured_outputs``) and tool calling (``tools``, ``tool_choice``): see
:mod:`loraplex.platform.structured_schemas`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from loraplex.platform.structured_schemas import (
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolDefinition,
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    # strict: a JSON value of the wrong type is refused ("5" for an integer, true for a token id), as OpenAI's API
    # answers, not converted; an int is still taken for a float
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for an optional field whose default is not ``null`` (``n``, ``stream``, ``echo``, chat's
        ``logprobs``, ``ignore_eos``, ``min_tokens``: nullable in OpenAI's spec, or sent by clients that send every
        field) means its default, as if the field were absent."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls._NON_NULL_DEFAULTS}
        return data

    model: str = Field(..., min_length=1, description="The base model's id or the name of one of your adapters.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 disables.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extension: drop tokens whose probability "
                                "is below min_p times the most likely token's; 0 disables.")
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = Field(True, description="vLLM extension: false keeps special tokens in the text.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM extension: top log-probabilities "
                                        "per prompt token (plus the prompt token itself).")
    # structured output (loraplex.platform.services.structured)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    _NON_NULL_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Each request model's fields whose default is a value and whose type does not admit ``None``."""
        super().__pydantic_init_subclass__(**kwargs)
        cls._NON_NULL_DEFAULTS = frozenset(
            name for name, f in cls.model_fields.items()
            if not f.is_required() and f.default is not None and type(None) not in get_args(f.annotation))


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of
    token ids, or a list of token-id lists (one completion set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20, description="Top log-probabilities per token.")
    echo: bool = Field(False, description="Return the prompt before the completion (text and logprobs).")
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


# Fields of OpenAI's response message that clients send back in the history: accepted when empty.
_RESPONSE_ONLY_MESSAGE_FIELDS = frozenset({"refusal", "audio", "function_call", "annotations"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _refuse_unknown_fields(self) -> "ChatMessage":
        for field, value in (self.model_extra or {}).items():
            if field not in _RESPONSE_ONLY_MESSAGE_FIELDS or value not in (None, [], "", {}):
                raise PydanticCustomError("extra_forbidden", "Extra inputs are not permitted",
                                          {"field": field})
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; the prompt is the tokenizer's chat template applied to ``messages``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None  # OpenAI's retired function calling: refused (use tools)
    function_call: Any = None


# -- responses -------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# Why a choice ended (OpenAI's values that loraplex produces).
FinishReason = Literal["stop", "length", "tool_calls"]


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry: one candidate token at a prompt position."""

    logprob: float
    rank: int | None = Field(None, description="1 = most likely; None for a prompt token outside the top k.")
    decoded_token: str


# prompt_logprobs[i]: None for the first prompt token, else token id (as a string) -> entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """Legacy logprobs: ``"".join(tokens)`` is the choice's text and ``text_offset[i]`` the
    character where ``tokens[i]`` starts. With ``echo`` the first entry (the first prompt
    token) has ``None`` logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM extension (``prompt_logprobs``).")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(Completion):
    """One server-sent event of a streamed completion (the same object as the response, as OpenAI sends it)."""


class TopLogprob(BaseModel):
    """``bytes``: the token's own UTF-8 bytes (part of a character when the tokenizer splits
    one); joining the chosen tokens' bytes gives exactly the choice's text."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM extension (``prompt_logprobs``).")


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM extension; in the first chunk.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

