"""Logprob fields agree with the text, for characters split over several tokens (issue 15.1).

A property test over several byte-level BPE tokenizers (the tiny test models' with two vocab
sizes, and SmolLM2's when prepared): token ids drawn from text with multi-byte characters,
special tokens and random ids, run through the engine's text state (stop strings, stop
tokens, special tokens skipped) and the OpenAI formatter, streamed (one chunk per engine
step) and not, chat and completions, with and without echo. Reference for each token's own
bytes: GPT-2's byte alphabet from ``transformers.convert_slow_tokenizer`` (not loraplex's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1]))

from tiny_models import make_tokenizer  # noqa: E402

TEXTS = ["你好，世界！", "🙂 emoji 🙂🙂", "Le café coûte 3 €.", "naïve Ωmega ß ∑ 𝔘", "Paris 你好 🙂 !", "ok"]


def _reference_raw(tokenizer):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}

    def raw(token_id: int) -> bytes:
        if token_id in added:
            return added[token_id].encode()
        return bytes(decoder[c] for c in tokenizer.convert_ids_to_tokens(token_id))

    return raw


def _tokenizers():
    found = {"tiny-384": make_tokenizer(384), "tiny-300": make_tokenizer(300)}
    from loraplex.engine.demo_models import default_cache_dir, resolve_model

    cache = os.environ.get("LORAPLEX_CACHE_DIR")
    try:
        path = resolve_model("smollm2-135m-instruct", Path(cache) if cache else default_cache_dir())
    except FileNotFoundError:
        if os.environ.get("CI") == "true":
            raise
    else:
        from transformers import AutoTokenizer

        found["smollm2"] = AutoTokenizer.from_pretrained(str(path))
    return found


TOKENIZERS = _tokenizers()


@st.composite
def generations(draw):
    name = draw(st.sampled_from(sorted(TOKENIZERS)))
    tokenizer = TOKENIZERS[name]
    text = "".join(draw(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = sorted(tokenizer.all_special_ids)
    extra = draw(st.lists(st.tuples(st.integers(0, len(ids)), st.one_of(
        st.sampled_from(specials), st.integers(0, len(tokenizer) - 1))), max_size=3))
    for position, token_id in sorted(extra, reverse=True):
        ids.insert(position, token_id)
    stop = draw(st.one_of(st.none(), st.sampled_from(["，", "🙂", "é", "a", "!", "Ω"])))
    stop_token = draw(st.one_of(st.none(), st.sampled_from(ids)))
    skip = draw(st.booleans())
    prompt_text = draw(st.sampled_from(TEXTS))
    return name, ids, stop, stop_token, skip, prompt_text, draw(st.integers(0, 3)), draw(st.booleans())


def _run_engine_side(tokenizer, prompt_ids, ids, params, eos):
    """CompletionOutputs after each step, as the engine builds them."""
    import random

    from loraplex.engine.detokenizer import SequenceTextState
    from loraplex.engine.outputs import CompletionOutput

    rng = random.Random(len(ids))
    state = SequenceTextState(tokenizer, prompt_ids, params, {eos}, max_tokens=len(ids))
    outs, token_ids, logprobs = [], [], []
    for token_id in ids:
        token_ids.append(token_id)
        top = {t: -rng.random() * 5 - 0.5 for t in rng.sample(range(len(tokenizer)), 3)}
        top[token_id] = -rng.random()
        logprobs.append(top)
        state.update(token_id)
        outs.append(CompletionOutput(0, state.stream_text, list(token_ids), list(logprobs),
                                     finish_reason=state.finish_reason, token_text_ends=list(state.token_text_ends)))
        if state.finished:
            break
    return outs


def _prep(kind, tokenizer, prompt_ids, params, top, echo):
    from loraplex.engine.input_processor import ProcessedPrompt
    from loraplex.platform.services.openai_format import token_text
    from loraplex.platform.services.serving import PreparedRequest

    prompt = ProcessedPrompt(None, list(prompt_ids), params.max_tokens or 1)
    return PreparedRequest(kind, "id", 0, "m", "m", None, [prompt], params, None, True, False, top,
                           token_text(tokenizer), echo=echo)


def _request_output(prompt_ids, completion, tokenizer):
    from loraplex.engine.outputs import RequestOutput

    plps = [None] + [{t: -1.0, (t + 1) % len(tokenizer): -2.0} for t in prompt_ids[1:]]
    return RequestOutput("r", None, prompt_ids, [completion], completion.finished, plps)


@given(generations())
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_logprob_fields_rebuild_the_text(case):
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.services.openai_format import ChoiceProgress, OpenAIFormatter

    name, ids, stop, stop_token, skip, prompt_text, top, echo = case
    tokenizer = TOKENIZERS[name]
    raw_of = _reference_raw(tokenizer)
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=[stop] if stop else None, logprobs=top, ignore_eos=True,
                            stop_token_ids=[stop_token] if stop_token is not None else None,
                            skip_special_tokens=skip, prompt_logprobs=top if echo else None)
    outs = _run_engine_side(tokenizer, prompt_ids, ids, params, tokenizer.eos_token_id)
    final = outs[-1]
    assert final.finished
    for kind in ("completion", "chat"):
        prep = _prep(kind, tokenizer, prompt_ids, params, top, echo and kind == "completion")
        fmt = OpenAIFormatter(prep, prep.tokens)
        whole = fmt.delta(0, _request_output(prompt_ids, final, tokenizer), final, ChoiceProgress(), prompt_index=0)
        progress, streamed = ChoiceProgress(), []
        for out in outs:
            delta = fmt.delta(0, _request_output(prompt_ids, out, tokenizer), out, progress, prompt_index=0)
            if delta is not None:
                streamed.append(delta)
        # streamed = whole, finish once, each chunk's tokens = its text
        assert "".join(d.text for d in streamed) == whole.text
        assert [e for d in streamed for e in d.entries] == whole.entries
        assert [d.finish_reason for d in streamed if d.finish_reason] == [whole.finish_reason]
        for d in streamed:
            assert "".join(e.piece.text for e in d.entries) == d.text
        prompt_part = tokenizer.decode(prompt_ids, skip_special_tokens=False) if prep.echo else ""
        assert whole.text == prompt_part + final.text
        obj = fmt.response([whole], usage=_usage())
        choice = obj.choices[0]
        generated_ids = final.token_ids
        if kind == "chat":
            content = choice.logprobs.content
            assert choice.message.content == final.text
            assert b"".join(bytes(e.bytes) for e in content) == final.text.encode()
            assert "".join(e.token for e in content) == final.text
            assert len(content) == len(generated_ids)
            for e, token_id, top_dict in zip(content, generated_ids, final.logprobs):
                assert e.logprob == top_dict[token_id]
                if "\ufffd" not in final.text:
                    assert "\ufffd" not in e.token and e.bytes != [239, 191, 189]
                best = sorted(top_dict.items(), key=lambda kv: kv[1], reverse=True)[:top]
                assert [t.logprob for t in e.top_logprobs] == [lp for _, lp in best]
                for alt, (alt_id, _) in zip(e.top_logprobs, best):
                    if alt_id == token_id:
                        assert (alt.token, alt.bytes) == (e.token, e.bytes)
                    else:
                        assert bytes(alt.bytes) == raw_of(alt_id)
                        assert "\ufffd" not in alt.token
            # a token's bytes are its own raw bytes unless its text is cut off or skipped
            joined = b"".join(bytes(e.bytes) for e in content)
            if joined == b"".join(raw_of(t) for t in generated_ids[:len(content)]):
                assert all(bytes(e.bytes) == raw_of(t) for e, t in zip(content, generated_ids))
        else:
            lp = choice.logprobs
            assert choice.text == whole.text
            assert "".join(lp.tokens) == choice.text
            assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
            expected_len = len(generated_ids) + (len(prompt_ids) if prep.echo else 0)
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == expected_len
            if prep.echo:
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                assert lp.token_logprobs[1:len(prompt_ids)] == [-1.0] * (len(prompt_ids) - 1)
            for position, token_id in enumerate(generated_ids):
                i = position + (len(prompt_ids) if prep.echo else 0)
                assert lp.token_logprobs[i] == final.logprobs[position][token_id]
                assert len(lp.top_logprobs[i]) <= top


def _usage():
    from loraplex.platform.openai_schemas import Usage

    return Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)


def test_a_split_character_keeps_its_bytes():
    """' 你好' where the tokenizer splits a character: bytes are the tokens' own, not U+FFFD's."""
    from loraplex.engine.detokenizer import split_text_by_tokens

    pieces = split_text_by_tokens("，x", [0, 1, 2], [b"\xef\xbc", b"\x8c", b"x"])
    assert [(p.text, p.raw, p.text_offset) for p in pieces] == [("", b"\xef\xbc", 0), ("，", b"\x8c", 0),
                                                                  ("x", b"x", 1)]
