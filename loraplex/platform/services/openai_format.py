"""OpenAI response objects (typed, :mod:`loraplex.platform.openai_schemas`) from engine outputs:
choices, stream chunks, usage chunks and logprobs, for completions (``text_completion``) and
chat (``chat.completion[.chunk]``).

Logprobs agree with the text they come with, whatever the tokenizer does to characters:

- each entry's ``token`` is the text its token completes (``""`` for a token holding only the
  first bytes of a character; the token completing it carries the whole character), so
  ``"".join(tokens)`` is the text and ``text_offset[i]`` is where ``tokens[i]`` starts;
- each entry's ``bytes`` are the token's own bytes (part of a character where the tokenizer
  splits one), so joining them gives exactly the text's UTF-8;
- a ``top_logprobs`` alternative is shown as its own text, or ``"bytes:\\xe4\\xbd"`` (OpenAI's
  form) when its bytes are not valid UTF-8; the chosen token appears as in its entry;
- a streamed choice sends each token once, with the text it completes, in the same chunk, so
  the streamed fields joined equal the non-streamed ones; ``finish_reason`` comes exactly once.

References: https://platform.openai.com/docs/api-reference/completions/object and
/chat/object, /chat/streaming; vLLM's ``echo`` and ``prompt_logprobs``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.detokenizer import TokenBytes, TokenPiece, TokenTextSplitter, prompt_text_ends
from loraplex.engine.outputs import CompletionOutput, RequestOutput, TopLogprobs
from loraplex.platform.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from loraplex.platform.services.serving import PreparedRequest

# OpenAI's value for a chosen token whose logprob is unknown.
_UNKNOWN_LOGPROB = -9999.0


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's finish reason: None while running (and for an aborted request)."""
    return None if completion.finish_reason in (None, "abort", "error") else completion.finish_reason


class TokenText:
    """A tokenizer's token bytes and special ids, built once per tokenizer (:func:`token_text`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bytes = TokenBytes(tokenizer)
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    def raws(self, token_ids: list[int], skip_special_tokens: bool) -> list[bytes]:
        """Each token's bytes as they appear in decoded text (b"" for skipped special tokens)."""
        raw, special = self.bytes.raw, self.special_ids
        return [b"" if skip_special_tokens and t in special else raw(t) for t in token_ids]


_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_text(tokenizer) -> TokenText:
    """The :class:`TokenText` of ``tokenizer`` (cached while the tokenizer lives)."""
    found = _TOKEN_TEXT.get(tokenizer)
    if found is None:
        found = _TOKEN_TEXT[tokenizer] = TokenText(tokenizer)
    return found


@dataclass(frozen=True)
class TokenEntry:
    """One position's logprobs: ``top`` = (token text, bytes, logprob) most likely first
    (None for the first prompt token, which has no logprob)."""

    piece: TokenPiece
    logprob: float | None
    top: list[tuple[str, bytes, float]] | None


@dataclass
class ChoiceProgress:
    """What of one choice was sent so far (streaming); a fresh one builds a whole response."""

    splitter: TokenTextSplitter = field(default_factory=TokenTextSplitter)
    raws: list[bytes] = field(default_factory=list)  # bytes of the tokens seen so far (grows by the new ones)
    sent_chars: int = 0
    started: bool = False
    finish_sent: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    """New content of one choice: ``text`` and its logprob ``entries`` (None: not asked),
    ``finish_reason`` when it ended now, ``prompt_logprobs`` with the first delta."""

    index: int
    text: str
    entries: list[TokenEntry] | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


