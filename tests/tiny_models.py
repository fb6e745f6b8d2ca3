"""Tiny random Llama-family checkpoints with a real byte-level BPE tokenizer,
built in tests (no hub downloads). Used as the independent HF reference."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Large language models serve many LoRA adapters from one GPU.",
    "def add(a, b):\n    return a + b\n",
    "Le renard brun saute par-dessus le chien paresseux. 你好，世界！ 🙂 emoji",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Colors: red, green, blue.",
]


def make_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (GPT-2 style) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


ARCHS = {  # arch -> (HF config class, HF model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random ``arch`` (a key of ``ARCHS``) checkpoint + tokenizer to ``path`` (float32)."""
    import transformers

    tokenizer = make_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}")
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    if arch != "gemma3":  # Gemma 3 keeps one set per layer type (its defaults: local 1e4, global 1e6)
        common.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    model = model_cls(config_cls(**common))
    with torch.no_grad():  # larger weights than the default init, so that logits are far from ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            else:  # RMSNorm weights away from 1, so a norm loaded into the wrong place shows
                p.normal_(1.0, 0.1)
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return Path(path)


def make_peft_adapter(base_dir: Path, out_dir: Path, *, r: int = 8, alpha: int = 16,
                      targets=("q_proj", "v_proj"), use_rslora: bool = False, seed: int = 0,
                      b_std: float = 0.1, use_dora: bool = False) -> Path:
    """A real PEFT LoRA adapter on ``base_dir`` with non-zero (random) B matrices; with ``use_dora`` a DoRA
    one whose magnitude vectors are also moved away from their initial column norms (by up to ~30%)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_dora=use_dora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
            elif "lora_A" in name:
                p.normal_(0.0, 0.3)
            elif "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.1 * torch.randn_like(p).clamp(-3.0, 3.0))
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def make_vocab_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kwargs) -> Path:
    """A PEFT adapter (``LoraConfig(**lora_kwargs)``, e.g. on embed_tokens / lm_head or with ``modules_to_save``)
    with random non-zero LoRA factors (embedding ones included) and perturbed ``modules_to_save`` copies."""
    import warnings

    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about tied weights and saved embedding layers
        model = get_peft_model(base, LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_kwargs))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.3)
                elif "modules_to_save" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_model(base_dir: Path, adapter_dir: Path):
    """The HF + PEFT reference model for one adapter (float32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def reference_models(base_dir: Path, adapters: dict) -> dict:
    """``{"base": the HF model, name: its PEFT model for each adapter}`` (float32, eval); ``adapters``: name ->
    ``LoRARequest``."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    return {"base": base} | {name: peft_model(base_dir, req.lora_path) for name, req in adapters.items()}


def peft_references(base_dir: Path, adapters: dict, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """(adapter name or "base", prompt index) -> (HF/PEFT greedy tokens, last-position logprobs)."""
    return {(name, i): (hf_greedy_ids(model, p, max_new_tokens), hf_last_logprobs(model, p))
            for name, model in reference_models(base_dir, adapters).items() for i, p in enumerate(prompts)}


def hf_greedy_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with EOS masked for ``max_new_tokens`` (as ``min_tokens`` does)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def hf_last_logprobs(model, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at the last prompt position, ``[vocab]`` float32."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


def check_row(out, ref_tokens: list[int], ref_lp: torch.Tensor) -> None:
    """An engine ``RequestOutput`` equals HF (+ PEFT): the greedy tokens exactly, and the first position's top-5
    logprobs to 2e-4 (``ref_lp``: the reference's last-position logprobs, ``hf_last_logprobs``)."""
    import pytest

    comp = out.outputs[0]
    assert comp.token_ids == ref_tokens
    top5 = torch.topk(ref_lp, 5)
    for tid, lp in zip(top5.indices.tolist(), top5.values.tolist()):
        assert comp.logprobs[0][tid] == pytest.approx(lp, abs=2e-4)


FOLDS = ["off", "on", "on-paged"]
"""LoRA paths an engine test runs: the SGMV kernels, the shrink folded into the base GEMM, and folded over a pool of
4-row pages (several pages per adapter of rank > 4)."""


def fold_config(fold: str) -> dict:
    """The engine settings of a :data:`FOLDS` entry."""
    return {"lora_fold_shrink": fold.split("-")[0]} | ({"lora_page_rows": 4} if fold.endswith("paged") else {})


def step_to_end(engine) -> dict:
    """Step ``engine`` (an ``LLMEngine``) until no request is unfinished; request id -> final ``RequestOutput``."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals
