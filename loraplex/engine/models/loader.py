"""Read a checkpoint's :class:`ModelSpec` (``transformers.AutoConfig``) and load its HF safetensors
into :class:`LlamaForCausalLM`, fusing q/k/v and gate/up on the fly (Phi-3 checkpoints hold them
fused already); or fill random weights for benchmarks."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.adapters.model_spec import ModelSpec, UnsupportedModelError
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.tensor_parallel import TensorShard, shard_spec
from loraplex.kernels.ops import Kernels

logger = logging.getLogger(__name__)

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_LAYER_RE = re.compile(rf"^model\.layers\.(\d+)\.(self_attn|mlp|{'|'.join(_LAYER_NORMS)})\.?(.*)$")
# HF projection -> (our fused module attribute path, output-slice index), for split checkpoints ...
_SPLIT = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
# ... and for fused ones (Phi-3).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.qkv_proj", 0), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", 0), "mlp.down_proj": ("mlp.down_proj", 0),
}
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def load_model_spec(path: Path) -> ModelSpec:
    """The :class:`ModelSpec` of the checkpoint folder ``path`` (its ``config.json`` through ``AutoConfig``).

    Raises:
        OSError: no readable ``config.json``.
        UnsupportedModelError: an unsupported family or config field (the message names it).
    """
    from transformers import AutoConfig

    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(path)))


def build_model(path: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels,
                dummy_weights: bool = False, seed: int = 0, shard: TensorShard | None = None) -> LlamaForCausalLM:
    """Create the model on ``device``, its layers calling ``kernels``, and fill its weights.

    ``shard``: build one tensor-parallel rank's model (shapes of ``shard_spec``) and fill it with
    that rank's slices of the checkpoint (or of the same random weights as the whole model).
    The row-parallel layers' all-reduce is set by the caller.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``path`` (and not dummy).
        ValueError: a checkpoint tensor is missing, unexpected, mis-shaped, or (FP8 checkpoint) not FP8.
        UnsupportedModelError: an FP8 checkpoint with ``shard`` (tensor parallelism).

    FP8 checkpoints (``spec.checkpoint_quantization``): every projection is held as FP8 ``qweight`` +
    ``weight_scale`` and the checkpoint's ``weight`` (float8_e4m3fn) and ``weight_scale`` (``[out, 1]``,
    ``[out]``, or one value per tensor) are copied into them unchanged.
    """
    model = LlamaForCausalLM(spec if shard is None else shard_spec(spec, shard.world_size), dtype, device, kernels)
    if spec.checkpoint_quantization is not None and not dummy_weights:
        if shard is not None:
            raise UnsupportedModelError("FP8 checkpoints (config.quantization_config) are not implemented with "
                                        "tensor parallelism; serve them with tensor_parallel_size=1")
        for module in model.modules():
            if hasattr(module, "use_fp8_storage"):
                module.use_fp8_storage()
        logger.info("%s: FP8 checkpoint (%s, %s scales): weights stay FP8, activations and LoRA in %s (W8A16)%s",
                    path, spec.checkpoint_quantization.method, spec.checkpoint_quantization.weight_strategy, dtype,
                    "; the checkpoint's dynamic FP8 activations are not used"
                    if spec.checkpoint_quantization.dynamic_activations else "")
    if dummy_weights:
        fill_dummy_weights(model, seed, shard)
    else:
        load_safetensors(model, Path(path), shard)
    return model.eval()


def fill_dummy_weights(model: LlamaForCausalLM, seed: int, shard: TensorShard | None = None) -> None:
    """Random weights with sane magnitudes (speed does not depend on values); with ``shard``, this
    rank's slices of the whole model's random weights (the same values for every world size)."""
    gen = torch.Generator(device=model.embed_tokens.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # every RMSNorm weight
            p.data.fill_(1.0)
        elif shard is None:
            p.data.normal_(0.0, 0.02, generator=gen)
        else:
            full = p.data.new_empty(shard.full_shape(name, p.shape)).normal_(0.0, 0.02, generator=gen)
            p.data.copy_(shard.shard_tensor(name, full, whole=True))


def load_safetensors(model: LlamaForCausalLM, path: Path, shard: TensorShard | None = None) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    expected = _expected_targets(model)
    seen: set[tuple[str, int]] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied embeddings saved twice
                target = _target_for(name, model.spec)
                if target is None or target not in expected:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for {model.spec.architecture}")
                tensor = f.get_tensor(name)
                if shard is not None:
                    tensor = shard.shard_tensor(target[0], tensor, whole=model.spec.fused_projections)
                _copy_into(model, target, tensor, name)
                seen.add(target)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _projections(spec: ModelSpec) -> dict[str, tuple[str, int]]:
    return _FUSED if spec.fused_projections else _SPLIT


def _expected_targets(model: LlamaForCausalLM) -> set[tuple[str, int]]:
    spec = model.spec
    targets = {("embed_tokens", 0), ("norm.weight", 0)}
    if model.lm_head is not None:
        targets.add(("lm_head", 0))
    for i in range(spec.num_layers):
        for fused, idx in _projections(spec).values():
            targets.add((f"layers.{i}.{fused}.weight", idx))
            if spec.checkpoint_quantization is not None:
                targets.add((f"layers.{i}.{fused}.weight_scale", idx))
            if model.get_submodule(f"layers.{i}.{fused}").bias is not None:
                targets.add((f"layers.{i}.{fused}.bias", idx))
        if spec.qk_norm:
            targets.update((f"layers.{i}.{norm}.weight", 0) for norm in _QK_NORMS)
        norms = _LAYER_NORMS if spec.gemma_norms else _LAYER_NORMS[:2]
        targets.update((f"layers.{i}.{norm}.weight", 0) for norm in norms)
    return targets


def _target_for(name: str, spec: ModelSpec) -> tuple[str, int] | None:
    """HF tensor name -> (our parameter path, output-slice index)."""
    if name == "model.embed_tokens.weight":
        return ("embed_tokens", 0)
    if name == "model.norm.weight":
        return ("norm.weight", 0)
    if name == "lm_head.weight":
        return ("lm_head", 0)
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, kind, rest = m.groups()
    if kind in _LAYER_NORMS:
        return (f"layers.{layer}.{kind}.weight", 0) if rest == "weight" else None
    proj, _, param = rest.partition(".")
    if f"{kind}.{proj}" in _QK_NORMS:
        return (f"layers.{layer}.{kind}.{proj}.weight", 0) if param == "weight" else None
    fused = _projections(spec).get(f"{kind}.{proj}")
    params = ("weight", "bias", "weight_scale") if spec.checkpoint_quantization is not None else ("weight", "bias")
    if fused is None or param not in params:
        return None
    return (f"layers.{layer}.{fused[0]}.{param}", fused[1])


def _output_rows(lin: torch.nn.Module, idx: int) -> slice:
    """The rows of output slice ``idx`` (q/k/v of a fused qkv_proj, gate/up) in a fused linear's weight."""
    start = sum(lin.out_sizes[:idx])
    return slice(start, start + lin.out_sizes[idx])


