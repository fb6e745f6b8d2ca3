"""Model implementations over the flattened, paged token batch."""

from loraplex.engine.models.llama import LlamaForCausalLM, ModelSpec, SUPPORTED_ARCHITECTURES

__all__ = ["LlamaForCausalLM", "ModelSpec", "SUPPORTED_ARCHITECTURES"]
