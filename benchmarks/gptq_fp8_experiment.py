"""Experiment: does GPTQ-style error feedback (Frantar et al. 2022) bring FP8 (e4m3, per-channel) SmolLM2 to
>= 0.95 teacher-forced top-1 agreement with the unquantized model, where round-to-nearest gives 0.923-0.934?

HF transformers only (CPU): reference greedy answers on the held-out questions, then each candidate reads
prompt + answer; a position agrees when the candidate's argmax is the reference's next token. Calibration:
the training questions of examples/data/base_replies.jsonl with their replies (never the held-out ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplex.engine.models.quantization import FP8_MAX  # noqa: E402
from loraplex.kernels.fp8_linear import FP8_DTYPE  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chat_ids(tok, question: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def rtn(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest e4m3 with per-row ``scale``, returned dequantized (float32)."""
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32) * scale[:, None]


def quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` rounded to e4m3 with one scale per row (absmax / 448), dequantized in x's dtype."""
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


def rtn_blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Round-to-nearest e4m3 with one scale per ``rows x cols`` block (absmax / 448), dequantized (float32):
    ``rows=1`` is per-row groups along the input; 128 x 128 is the block format of DeepSeek-V3's FP8 checkpoints."""
    n, k = w.shape
    pad_n, pad_k = -n % rows, -k % cols
    wp = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n))
    blocks = wp.reshape(wp.shape[0] // rows, rows, wp.shape[1] // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32) * scale
    return q.reshape(wp.shape)[:n, :k]


def gptq(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, block: int = 128, damp: float = 0.01) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022, Algorithm 1) with the e4m3 per-row quantizer; returns the dequantized weight."""
    w = w.clone().float()
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0])
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    cols = w.shape[1]
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        q1, err1 = torch.zeros_like(w1), torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = rtn(col[:, None], scale)[:, 0]
            q1[:, i] = qc
            e = (col - qc) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        q[:, i1:i2] = q1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q


def agreement(model, prompts, answers) -> tuple[int, int]:
    agreed = total = 0
    with torch.inference_mode():
        for p, a in zip(prompts, answers):
            logits = model(torch.tensor([p + a])).logits[0]
            pred = logits[len(p) - 1 : len(p) + len(a) - 1].argmax(-1).tolist()
            agreed += sum(int(x == y) for x, y in zip(pred, a))
            total += len(a)
    return agreed, total


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calib", type=int, default=107)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--methods", default="rtn,gptq",
                    help="rtn (per-channel), gptq, blockRxC (one scale per R x C block, e.g. block1x128), bf16 "
                         "(the weights rounded to bf16 only: the measure's noise floor), w8a8 (rtn weights and each "
                         "projection's input rounded to e4m3 with one scale per token, absmax / 448: FP8 tensor-core "
                         "GEMMs) or a8 (the inputs only)")
    ap.add_argument("--skip", default="", help="projections left unquantized, e.g. v_proj,o_proj or L0,L29")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    held = [json.loads(x)["question"] for x in (ROOT / "examples/data/heldout.jsonl").read_text().splitlines() if x]
    prompts = [chat_ids(tok, q) for q in held]
    answers = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), max_new_tokens=args.max_new_tokens, do_sample=False)
            answers.append(out[0, len(p):].tolist())
    calib_rows = [json.loads(x) for x in (ROOT / "examples/data/base_replies.jsonl").read_text().splitlines() if x]
    calib: list[int] = []
    for r in calib_rows[: args.calib]:
        calib += chat_ids(tok, r["question"]) + tok(r["reply"], add_special_tokens=False)["input_ids"]
    chunks = [torch.tensor([calib[i:i + 1024]]) for i in range(0, len(calib), 1024)]  # packed calibration
    print(f"held-out positions {sum(map(len, answers))}, calibration tokens {len(calib)}", flush=True)

    results = {}
    known = ("rtn", "gptq", "bf16", "w8a8", "a8")
    bad = [m for m in args.methods.split(",") if m not in known and not m.startswith("block")]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {known} or blockRxC")
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        layers = model.model.layers
        with torch.inference_mode():
            hidden = [model.model.embed_tokens(c) for c in chunks]
            rope = [model.model.rotary_emb(h, torch.arange(h.shape[1])[None]) for h in hidden]

        def run_layer(layer, hs):
            with torch.inference_mode():
                outs = [layer(h, position_embeddings=r, attention_mask=None) for h, r in zip(hs, rope)]
            return [o[0] if isinstance(o, tuple) else o for o in outs]

        for li, layer in enumerate(layers):
            mods = {p: getattr(layer.self_attn if p in PROJ[:4] else layer.mlp, p) for p in PROJ}
            hs = {p: torch.zeros(m.in_features, m.in_features) for p, m in mods.items()}
            counts = dict.fromkeys(PROJ, 0)
            if method == "gptq":
                handles = []
                for p, m in mods.items():
                    def hook(mod, inp, out, p=p):
                        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                        hs[p] += x.T @ x
                        counts[p] += x.shape[0]
                    handles.append(m.register_forward_hook(hook))
                run_layer(layer, hidden)  # inputs come from the already-quantized layers below
                for h in handles:
                    h.remove()
            with torch.no_grad():
                for p, m in mods.items():
                    if p in args.skip.split(",") or f"L{li}" in args.skip.split(","):
                        continue
                    w = m.weight.float()
                    scale = torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / FP8_MAX, torch.ones(w.shape[0]))
                    if method in ("w8a8", "a8"):  # dynamic per-token e4m3 inputs (as vLLM's FP8 W8A8 on Hopper)
                        m.register_forward_pre_hook(lambda mod, inp: (quantize_per_token(inp[0]),))
                    if method == "a8":
                        continue
                    if method == "bf16":  # the noise floor of the measure: weights rounded to bf16 only
                        q = w.to(torch.bfloat16).float()
                    elif method.startswith("block"):  # e.g. block1x128, block128x128
                        rows, cols = (int(v) for v in method.removeprefix("block").split("x"))
                        q = rtn_blocks(w, rows, cols)
                    else:
                        q = rtn(w, scale) if method in ("rtn", "w8a8") else gptq(
                            w, 2 * hs[p] / max(counts[p], 1), scale, damp=args.damp)
                    m.weight.copy_(q)
            hidden = run_layer(layer, hidden)
        model = model.to(dtype)
        a, n = agreement(model, prompts, answers)
        results[method] = a / n
        print(f"{method}: {a}/{n} = {a / n:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
