"""Incremental detokenizer and stop handling tests.

The reference is the tokenizer itself: ``tokenizer.decode(all_output_ids)``
for the streamed text, and a per-prefix decode for the stop-string decision.
The tokenizer is a tiny byte-level BPE (GPT-2 style) trained here on a few
sentences, so characters it never saw are split into one token per UTF-8 byte.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.detokenizer import (
    IncrementalDetokenizer,
    SequenceTextState,
    StopChecker,
)
from loraplex.engine.sampling_params import SamplingParams

EOS = "<|endoftext|>"
TRAINING_TEXT = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "## Heading\n### Sub heading\n# Title ## ## ##",
    "你好世界 你好 world",
    "Stop here. END of text. The end.",
] * 20
# Characters absent from TRAINING_TEXT: their UTF-8 bytes become separate tokens.
TRICKY_TEXTS = [
    "鱼 and 🐟 swim",
    "你好, 世界! 🚀🚀 done",
    "emoji zwj 👨\u200d👩\u200d👧 family, flag 🇫🇷, skin 👍🏽",
    "combining e\u0301 and precomposed é, café",
    "  leading spaces\n\ttabs\n\nnewlines  ",
    "😀",
    "mixed 漢字かなカナ한글 ۝ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
STREAM_ALPHABET = list("ab #\n.你好鱼😀é\u0301👨\u200d🇫🇷")


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)


def _stream(tokenizer, output_ids, prompt_ids=(), skip_special_tokens=True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens)
    pieces = [detokenizer.append([token_id]) for token_id in output_ids]
    pieces.append(detokenizer.flush())
    assert detokenizer.text == "".join(pieces)
    return pieces


def _visible_prefixes(tokenizer, ids: list[int]) -> list[str]:
    """Reference text visible after each token: decode(ids[:k]), or the previous one
    while the decode ends in an incomplete character (U+FFFD)."""
    visible, texts = "", []
    for k in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:k], skip_special_tokens=True)
        visible = visible if decoded.endswith("\ufffd") else decoded
        texts.append(visible)
    return texts


# --- incremental detokenizer -----------------------------------------------------


def test_unseen_characters_span_several_tokens():
    tok = _tiny_tokenizer()
    for char in ("鱼", "🐟", "😀"):
        ids = tok.encode(char)
        assert len(ids) == len(char.encode("utf-8")) > 1
        assert all(tok.decode([i]) == "\ufffd" for i in ids)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_streamed_pieces_join_to_full_decode(text):
    tok = _tiny_tokenizer()
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces[:-1]) == any(len(c.encode()) > 1 for c in text)


def test_multibyte_character_is_emitted_once_complete():
    tok = _tiny_tokenizer()
    ids = tok.encode("a😀b")
    pieces = _stream(tok, ids)
    assert pieces[:-1] == ["a", "", "", "", "😀", "b"]


def test_prompt_context_does_not_change_output_text():
    tok = _tiny_tokenizer()
    prompt = tok.encode("Hello 你好 world")
    output = tok.encode(" 🐟鱼 fish")
    assert "".join(_stream(tok, output, prompt)) == tok.decode(output)
    # A prompt ending mid-character is not used as context.
    broken_prompt = tok.encode("x 鱼")[:-1]
    assert "".join(_stream(tok, output, broken_prompt)) == tok.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip):
    tok = _tiny_tokenizer()
    ids = tok.encode("a 鱼") + [tok.eos_token_id] + tok.encode("b")
    joined = "".join(_stream(tok, ids, skip_special_tokens=skip))
    assert joined == tok.decode(ids, skip_special_tokens=skip)
    assert (EOS in joined) is (not skip)


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_streaming_any_text_matches_decode(text):
    tok = _tiny_tokenizer()
    ids = tok.encode(text)
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=16))
def test_streaming_arbitrary_token_ids_matches_decode(ids):
    """Any id sequence, including invalid UTF-8 (kept as U+FFFD, flushed at the end)."""
    tok = _tiny_tokenizer()
    assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True)


def _pieces_both_ways(tok, prompt, chunks, skip) -> tuple[list[str], list[str], IncrementalDetokenizer]:
    """The pieces of the Rust ``DecodeStream`` path and of the Python scheme (stream switched off)."""
    fast = IncrementalDetokenizer(tok, list(prompt), skip)
    slow = IncrementalDetokenizer(tok, list(prompt), skip)
    assert fast._stream is not None  # a fast tokenizer takes the DecodeStream path
    slow._stream = None
    pieces = [[d.append(list(chunk)) for chunk in chunks] + [d.flush()] for d in (fast, slow)]
    return pieces[0], pieces[1], fast


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=6), st.lists(st.lists(st.integers(0, 399), min_size=1, max_size=3),
                                                           min_size=1, max_size=12), st.booleans())
def test_decode_stream_path_emits_what_the_python_scheme_emits(prompt, chunks, skip):
    """Token by token (and for several ids at once), with any prompt context, invalid UTF-8 and the
    special token: the same pieces at the same calls, and the same held-back text at the end."""
    tok = _tiny_tokenizer()
    fast, slow, detokenizer = _pieces_both_ways(tok, prompt, chunks, skip)
    assert fast == slow
    assert detokenizer.text == "".join(fast)


def test_python_scheme_takes_over_when_the_decode_stream_raises():
    """tokenizers raises InvalidPrefix when a window's text does not start with its prefix's: the
    detokenizer goes on in Python from the offsets of the stream's emits, losing nothing."""
    tok = _tiny_tokenizer()
    ids = tok.encode("ab 鱼 and 😀 cd")

    class RaisesOnThirdStep:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def step(self, backend, token):
            self.calls += 1
            if self.calls == 3:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, token)

    detokenizer = IncrementalDetokenizer(tok, [], True)
    stream, backend = detokenizer._stream
    detokenizer._stream = (RaisesOnThirdStep(stream), backend)
    pieces = [detokenizer.append([i]) for i in ids] + [detokenizer.flush()]
    assert detokenizer._stream is None
    assert pieces == _stream(tok, ids) and "".join(pieces) == tok.decode(ids)


