"""OpenAI response shapes: choices, stream chunks, usage chunks and logprobs, for
completions (``text_completion``) and chat (``chat.completion[.chunk]``).

References: https://platform.openai.com/docs/api-reference/completions/object and
/chat/object, /chat/streaming.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from loraplex.engine.outputs import CompletionOutput

if TYPE_CHECKING:
    from loraplex.platform.services.serving import PreparedRequest


def has_entries(logprobs: dict) -> bool:
    return bool(logprobs.get("tokens") or logprobs.get("content"))


def finish_reason(completion: CompletionOutput) -> str | None:
    return None if completion.finish_reason in (None, "abort") else completion.finish_reason


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class OpenAIFormatter:
    """Builds OpenAI choice/chunk dicts for completions or chat."""

    def __init__(self, prep: PreparedRequest) -> None:
        self.prep = prep

    def chunk(self, index: int, delta: Any, logprobs: dict | None, finish_reason: str | None) -> dict:
        prep = self.prep
        if prep.kind == "completion":
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        else:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        body = {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model, "choices": [choice]}
        if prep.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict:
        prep = self.prep
        return {"id": prep.id, "object": "text_completion" if prep.kind == "completion" else "chat.completion.chunk",
                "created": prep.created, "model": prep.model, "choices": [], "usage": usage}

    def final_choice(self, index: int, completion: CompletionOutput) -> dict:
        logprobs = None
        if self.prep.top_logprobs is not None and completion.logprobs is not None:
            logprobs = self.logprobs(completion, 0, len(completion.logprobs), 0)
        if self.prep.kind == "completion":
            return {"index": index, "text": completion.text, "logprobs": logprobs,
                    "finish_reason": finish_reason(completion)}
        return {"index": index, "message": {"role": "assistant", "content": completion.text}, "logprobs": logprobs,
                "finish_reason": finish_reason(completion)}

    def logprobs(self, completion: CompletionOutput, start: int, end: int, text_offset: int) -> dict:
        """OpenAI logprobs of generated positions ``[start, end)``."""
        decode = self.prep.decode
        k = self.prep.top_logprobs or 0
        entries = []
        for token_id, top in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
            best = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:k]
            entries.append((decode(token_id), top.get(token_id, float("-inf")),
                            [(decode(t), lp) for t, lp in best]))
        if self.prep.kind == "chat":
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                                  for t, v in top]} for tok, lp, top in entries]}
        offsets, pos = [], text_offset
        for tok, _, _ in entries:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [dict(e[2]) for e in entries], "text_offset": offsets}
