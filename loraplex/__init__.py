"""loraplex: multi-tenant LoRA serving.

The offline API mirrors vLLM: ``from loraplex import LLM, SamplingParams, LoRARequest``.
"""

from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine classes import torch/transformers; load them on first use so that
    # `import loraplex` stays light for the CLI and the settings module.
    if name == "LoRARequest":  # loraplex.adapters imports torch
        from loraplex.adapters.lora_request import LoRARequest

        return LoRARequest
    if name == "LLM":
        from loraplex.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from loraplex.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from loraplex.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
