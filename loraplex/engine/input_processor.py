"""The engine's input processing: a prompt (text or token ids) and its ``SamplingParams`` ->
a :class:`ProcessedPrompt`, validated once, here, for every front end (the offline ``LLM``,
the OpenAI server, evaluations), as vLLM v1's ``Processor.process_inputs``.

Each refusal is a typed :class:`InvalidPromptError` carrying its numbers, so a front end
maps the type to its own error (the server: ``platform/services/input_errors.py``, HTTP 400
in OpenAI's format) and never re-checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine cannot run (duplicate id, LoRA disabled, a constraint that does not
    compile, or a bad prompt: :class:`InvalidPromptError`)."""


class InvalidPromptError(InvalidRequestError):
    """The prompt itself is refused; the subclasses say why."""


class EmptyPromptError(InvalidPromptError):
    """The prompt has no tokens (after tokenization)."""

    def __init__(self) -> None:
        super().__init__("The prompt is empty (0 tokens after tokenization).")

    def __reduce__(self):  # pickled to another process (engine process, replicas): rebuilt from its fields
        return type(self), ()


class TokenIdOutOfVocabError(InvalidPromptError):
    """A prompt token id outside ``[0, vocab_size)``."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"Token id {token_id} in the prompt is outside the vocabulary [0, {vocab_size}).")
        self.token_id = token_id
        self.vocab_size = vocab_size

    def __reduce__(self):
        return type(self), (self.token_id, self.vocab_size)


class ContextLengthExceededError(InvalidPromptError):
    """``num_prompt_tokens + max_tokens > max_model_len`` (``max_tokens`` None: the prompt leaves no
    room for one output token, ``num_prompt_tokens >= max_model_len``)."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        wanted = num_prompt_tokens + (max_tokens or 1)
        output = f"{max_tokens} in the completion" if max_tokens else "at least 1 in the completion"
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you "
            f"requested {wanted} tokens ({num_prompt_tokens} in the prompt, {output}). Please reduce the length "
            f"of the prompt{' or the completion' if max_tokens else ''}.")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    def __reduce__(self):
        return type(self), (self.num_prompt_tokens, self.max_tokens, self.max_model_len)


class PromptTooLongError(ContextLengthExceededError):
    """The prompt alone leaves no room for output: ``num_prompt_tokens >= max_model_len``."""


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt the engine accepted. ``text``: the prompt text (None when given as token ids);
    ``token_ids``: its tokens, each in ``[0, vocab_size)``, ``1 <= len < max_model_len``;
    ``max_tokens``: output tokens allowed (``params.max_tokens``, or what fits under ``max_model_len``)."""

    text: str | None
    token_ids: list[int]
    max_tokens: int


class InputProcessor:
    """Tokenizes and validates prompts for one engine (``vocab_size``: rows of the model's
    embedding; ``max_model_len``: tokens of prompt + output of one sequence). Thread-safe: it
    only reads; the server calls it on its own threads before queueing."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: str | list[int] | ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """``prompt`` (text, tokenized with special tokens; or token ids) checked against ``params``.
        A :class:`ProcessedPrompt` (from this processor) is returned as is.

        Raises ``EmptyPromptError``, ``TokenIdOutOfVocabError``, ``PromptTooLongError``,
        ``ContextLengthExceededError``.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            text, token_ids = prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise EmptyPromptError()
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenIdOutOfVocabError(bad[0], self.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), params.max_tokens, self.max_model_len)
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthExceededError(len(token_ids), params.max_tokens, self.max_model_len)
        return ProcessedPrompt(text, token_ids, room if params.max_tokens is None else params.max_tokens)
