"""Offline batch inference, as vLLM's ``LLM`` class::

    from loraplex import LLM, SamplingParams, LoRARequest
    llm = LLM(model="smollm2-135m-instruct", max_model_len=2048)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]
Messages = list[dict[str, str]]


class LLM:
    """Runs prompts to completion through an :class:`LLMEngine`.

    Keyword arguments are :class:`EngineConfig` fields (``max_model_len``,
    ``enable_lora``, ``max_loras``, ...); ``dummy_weights=True`` fills random
    weights (benchmarks).
    """

    def __init__(self, model: str, *, dummy_weights: bool = False, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), dummy_weights=dummy_weights)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or
        ``{"prompt_token_ids": [...]}``; ``sampling_params`` and
        ``lora_request`` are one for all prompts or one per prompt.

        Raises ``ValueError`` when a per-prompt list has the wrong length, and
        the engine's errors for a bad prompt (nothing is left queued then).
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        loras = _per_prompt(lora_request, len(prompt_list), "lora_request")
        ids = []
        try:
            for prompt, p, lora in zip(prompt_list, params, loras):
                ids.append(self._add(prompt, p, lora))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(self, messages: Messages | Seq[Messages],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        out = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        chat_template=chat_template, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _add(self, prompt: PromptInput, params: SamplingParams, lora: LoRARequest | None) -> str:
        self._counter += 1
        rid = f"offline-{self._counter}"
        value = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        self.engine.add_request(rid, value, dataclasses.replace(params, output_kind="final_only"), lora)
        return rid

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
    return list(value)
