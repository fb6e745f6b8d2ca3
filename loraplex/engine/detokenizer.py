"""Incremental detokenization and stop handling for one sequence.

How the engine uses it (one :class:`SequenceTextState` per sequence, i.e. per
completion of a request)::

    state = SequenceTextState(tokenizer, prompt_token_ids, params,
                              eos_token_ids={tokenizer.eos_token_id},
                              max_tokens=effective_max_tokens)
    # every step, after the sampler picked token_id for this sequence:
    state.update(token_id)
    completion.text = state.stream_text         # cumulative, safe to show
    completion.finish_reason = state.finish_reason   # None, "stop" or "length"
    completion.stop_reason = state.stop_reason       # stop string, stop token id or None
    if state.finished: free the sequence (the token that finished it is
                       still appended to token_ids; its text is not)

``stream_text`` only grows, is always a prefix of the final ``text`` and
equals it once finished, so a streaming server can send
``stream_text[len(sent):]``.

Pieces:

- :class:`IncrementalDetokenizer`: the prefix/read-offset scheme of TGI and
  vLLM (``detokenize_incrementally``). It decodes the window
  ``ids[prefix_offset:]`` and compares it with ``ids[prefix_offset:read_offset]``;
  the difference is new text, unless the window's text ends with U+FFFD (a
  character whose UTF-8 bytes span tokens is incomplete), in which case
  nothing is emitted until a later token completes it. For byte-level BPE
  tokenizers the joined pieces equal ``tokenizer.decode(output_ids)``.
- :class:`StopChecker`: EOS / stop token ids / stop strings / max_tokens, and
  how much text to hold back from streaming so that a stop string split across
  tokens is never shown.

Stop rules (vLLM semantics):

- Nothing stops the sequence before ``min_tokens`` tokens are generated except
  the length limit (the sampler also masks EOS and stop tokens until then).
- EOS (unless ``ignore_eos``) -> ``finish_reason="stop"``, ``stop_reason=None``;
  a ``stop_token_ids`` token -> ``"stop"``, ``stop_reason=<token id>``. The
  stopping token's text is not added.
- Stop strings: checked on each new piece of text plus the ``len(stop) - 1``
  characters before it. Among the matches found at that step the one starting
  earliest wins (ties: first in ``params.stop``); the text is cut where it
  starts (the stop string is not included) and ``stop_reason`` is the string.
  A stop string found at the same step as a stop token/EOS/length wins.
- ``max_tokens`` generated tokens -> ``"length"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from loraplex.engine.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token, so that tokenizers
# whose decoding depends on the left context (SentencePiece leading spaces)
# produce the same text as in the middle of a sequence (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"

FinishReason = Literal["stop", "length"]


class DecodingTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into complete text pieces.

    ``tokenizer``: a Hugging Face tokenizer. ``prompt_token_ids``: the prompt
    (its last :data:`PROMPT_CONTEXT_TOKENS` ids are used as decoding context,
    unless their text ends in an incomplete character). ``skip_special_tokens``
    as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer: DecodingTokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if _REPLACEMENT_CHAR in self._decode(context):
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []  # joined on demand: += on an attribute copies the whole text each time
        # The same scheme in Rust: ``tokenizers.decoders.DecodeStream`` keeps the window and the prefix's
        # text between calls (one decode per token instead of two, no Python slicing; ~3x faster per
        # token). It emits exactly when and what the Python scheme below does, so the offsets advance
        # on its emits and :meth:`flush` stays in Python. It raises when a window's text does not start
        # with its prefix's (a decoder that rewrites earlier text); the Python scheme then takes over.
        self._stream = _decode_stream(tokenizer, context, skip_special_tokens) if self._backend_decode else None

    @property
    def text(self) -> str:
        """All text emitted so far (the joined return values)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, new_token_ids: list[int]) -> str:
        """Add generated ids; return the newly complete text ("" while a character is incomplete)."""
        self._ids.extend(new_token_ids)
        if self._stream is not None:
            stream, backend = self._stream
            try:
                piece = stream.step(backend, new_token_ids[0] if len(new_token_ids) == 1 else new_token_ids)
            except Exception:  # tokenizers' DecodeStreamError (InvalidPrefix): see __init__
                self._stream = None
            else:
                return "" if piece is None else self._emit(piece)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return text held back (e.g. invalid UTF-8 ending in U+FFFD); call when the sequence ends."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _decode_stream(tokenizer, context: list[int], skip_special_tokens: bool):
    """``(DecodeStream primed with context, the Rust tokenizer)``, or None where this ``tokenizers``
    has no ``DecodeStream(ids=...)`` (before 0.22)."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens), tokenizer.backend_tokenizer
    except (ImportError, TypeError):
        return None


def _backend_decode(tokenizer: DecodingTokenizer):
    """The Rust ``tokenizers`` decode behind a Hugging Face fast tokenizer, when
    ``tokenizer.decode`` returns exactly its result (class methods not
    overridden, no ``clean_up_tokenization_spaces``); else None. Skips the
    Python wrapper, about 5x faster for the short windows decoded per token."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode or tokenizer.clean_up_tokenization_spaces):
        return None
    return tokenizer.backend_tokenizer.decode


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence finished: ``finish_reason`` and ``stop_reason``
    (stop string, stop token id, or None for EOS and length)."""

    finish_reason: FinishReason
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string found in the text: it starts at character ``index``."""

    index: int
    stop: str


