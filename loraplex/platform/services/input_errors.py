"""The engine's input errors as the API's: the one place that maps them to HTTP 400 bodies in
OpenAI's format. The engine validates prompts once (``engine/input_processor.py``); the server
calls it before queueing and maps what it raises here, never checking again."""

from __future__ import annotations

from loraplex.engine.input_processor import (
    ContextLengthExceededError,
    EmptyPromptError,
    InvalidRequestError,
    TokenIdOutOfVocabError,
)
from loraplex.platform.errors import ContextLengthExceeded, InvalidRequest


def request_error(exc: InvalidRequestError, *, prompt_param: str) -> InvalidRequest:
    """400 for the engine's refusal ``exc``, its message kept (it carries no server paths).
    ``prompt_param``: the request field the prompt came from (``"prompt"``, ``"messages"``, ``"file"``).

    - ``ContextLengthExceededError`` / ``PromptTooLongError``: ``context_length_exceeded``;
    - ``EmptyPromptError``: ``empty_prompt``; ``TokenIdOutOfVocabError``: ``invalid_token_id``;
    - any other ``InvalidRequestError`` (duplicate id, LoRA disabled, constraint): ``invalid_value``, no param.
    """
    if isinstance(exc, ContextLengthExceededError):
        return ContextLengthExceeded(str(exc), param=prompt_param)
    if isinstance(exc, EmptyPromptError):
        return InvalidRequest(str(exc), param=prompt_param, code="empty_prompt")
    if isinstance(exc, TokenIdOutOfVocabError):
        return InvalidRequest(str(exc), param=prompt_param, code="invalid_token_id")
    return InvalidRequest(str(exc))