@pytest.mark.smollm2
def test_decode_stream_path_matches_python_scheme_on_smollm2(smollm2_dir):
    tok = _smollm2_tokenizer(str(smollm2_dir))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("".join(TRICKY_TEXTS)) + [tok.eos_token_id] + tok.encode(" 🚀 end")
    for skip in (True, False):
        fast, slow, _ = _pieces_both_ways(tok, prompt, [[i] for i in ids], skip)
        assert fast == slow and "".join(fast) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.smollm2
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_smollm2_streaming_matches_decode(text, smollm2_dir):
    """The demo model's tokenizer (skipped by the shared fixture when not prepared)."""
    tok = _smollm2_tokenizer(str(smollm2_dir))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    pieces = _stream(tok, ids, prompt)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    if "🚀" in text or "🐟" in text:
        assert any(tok.decode([i]) == "\ufffd" for i in ids)  # really split inside a character
        assert "" in pieces[:-1]


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --- stop handling ----------------------------------------------------------------


def _run(ids: list[int], tokenizer=None, **params) -> tuple[SequenceTextState, list[str], int]:
    """Feed ids until finished; returns the state, the streamed deltas and tokens consumed."""
    tok = tokenizer or _tiny_tokenizer()
    state = SequenceTextState(tok, [], SamplingParams(**{"max_tokens": None, **params}), {tok.eos_token_id})
    deltas, used = [], 0
    for token_id in ids:
        state.update(token_id)
        used += 1
        deltas.append(state.stream_text[len("".join(deltas)) :])
        assert state.text.startswith("".join(deltas))
        if state.finished:
            break
    return state, deltas, used


def _ids(*parts: str) -> list[int]:
    tok = _tiny_tokenizer()
    return [i for part in parts for i in tok.encode(part)]


def test_stop_string_split_across_tokens():
    tok = _tiny_tokenizer()
    hash1, hash2 = tok.convert_tokens_to_ids(["#", "##"])
    assert None not in (hash1, hash2) and tok.decode([hash2]) == "##"
    ids = _ids("Hello") + [hash1, hash2] + _ids(" more")
    state, deltas, used = _run(ids, stop=["###"])
    assert (state.text, state.finish_reason, state.stop_reason) == ("Hello", "stop", "###")
    assert used == len(_ids("Hello")) + 2
    assert "".join(deltas) == "Hello" and not any("#" in d for d in deltas)


def test_stream_holds_back_possible_stop_prefix_then_releases_it():
    tok = _tiny_tokenizer()
    hash1 = tok.convert_tokens_to_ids("#")
    ids = _ids("ab") + [hash1, hash1] + _ids("c")
    state = SequenceTextState(tok, [], SamplingParams(stop=["###"], max_tokens=None), {tok.eos_token_id})
    streamed = []
    for token_id in ids:
        state.update(token_id)
        streamed.append(state.stream_text)
    assert streamed[-3:] == ["ab", "ab", "ab##c"]
    assert not state.finished


