"""Model implementations over the flattened, paged token batch."""

from loraplex.adapters.model_spec import FAMILIES, ModelSpec, UnsupportedModelError
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.loader import load_model_spec

__all__ = ["FAMILIES", "LlamaForCausalLM", "ModelSpec", "UnsupportedModelError", "load_model_spec"]
