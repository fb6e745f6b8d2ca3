"""FP8 weight quantization accuracy on SmolLM2-135M-Instruct: top-1 agreement and per-layer error.

    python benchmarks/fp8_accuracy.py [--max-new-tokens 32] [--out FILE]

Method (CPU or GPU; the reference is the unquantized model in the engine's dtype):
1. The reference engine answers each held-out question of ``examples/data/heldout.jsonl``
   (chat template, greedy, ``max_new_tokens``).
2. Teacher-forced top-1 agreement: the FP8 engine (``quantization="fp8"``) reads prompt +
   reference answer as one prompt with ``prompt_logprobs=1``; a position agrees when its
   most likely token is the reference's next token. Teacher forcing counts every position
   once (a free-running comparison stops meaning anything after the first divergence; its
   exact-match rate is reported too).
3. Per-layer relative error ``||x Wq^T - x W^T|| / ||x W^T||`` of each quantized projection
   on the activations of the same prompts (HF transformers model, forward hooks).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.models.quantization import dequantize_fp8, quantize_fp8_per_channel  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Fp8Accuracy:
    """Top-1 agreement (teacher-forced), exact answers (free-running), per-projection errors."""

    positions: int = 0
    agreed: int = 0
    answers: int = 0
    identical_answers: int = 0
    rel_error: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # projection -> per layer

    @property
    def agreement(self) -> float:
        return self.agreed / max(self.positions, 1)


def heldout_questions(limit: int | None = None) -> list[str]:
    lines = (ROOT / "examples" / "data" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()][:limit]


def measure(model_dir: str, questions: list[str], max_new_tokens: int = 32, *, dtype: str = "auto",
            candidate: dict | None = None, layer_errors: bool = True, **engine_kwargs) -> Fp8Accuracy:
    """Run the method of the module docstring over ``questions``: the reference engine in
    ``dtype`` against the candidate (default: the same with ``quantization="fp8"``;
    ``candidate`` overrides its engine arguments). ``engine_kwargs`` go to both engines."""
    result = Fp8Accuracy()
    reference = LLM(model=model_dir, dtype=dtype, **engine_kwargs)
    tok = reference.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    answers = [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    del reference
    quantized = LLM(model=model_dir, **({"dtype": dtype, "quantization": "fp8"} | (candidate or {})), **engine_kwargs)
    forced = quantized.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)],
                                SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    for prompt, answer, out in zip(prompts, answers, forced):
        for i, token in enumerate(answer):
            top = out.prompt_logprobs[len(prompt) + i]
            result.positions += 1
            result.agreed += int(max(top, key=top.get) == token)
    free = quantized.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    result.answers = len(prompts)
    result.identical_answers = sum(o.outputs[0].token_ids == a for o, a in zip(free, answers))
    del quantized
    if layer_errors:
        _layer_errors(model_dir, prompts, answers, result)
    return result


def _layer_errors(model_dir: str, prompts, answers, result: Fp8Accuracy) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    sums: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    hooks = []
    for layer_idx, layer in enumerate(model.model.layers):
        for name, module in layer.named_modules():
            proj = name.split(".")[-1]
            if proj not in PROJECTIONS:
                continue
            deq = dequantize_fp8(*quantize_fp8_per_channel(module.weight.data))

            def hook(mod, args, out, key=(layer_idx, proj), deq=deq):
                err = torch.nn.functional.linear(args[0], deq) - (out - (mod.bias if mod.bias is not None else 0))
                sums[key][0] += err.pow(2).sum().item()
                sums[key][1] += (out - (mod.bias if mod.bias is not None else 0)).pow(2).sum().item()

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for p, a in zip(prompts, answers):
            model(input_ids=torch.tensor([p + a]))
    for h in hooks:
        h.remove()
    for (layer_idx, proj), (err, ref) in sorted(sums.items()):
        result.rel_error[proj].append((err / max(ref, 1e-30)) ** 0.5)


def report(acc: Fp8Accuracy) -> str:
    lines = [f"teacher-forced top-1 agreement: {acc.agreed}/{acc.positions} = {acc.agreement:.4f}",
             f"free-running answers identical to the reference: {acc.identical_answers}/{acc.answers}",
             "", "| projection | mean rel. error over layers | max (layer) |", "|---|---|---|"]
    for proj in PROJECTIONS:
        errs = acc.rel_error.get(proj)
        if errs:
            worst = max(range(len(errs)), key=errs.__getitem__)
            lines.append(f"| {proj} | {sum(errs) / len(errs):.4f} | {errs[worst]:.4f} ({worst}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from loraplex.engine.demo_models import default_cache_dir, resolve_model

    model_dir = args.model if Path(args.model).is_dir() else str(resolve_model(args.model, default_cache_dir()))
    questions = heldout_questions(args.questions)
    rows = [("FP8 weights, bf16 activations", "bf16 model", dict(dtype="bfloat16")),
            ("bf16 model (its own noise)", "fp32 model", dict(dtype="float32", candidate={"dtype": "bfloat16",
                                                                                       "quantization": None})),
            ("FP8 weights, fp32 activations", "fp32 model", dict(dtype="float32"))]
    parts = []
    for name, ref, kwargs in rows:
        acc = measure(model_dir, questions, args.max_new_tokens, layer_errors=not parts, max_model_len=512,
                      **kwargs)
        parts.append(f"## {name} vs the {ref}\n{report(acc)}")
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