def test_stop_string_at_very_beginning():
    state, deltas, _ = _run(_ids("###abc"), stop=["###"])
    assert (state.text, state.finish_reason, state.stop_reason, "".join(deltas)) == ("", "stop", "###", "")


def test_several_stop_strings_earliest_start_wins():
    state, _, _ = _run(_ids("say END. now"), stop=[". ", "END"])
    assert (state.text, state.stop_reason) == ("say ", "END")
    state, _, _ = _run(_ids("xy"), stop=["y", "xy"])  # same step: "xy" starts earlier
    assert (state.text, state.stop_reason) == ("", "xy")


def test_stop_string_after_multibyte_character():
    state, deltas, _ = _run(_ids("鱼🐟 fish"), stop=["🐟"])
    assert (state.text, "".join(deltas), state.stop_reason) == ("鱼", "鱼", "🐟")


def test_eos_stops_without_its_text():
    tok = _tiny_tokenizer()
    ids = _ids("hi") + [tok.eos_token_id] + _ids("x")
    state, deltas, used = _run(ids, skip_special_tokens=False)
    assert (state.text, state.finish_reason, state.stop_reason, used) == ("hi", "stop", None, len(ids) - 1)
    assert "".join(deltas) == "hi"
    state, _, used = _run(ids, skip_special_tokens=False, ignore_eos=True)
    assert (state.text, state.finished, used) == ("hi" + EOS + "x", False, len(ids))


def test_stop_token_id_reports_the_id_and_drops_its_text():
    stop_id = _ids("#")[0]
    state, _, used = _run(_ids("ab#cd"), stop_token_ids=[stop_id])
    assert (state.text, state.finish_reason, state.stop_reason, used) == ("ab", "stop", stop_id, 3)


def test_min_tokens_defers_stop_strings_and_tokens():
    tok = _tiny_tokenizer()
    ids = [tok.convert_tokens_to_ids(c) for c in "ab#ab#cab#"]
    state, _, used = _run(ids, stop=["b#"], min_tokens=4)
    assert (state.text, state.stop_reason, used) == ("ab#a", "b#", 6)
    state, _, used = _run(ids, stop_token_ids=[ids[2]], min_tokens=4)
    assert (state.text, state.stop_reason, used) == ("ab#ab", ids[2], 6)
    # The sampler masks EOS for tokens 1..min_tokens; the checker accepts it from token min_tokens on.
    state, _, used = _run(ids + [tok.eos_token_id], min_tokens=12)
    assert (state.text, state.finished, used) == ("ab#ab#cab#", False, 11)
    state, _, used = _run(ids + [tok.eos_token_id], min_tokens=11)
    assert (state.text, state.finish_reason, used) == ("ab#ab#cab#", "stop", 11)


def test_max_tokens_gives_length_and_flushes_incomplete_character():
    ids = _ids("ab鱼")
    state, deltas, used = _run(ids, max_tokens=3)
    tok = _tiny_tokenizer()
    assert (state.finish_reason, state.stop_reason, used) == ("length", None, 3)
    assert state.text == "".join(deltas) == tok.decode(ids[:3])
    assert state.text.startswith("ab") and state.text.endswith("\ufffd")


def test_update_after_finish_and_bad_arguments_raise():
    state, _, _ = _run(_ids("abc"), max_tokens=1)
    with pytest.raises(RuntimeError, match="already finished"):
        state.update(1)
    with pytest.raises(ValueError, match="stop"):
        StopChecker([""], [], set(), False, None)
    with pytest.raises(ValueError, match="max_tokens=0"):
        StopChecker([], [], set(), False, 0)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.sampled_from(STREAM_ALPHABET), max_size=30),
    stops=st.lists(st.text(st.sampled_from(list("ab #你😀")), min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streamed_deltas_equal_final_text_and_never_show_stop(text, stops):
    tok = _tiny_tokenizer()
    ids = tok.encode(text)
    state, deltas, used = _run(ids, stop=stops)
    joined = "".join(deltas)
    assert joined == state.stream_text and state.text.startswith(joined)
    assert not any(stop in joined for stop in stops)
    visible = _visible_prefixes(tok, ids)
    hits = [k for k, t in enumerate(visible) if any(stop in t for stop in stops)]
    if hits:
        k = hits[0]
        start = min(visible[k].find(stop) for stop in stops if stop in visible[k])
        assert (state.text, used, state.finish_reason) == (visible[k][:start], k + 1, "stop")
        assert joined == state.text
    else:
        assert (state.text, used, state.finished) == (tok.decode(ids), len(ids), False)
