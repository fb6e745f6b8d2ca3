"""Independent reference for adapter evaluations: HF transformers (+ PEFT) in float32.

``continuation_logliks`` scores each (prompt, continuation) pair the way the platform's
evaluation service defines it: ``context = encode(prompt)`` with special tokens,
``continuation = encode(text)`` without, summed natural-log probabilities of the
continuation tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_dir: Path, adapter_dir: Path | None = None):
    """The base model in float32 (eval), with ``adapter_dir``'s PEFT adapter applied if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def continuation_loglik(model, tokenizer, prompt: str, continuation: str) -> float:
    context = tokenizer.encode(prompt, add_special_tokens=True)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    ids = context + cont
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return sum(logp[pos - 1, ids[pos]].item() for pos in range(len(context), len(ids)))


def greedy_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation's text, cut before the first newline (EOS ends it too)."""
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    return text.split("\n", 1)[0]