class StopChecker:
    """Stop conditions of one sequence (see the module docstring for the rules).

    Raises ``ValueError`` naming the argument for an empty stop string,
    ``max_tokens < 1`` or ``min_tokens < 0``.
    """

    def __init__(
        self,
        stop: list[str],
        stop_token_ids: list[int],
        eos_token_ids: set[int],
        ignore_eos: bool,
        max_tokens: int | None,
        min_tokens: int = 0,
    ):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"StopChecker.stop={stop!r}: must be non-empty strings")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"StopChecker.max_tokens={max_tokens!r}: must be >= 1 or None")
        if min_tokens < 0:
            raise ValueError(f"StopChecker.min_tokens={min_tokens!r}: must be >= 0")
        self.stop = list(stop)
        self.stop_token_ids = set(stop_token_ids)
        self.eos_token_ids = set() if ignore_eos else set(eos_token_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens

    def check_token(self, token_id: int, num_output_tokens: int) -> StopDecision | None:
        """EOS or stop-token decision for the newest token.

        ``num_output_tokens`` counts generated tokens including ``token_id``.
        """
        if num_output_tokens < self.min_tokens:
            return None
        if token_id in self.eos_token_ids:
            return StopDecision("stop", None)
        if token_id in self.stop_token_ids:
            return StopDecision("stop", token_id)
        return None

    def find_stop_string(self, text: str, num_new_chars: int, num_output_tokens: int) -> StopStringMatch | None:
        """Earliest stop string that ends inside the last ``num_new_chars`` characters of ``text``.

        Only the new tail plus ``len(stop) - 1`` earlier characters are
        searched. Returns None before ``min_tokens`` tokens are generated.
        """
        if num_output_tokens < self.min_tokens or num_new_chars <= 0:
            return None
        best: StopStringMatch | None = None
        for stop in self.stop:
            index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if index >= 0 and (best is None or index < best.index):
                best = StopStringMatch(index, stop)
        return best

    def reached_length(self, num_output_tokens: int) -> bool:
        """True once ``max_tokens`` tokens are generated."""
        return self.max_tokens is not None and num_output_tokens >= self.max_tokens

    def hold_back_chars(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        Streaming must not show these characters yet: a later token could
        complete a stop string that starts there.
        """
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held


class SequenceTextState:
    """Text, streaming and finish state of one sequence.

    ``tokenizer``/``prompt_token_ids``: see :class:`IncrementalDetokenizer`.
    ``params``: the request's :class:`SamplingParams`. ``eos_token_ids``: the
    model's EOS ids. ``max_tokens``: the effective limit on generated tokens
    (the engine passes ``min(params.max_tokens, max_model_len - prompt_len)``);
    defaults to ``params.max_tokens`` (``None`` = no limit here).
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_tokens: int | None = None,
        defer_text: bool = False,
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        # Without stop strings nothing depends on the text before the end: a
        # final-only request decodes once, when it finishes.
        self._defer = defer_text and not params.stop and params.logprobs is None
        self._pending: list[int] = []
        self._checker = StopChecker(
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            eos_token_ids=set(eos_token_ids),
            ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens if max_tokens is None else max_tokens,
            min_tokens=params.min_tokens,
        )
        self._text = ""
        self._num_output_tokens = 0
        self._decision: StopDecision | None = None
        self._text_ends: list[int] | None = [] if params.logprobs is not None else None

    def _update_deferred(self, token_id: int, token_stop: StopDecision | None, length_stop: bool) -> None:
        if token_stop is None:
            self._pending.append(token_id)
        if token_stop is None and not length_stop:
            return
        self._text += self._detokenizer.append(self._pending) + self._detokenizer.flush()
        self._pending = []
        self._decision = token_stop or StopDecision("length", None)

    @property
    def text(self) -> str:
        """All text so far, cut before the stop string once one matched."""
        return self._text

    @property
    def stream_text(self) -> str:
        """The prefix of :attr:`text` that can be shown now (all of it once finished)."""
        if self.finished:
            return self._text
        return self._text[: self.stream_end]

    @property
    def stream_end(self) -> int:
        """``len(stream_text)`` without building it (delta outputs slice ``text`` with it)."""
        if self._decision is not None or not self._checker.stop:
            return len(self._text)
        return len(self._text) - self._checker.hold_back_chars(self._text)

    @property
    def token_text_ends(self) -> list[int] | None:
        """``ends[i]`` = characters of :attr:`text` produced by generated tokens ``0..i``
        (non-decreasing; a token holding only the first bytes of a character adds nothing,
        the token completing it adds the whole character; a stopping token adds nothing).
        Kept only when ``params.logprobs`` is set (else None)."""
        return self._text_ends

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    @property
    def finished(self) -> bool:
        return self._decision is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self._decision is None else self._decision.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return None if self._decision is None else self._decision.stop_reason

    def update(self, token_id: int) -> None:
        """Add one generated token and decide whether the sequence is finished.

        Raises ``RuntimeError`` when called after the sequence finished.
        """
        if self._decision is not None:
            raise RuntimeError(f"SequenceTextState.update(token_id={token_id}): sequence already finished "
                               f"({self._decision.finish_reason})")
        self._num_output_tokens += 1
        count = self._num_output_tokens
        token_stop = self._checker.check_token(token_id, count)
        length_stop = token_stop is None and self._checker.reached_length(count)
        if self._defer:
            self._update_deferred(token_id, token_stop, length_stop)
            return
        new_text = "" if token_stop is not None else self._detokenizer.append([token_id])
        if token_stop is not None or length_stop:
            new_text += self._detokenizer.flush()
        self._text += new_text
        match = self._checker.find_stop_string(self._text, len(new_text), count)
        if match is not None:
            self._text = self._text[: match.index]
            self._decision = StopDecision("stop", match.stop)
        elif token_stop is not None:
            self._decision = token_stop
        elif length_stop:
            self._decision = StopDecision("length", None)
        if self._text_ends is not None:
            self._text_ends.append(len(self._text))
            if match is not None:  # the cut text: earlier tokens end no later than it
                self._text_ends = [min(end, len(self._text)) for end in self._text_ends]


# -- token text and bytes (logprobs) ---------------------------------------------------------------
@dataclass(frozen=True)
class TokenPiece:
    """What one token contributes to a text: ``text`` (the characters it completes; "" for
    a token holding only the first bytes of a character), ``raw`` (its share of the text's
    UTF-8 bytes, split where the tokenizer splits a character) and ``text_offset`` (the
    character index in the text where ``text`` starts)."""

    text: str
    raw: bytes
    text_offset: int


class TokenBytes:
    """Each vocabulary token's own raw bytes, and a display string for it.

    Byte-level BPE (GPT-2 alphabet) and SentencePiece byte fallback (``<0xNN>``, ``▁``) are
    read from the vocabulary; other tokenizers fall back to the UTF-8 of the token decoded
    alone. Added tokens (special or not) are their content's UTF-8.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._table = _raw_token_table(tokenizer)

    def raw(self, token_id: int) -> bytes:
        """The token's bytes; for a token holding part of a character, just that part."""
        if self._table is not None and 0 <= token_id < len(self._table):
            return self._table[token_id]
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def display(self, token_id: int) -> str:
        """The token as text; ``"bytes:\\xe4\\xbd"`` (OpenAI's form) when its bytes are not valid UTF-8."""
        return display_bytes(self.raw(token_id))


def display_bytes(raw: bytes) -> str:
    """``raw`` as text, or ``"bytes:"`` + escaped bytes when it is not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted (char -> byte)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    import json

    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found, stack = set(), [decoder]
    while stack:
        node = stack.pop()
        found.add(node.get("type"))
        stack.extend(node.get("decoders") or [])
    return found


def _raw_token_table(tokenizer) -> list[bytes] | None:
    types = _decoder_types(tokenizer)
    if "ByteLevel" in types:
        alphabet = _gpt2_byte_decoder()

        def convert(token: str) -> bytes | None:
            if all(ch in alphabet for ch in token):
                return bytes(alphabet[ch] for ch in token)
            return None
    elif "ByteFallback" in types or "Metaspace" in types:
        def convert(token: str) -> bytes | None:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode("utf-8")
    else:
        return None
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    size = max(len(tokenizer), *(i + 1 for i in added)) if added else len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    table = []
    for token_id, token in enumerate(tokens):
        raw = None if token_id in added or token is None else convert(token)
        if raw is None:
            raw = (added.get(token_id) or token or "").encode("utf-8")
        table.append(raw)
    return table


class TokenTextSplitter:
    """Each token's share of a text, for a text that may still grow (streaming).

    Semantics: with ``ends[i]`` the text end after token i (see
    :attr:`SequenceTextState.token_text_ends`) and ``raws[i]`` token i's own bytes (see
    :class:`TokenBytes`; b"" for a token whose text is skipped), token i's characters are
    ``text[ends[i-1]:ends[i]]`` and its bytes end at
    ``clamp(bytes_end[i-1] + len(raws[i]), utf8_len(text[:ends[i]]), utf8_len(text[:ends[j]]))``,
    j being the next token that adds characters: joining every piece's ``raw`` gives exactly
    ``text.encode()``, and a character split over tokens is split as the tokenizer splits it.

    :meth:`advance` returns the pieces of tokens not returned before whose span can no longer
    change (all of them once ``finished``). Each call costs O(new tokens + new text).
    """

    def __init__(self) -> None:
        self.num_tokens = 0  # tokens returned so far
        self._chars = 0  # characters covered by them
        self._char_bytes = 0  # UTF-8 length of text[:_chars]
        self._bytes = 0  # bytes given to them (>= _char_bytes inside a split character)

    def advance(self, text: str, ends: list[int], raws: list[bytes], *, finished: bool) -> list[TokenPiece]:
        """New pieces; ``text`` must extend the text of earlier calls. Raises ``ValueError``
        when ``ends`` and ``raws`` differ in length."""
        if len(ends) != len(raws):
            raise ValueError(f"TokenTextSplitter.advance: {len(ends)} ends but {len(raws)} raws")
        pieces: list[TokenPiece] = []
        size = len(text)
        while self.num_tokens < len(ends):
            i = self.num_tokens
            end = ends[i]
            if end > size:
                if not finished:
                    break
                end = size
            low = self._char_bytes + len(text[self._chars:end].encode("utf-8"))
            want = self._bytes + len(raws[i])
            span_end = end
            if want > low:  # the token holds bytes of a character completed later
                following = self._next_end(ends, i, end, size, finished)
                if following is None:
                    break
                span_end = following
            encoded = text[self._chars:span_end].encode("utf-8")
            end_bytes = min(max(want, low), self._char_bytes + len(encoded))
            raw = encoded[self._bytes - self._char_bytes:end_bytes - self._char_bytes]
            chunk = text[self._chars:end]
            pieces.append(TokenPiece(chunk, raw, self._chars))
            self.num_tokens += 1
            self._chars, self._char_bytes, self._bytes = end, low, end_bytes
        return pieces

    @staticmethod
    def _next_end(ends: list[int], i: int, end: int, size: int, finished: bool) -> int | None:
        for j in range(i + 1, len(ends)):
            if ends[j] > end:
                if ends[j] <= size:
                    return ends[j]
                return size if finished else None
        return size if finished else None


def split_text_by_tokens(text: str, ends: list[int], raws: list[bytes]) -> list[TokenPiece]:
    """Every token's piece of a finished ``text`` (see :class:`TokenTextSplitter`)."""
    return TokenTextSplitter().advance(text, ends, raws, finished=True)


def prompt_text_ends(tokenizer: DecodingTokenizer, prompt_token_ids: list[int],
                     skip_special_tokens: bool = True) -> tuple[str, list[int]]:
    """The prompt's text (decoded incrementally, as generated text is) and each token's
    text end in it (see :attr:`SequenceTextState.token_text_ends`)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    ends, length = [], 0
    for token_id in prompt_token_ids:
        length += len(detokenizer.append([token_id]))
        ends.append(length)
    detokenizer.flush()
    text = detokenizer.text
    if ends:
        ends[-1] = len(text)
    return text, ends