class OpenAIFormatter:
    """Builds the typed OpenAI objects of one prepared request."""

    def __init__(self, prep: PreparedRequest, tokens: TokenText) -> None:
        self.prep = prep
        self.tokens = tokens
        self._prompt_cache: dict[int, tuple[str, list[TokenPiece]]] = {}

    # -- deltas ----------------------------------------------------------------------------------
    def delta(self, index: int, output: RequestOutput, completion: CompletionOutput, progress: ChoiceProgress,
              *, prompt_index: int) -> ChoiceDelta | None:
        """The part of ``completion`` not sent yet (None when there is nothing to send)."""
        prep = self.prep
        if progress.finish_sent:
            return None
        finished = completion.finished
        if not progress.started and prep.needs_prompt_logprobs and not _prompt_done(output):
            return None  # chunked prefill: echo and prompt logprobs go out complete
        text, entries = "", None
        if not progress.started and prep.echo:
            text, entries = self._echo(prompt_index, output)
        if prep.top_logprobs is not None:
            pieces = self._pieces(completion, progress, finished)
            base = len(self._prompt(prompt_index)[0]) if prep.echo else 0
            new_entries = self._completion_entries(completion, pieces, progress.splitter.num_tokens - len(pieces),
                                                   base)
            entries = (entries or []) + new_entries
            upto = pieces[-1].text_offset + len(pieces[-1].text) if pieces else progress.sent_chars
            text += completion.text[progress.sent_chars:max(upto, progress.sent_chars)]
            progress.sent_chars = max(upto, progress.sent_chars)
        else:
            text += completion.text[progress.sent_chars:]
            progress.sent_chars = len(completion.text)
        reason = finish_reason(completion)
        prompt_lps = self._prompt_logprobs(output) if not progress.started and prep.prompt_logprobs is not None \
            else None
        progress.started = True
        progress.finish_sent = finished
        if not text and not entries and reason is None and prompt_lps is None:
            return None
        return ChoiceDelta(index, text, entries, reason, prompt_lps)

    def _pieces(self, completion: CompletionOutput, progress: ChoiceProgress, finished: bool) -> list[TokenPiece]:
        ends = completion.token_text_ends or []
        have = len(progress.raws)
        if len(ends) > have:  # only the new tokens' bytes
            progress.raws += self.tokens.raws(completion.token_ids[have:len(ends)], self.prep.params.skip_special_tokens)
        return progress.splitter.advance(completion.text, ends, progress.raws, finished=finished)

    def _completion_entries(self, completion: CompletionOutput, pieces: list[TokenPiece], start: int,
                            base: int) -> list[TokenEntry]:
        """Entries of generated tokens ``start..``; text offsets shifted by ``base`` (echoed prompt)."""
        entries = []
        for offset, piece in enumerate(pieces):
            token_id = completion.token_ids[start + offset]
            top = completion.logprobs[start + offset]
            piece = TokenPiece(piece.text, piece.raw, piece.text_offset + base)
            entries.append(TokenEntry(piece, top.get(token_id, _UNKNOWN_LOGPROB),
                                      self._top(top, token_id, piece)))
        return entries

    def _top(self, top: TopLogprobs, token_id: int, piece: TokenPiece) -> list[tuple[str, bytes, float]]:
        k = self.prep.top_logprobs or 0
        best = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:k]
        display, raw = self.tokens.bytes.display, self.tokens.bytes.raw
        return [(piece.text, piece.raw, lp) if t == token_id else (display(t), raw(t), lp) for t, lp in best]

    def _prompt(self, prompt_index: int) -> tuple[str, list[TokenPiece]]:
        if prompt_index not in self._prompt_cache:
            ids = self.prep.prompts[prompt_index].token_ids
            text, ends = prompt_text_ends(self.tokens.tokenizer, ids, skip_special_tokens=False)
            pieces = TokenTextSplitter().advance(text, ends, self.tokens.raws(ids, False), finished=True)
            self._prompt_cache[prompt_index] = text, pieces
        return self._prompt_cache[prompt_index]

    def _echo(self, prompt_index: int, output: RequestOutput) -> tuple[str, list[TokenEntry] | None]:
        text, pieces = self._prompt(prompt_index)
        if self.prep.top_logprobs is None:
            return text, None
        ids = self.prep.prompts[prompt_index].token_ids
        plps = output.prompt_logprobs or [None] * len(ids)
        entries = []
        for token_id, piece, top in zip(ids, pieces, plps):
            if top is None:
                entries.append(TokenEntry(piece, None, None))
            else:
                entries.append(TokenEntry(piece, top.get(token_id, _UNKNOWN_LOGPROB), self._top(top, token_id, piece)))
        return text, entries

    def _prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: the top ``prompt_logprobs`` entries plus the prompt token."""
        k = self.prep.prompt_logprobs or 0
        display = self.tokens.bytes.display
        result: PromptLogprobs = []
        for position, top in enumerate(output.prompt_logprobs or []):
            if top is None:
                result.append(None)
                continue
            ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)
            actual = output.prompt_token_ids[position]
            entry = {str(t): PromptLogprob(logprob=lp, rank=rank, decoded_token=display(t))
                     for rank, (t, lp) in enumerate(ranked[:k], start=1)}
            if str(actual) not in entry:
                rank = next((r for r, (t, _) in enumerate(ranked, start=1) if t == actual and r <= k), None)
                entry[str(actual)] = PromptLogprob(logprob=top.get(actual, _UNKNOWN_LOGPROB), rank=rank,
                                                   decoded_token=display(actual))
            result.append(entry)
        return result

    # -- typed objects ---------------------------------------------------------------------------
    @staticmethod
    def completion_logprobs(entries: list[TokenEntry] | None) -> CompletionLogprobs | None:
        if entries is None:
            return None
        return CompletionLogprobs(
            tokens=[e.piece.text for e in entries], token_logprobs=[e.logprob for e in entries],
            top_logprobs=[None if e.top is None else {t: lp for t, _, lp in e.top} for e in entries],
            text_offset=[e.piece.text_offset for e in entries])

    @staticmethod
    def chat_logprobs(entries: list[TokenEntry] | None) -> ChoiceLogprobs | None:
        if entries is None:
            return None
        return ChoiceLogprobs(content=[
            TokenLogprob(token=e.piece.text, logprob=e.logprob, bytes=list(e.piece.raw),
                         top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in e.top or []])
            for e in entries])

    def chunk(self, delta: ChoiceDelta) -> CompletionChunk | ChatCompletionChunk:
        """One stream chunk with one choice's delta."""
        prep = self.prep
        if prep.kind == "completion":
            choice = CompletionChoice(index=delta.index, text=delta.text,
                                      logprobs=self.completion_logprobs(delta.entries),
                                      finish_reason=delta.finish_reason, prompt_logprobs=delta.prompt_logprobs)
            return CompletionChunk(id=prep.id, created=prep.created, model=prep.model, choices=[choice])
        choice = ChatChunkChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                                 logprobs=self.chat_logprobs(delta.entries), finish_reason=delta.finish_reason)
        return ChatCompletionChunk(id=prep.id, created=prep.created, model=prep.model, choices=[choice],
                                   prompt_logprobs=delta.prompt_logprobs)

    def role_chunk(self, index: int) -> ChatCompletionChunk:
        prep = self.prep
        return ChatCompletionChunk(id=prep.id, created=prep.created, model=prep.model, choices=[
            ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def usage_chunk(self, usage: Usage) -> CompletionChunk | ChatCompletionChunk:
        prep = self.prep
        cls = CompletionChunk if prep.kind == "completion" else ChatCompletionChunk
        return cls(id=prep.id, created=prep.created, model=prep.model, choices=[], usage=usage)

    def response(self, deltas: list[ChoiceDelta], usage: Usage) -> Completion | ChatCompletion:
        """The non-streamed response from each choice's whole delta (fresh progress, finished)."""
        prep = self.prep
        if prep.kind == "completion":
            return Completion(id=prep.id, created=prep.created, model=prep.model, usage=usage, choices=[
                CompletionChoice(index=d.index, text=d.text, logprobs=self.completion_logprobs(d.entries),
                                 finish_reason=d.finish_reason, prompt_logprobs=d.prompt_logprobs)
                for d in deltas])
        return ChatCompletion(
            id=prep.id, created=prep.created, model=prep.model, usage=usage,
            prompt_logprobs=deltas[0].prompt_logprobs if deltas else None,
            choices=[ChatChoice(index=d.index, message=AssistantMessage(content=d.text),
                                logprobs=self.chat_logprobs(d.entries), finish_reason=d.finish_reason)
                     for d in deltas])


def _prompt_done(output: RequestOutput) -> bool:
    return output.prompt_logprobs is None or len(output.prompt_logprobs) >= len(output.prompt_token_ids)