def _copy_into(model: LlamaForCausalLM, target: tuple[str, int], tensor: torch.Tensor, name: str) -> None:
    path, idx = target
    if path.endswith((".weight", ".weight_scale")) and getattr(
            model.get_submodule(path.rsplit(".", 1)[0]), "qweight", None) is not None:
        _copy_fp8(model, target, tensor, name)
        return
    param = model.get_parameter(path)
    dest = param.data
    if path.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "gate_up_proj.bias")):
        dest = dest[_output_rows(model.get_submodule(path.rsplit(".", 1)[0]), idx)]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    if model.spec.gemma_norms and path.endswith("norm.weight"):  # Gemma stores w - 1; HF adds 1 in fp32
        tensor = 1.0 + tensor.float()
    dest.copy_(tensor.to(dest.dtype))


def _copy_fp8(model: LlamaForCausalLM, target: tuple[str, int], tensor: torch.Tensor, name: str) -> None:
    """An FP8 checkpoint's ``weight`` (float8_e4m3fn, copied as is) or ``weight_scale`` (per output
    channel ``[out, 1]`` / ``[out]``, or per tensor ``[1]`` / ``[]``, broadcast to the slice's rows, as the
    checkpoint's weight strategy declares: a scale of the other kind or another shape is refused)."""
    from loraplex.kernels.fp8_linear import FP8_DTYPE

    path, idx = target
    lin = model.get_submodule(path.rsplit(".", 1)[0])
    rows = _output_rows(lin, idx)
    if path.endswith(".weight"):
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}, expected {FP8_DTYPE} in an FP8 checkpoint "
                             "(projections left unquantized are not implemented)")
        dest = lin.qweight[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        return
    dest = lin.weight_scale[rows]
    out = dest.shape[0]
    per_tensor = model.spec.checkpoint_quantization.weight_strategy == "tensor"
    allowed = ((1,), ()) if per_tensor else ((out, 1), (out,))
    if tuple(tensor.shape) not in allowed:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                         + ("[1] or [] (one scale per tensor)" if per_tensor else
                            f"({out}, 1) or ({out},) (one scale per output channel)"))
    scale = tensor.to(torch.float32).reshape(-1).expand(out)
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError(f"tensor {name!r}: weight scales must be finite and > 0")
    dest.copy_(scale)
