"""Chat prompts: the tokenizer's chat template applied to ``messages``, with message content
kept literal.

A special-token string inside a message (``"hi<|im_end|>\\n<|im_start|>assistant\\n..."``)
must not become a control token: otherwise an application's end user can close their turn
and forge an assistant or system turn. So the template is rendered with each content wrapped
in private-use markers; the rendered text is split at the template's own special tokens, and
each piece between them (template text and content together, as the tokenizer would see it)
is tokenized with ``split_special_tokens=True``. Without special-token strings in the content
this gives exactly ``tokenizer.apply_chat_template(..., tokenize=True)`` (that path is used).
"""

from __future__ import annotations

import re

from loraplex.platform.errors import InvalidRequest

# Private-use characters around each content while rendering (refused inside content).
_OPEN, _CLOSE = "\ue000", "\ue001"


def special_token_strings(tokenizer) -> list[str]:
    """The tokenizer's special-token strings, longest first."""
    found = set(tokenizer.all_special_tokens)
    found |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted((s for s in found if s), key=len, reverse=True)


def chat_prompt_ids(tokenizer, messages: list[dict], *, literal_content: bool = True, **template_kwargs) -> list[int]:
    """Token ids of the chat prompt (generation prompt added).

    ``messages``: ``{"role", "content"}`` dicts. ``literal_content``: special-token strings in
    a content are text (False: they become control tokens, the tokenizer's plain behaviour).
    ``template_kwargs``: passed to ``apply_chat_template`` (``tools``, ``chat_template``).
    Raises ``InvalidRequest`` when the template refuses the messages or the prompt is empty.
    """
    specials = special_token_strings(tokenizer)
    if not literal_content or not any(s in m["content"] for m in messages for s in specials):
        out = _apply(tokenizer, messages, tokenize=True, **template_kwargs)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    else:
        ids = _literal_ids(tokenizer, messages, specials, **template_kwargs)
    if not ids:
        raise InvalidRequest("messages: produce an empty prompt", param="messages")
    return ids


def _apply(tokenizer, messages: list[dict], *, tokenize: bool, **template_kwargs):
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                             **template_kwargs)
    except Exception as exc:  # jinja errors (e.g. a template that rejects a role order)
        raise InvalidRequest(f"messages: the chat template refused them ({exc})", param="messages") from None


def _literal_ids(tokenizer, messages: list[dict], specials: list[str], **template_kwargs) -> list[int]:
    for m in messages:
        if _OPEN in m["content"] or _CLOSE in m["content"]:
            raise InvalidRequest("messages: content holds the private-use characters U+E000/U+E001 together "
                                 "with special-token text", param="messages")
    marked = [{**m, "content": _OPEN + m["content"] + _CLOSE} for m in messages]
    rendered = _apply(tokenizer, marked, tokenize=False, **template_kwargs)
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    vocab = tokenizer.convert_tokens_to_ids
    segments: list[str | int] = []  # text to tokenize literally, or a template special token id
    text = ""
    for position, part in enumerate(re.split(f"[{_OPEN}{_CLOSE}]", rendered)):
        if position % 2 == 1:  # inside a content
            text += part
            continue
        last = 0
        for match in pattern.finditer(part):
            text += part[last:match.start()]
            segments.append(text)
            segments.append(vocab(match.group()))
            text, last = "", match.end()
        text += part[last:]
    segments.append(text)
    if rendered.count(_OPEN) != len(messages) or rendered.count(_CLOSE) != len(messages):
        raise InvalidRequest("messages: the chat template changes message content; special-token text in "
                             "content cannot be kept literal with it", param="messages")
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, int):
            ids.append(segment)
        elif segment:
            ids.extend(tokenizer(segment, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return ids
