"""Engine configuration: one validated dataclass, the single source of every engine knob.

:class:`EngineConfig` is what the engine reads, and what the platform generates its
``loraplex serve`` flags (``--block-size``) and its settings fields / environment
variables (``LORAPLEX_BLOCK_SIZE``) from, as vLLM's ``EngineArgs.add_cli_args`` does:
:func:`config_fields` describes each field (name, type, choices, default, and the
help text: the field's docstring). Every value is checked once, by
:meth:`EngineConfig.validate` (``__post_init__`` and the platform call the same
function); a bad value raises :class:`ConfigError`, which carries the field, the value
and the rule, so each front end names its own spelling (flag or env var).

Adding a knob: declare the field here with a default, a docstring under it, a ``Literal``
for fixed choices or ``knob(default, rule)`` for a range; the CLI flag and the env var
appear by themselves. Derived values (the resolved device and dtype) are computed by
the ``resolve_*`` methods. This module imports torch only inside those methods, so the
CLI's ``--help`` stays light.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from loraplex.adapters.config import LoRAConfig
    from loraplex.adapters.model_spec import ModelSpec
    from loraplex.adapters.spec import BaseModelSpec

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]


class ConfigError(ValueError):
    """A config value that breaks its field's rule. ``field``: the field name; ``value``: the
    value given; ``rule``: what it must be (e.g. ``"must be one of 1, 2, 4, 8, 16, 32, 64, 128"``)."""

    def __init__(self, field_name: str, value: Any, rule: str) -> None:
        super().__init__(f"EngineConfig.{field_name}={value!r}: {rule}")
        self.field = field_name
        self.value = value
        self.rule = rule

    def __reduce__(self):  # pickled to another process (engine process, replicas): rebuilt from its fields
        return type(self), (self.field, self.value, self.rule)


@dataclass(frozen=True)
class Rule:
    """A check of one field's value (``None`` of an optional field always passes)."""

    ok: Callable[[Any], bool]
    text: str
    choices: tuple[Any, ...] | None = None


def one_of(*values: Any) -> Rule:
    return Rule(lambda v: v in values, "must be one of " + ", ".join(map(str, values)), values)


def at_least(low: float) -> Rule:
    return Rule(lambda v: v >= low, f"must be >= {low}")


def greater_than(low: float) -> Rule:
    return Rule(lambda v: v > low, f"must be > {low}")


def in_range(low: float, high: float) -> Rule:
    """``low < value <= high``."""
    return Rule(lambda v: low < v <= high, f"must be in ({low}, {high}]")


def knob(default: Any, rule: Rule) -> Any:
    """A field with ``default`` whose values must satisfy ``rule``."""
    return field(default=default, metadata={"rule": rule})


POWERS_OF_TWO_TO_128 = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class EngineConfig:
    """All engine knobs (names as in vLLM); each field's docstring is its ``--help`` text."""

    model: str
    """Local HF folder (config.json + safetensors + tokenizer) or a demo model name such as smollm2-135m-instruct."""
    download_dir: str | None = None
    """Where demo models are prepared (None: ~/.cache/loraplex)."""
    dtype: DTypeName = "auto"
    """Weight/activation dtype; auto is bfloat16 on CUDA and float32 on CPU (CPU results then match HF exactly)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto picks CUDA when available."""
    seed: int = 0
    """Seed of the default random generator (requests without their own seed)."""
    block_size: int = knob(16, one_of(*POWERS_OF_TWO_TO_128))
    """Tokens per KV block."""
    gpu_memory_utilization: float = knob(0.9, in_range(0.0, 1.0))
    """Fraction of GPU memory the engine may use in total (weights + activations + KV cache)."""
    kv_cache_memory_bytes: int | None = knob(None, greater_than(0))
    """Explicit KV cache size in bytes (CPU default: max_num_seqs sequences of max_model_len tokens, at most 2 GiB)."""
    num_kv_blocks: int | None = knob(None, greater_than(0))
    """Explicit number of KV blocks (overrides both sizes; for tests)."""
    max_model_len: int | None = knob(None, greater_than(0))
    """Maximum prompt + output tokens of one sequence (None: the model's max_position_embeddings)."""
    max_num_seqs: int = knob(256, greater_than(0))
    """Maximum sequences running at once."""
    max_num_batched_tokens: int = knob(2048, greater_than(0))
    """Token budget of one step (prompt chunks and decode tokens together); longer prompts are chunked."""
    swap_space: float = knob(0.0, at_least(0))
    """GiB of host memory for swapped-out KV blocks; 0 means preemption recomputes instead of swapping."""
    enable_prefix_caching: bool = True
    """Share and keep KV blocks of identical prefixes."""
    enable_lora: bool = False
    """Serve LoRA adapters."""
    max_loras: int = knob(4, greater_than(0))
    """Adapter slots on the device (distinct adapters in one step)."""
    max_lora_rank: int = knob(16, one_of(*POWERS_OF_TWO_TO_128, 256))
    """Largest adapter rank accepted."""
    lora_page_rows: int = knob(16, one_of(*POWERS_OF_TWO_TO_128, 256))
    """Rank rows per page of the adapter weight pool (used as min(lora_page_rows, max_lora_rank)): an adapter of
    rank r takes ceil(r / lora_page_rows) pages, device memory in proportion to its own rank (S-LoRA's paging);
    lora_page_rows = max_lora_rank pads every adapter to max_lora_rank."""
    max_lora_pages: int | None = knob(None, greater_than(0))
    """Pages of the adapter weight pool (None: max_loras * max_lora_rank / page rows, room for max_loras adapters
    of max_lora_rank; at least one max_lora_rank adapter's pages). Fewer pages take less memory; an adapter whose
    pages cannot be freed from unpinned adapters waits like one without a free slot (aging included)."""
    lora_target_modules: str | None = knob(None, Rule(
        lambda v: re.fullmatch(r"\s*[A-Za-z_]+\s*(,\s*[A-Za-z_]+\s*)*", v) is not None,
        "must be module names separated by commas (e.g. q_proj,v_proj)"))
    """Comma-separated modules adapters may put LoRA on, in PEFT's names: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (qkv_proj, gate_up_proj on fused families such as Phi-3), embed_tokens, lm_head.
    None: every module. The adapter weight pool holds only these, and a layer's linear without one of them launches
    no LoRA kernel: q_proj,v_proj for q/v adapters saves the o_proj, gate_up and down_proj launches of every layer
    (benchmarks/RESULTS.md, session 14). A linear the engine computes fused is served whole (q_proj serves k_proj
    and v_proj too; gate_proj serves up_proj). Adapters on another module are refused at upload and at load, the
    setting named (as SGLang's --lora-target-modules). A name this model has no LoRA for is refused at start."""
    lora_fold_shrink: Literal["auto", "on", "off"] = "auto"
    """Where a LoRA'd linear computes its shrink (x @ A.T) at steps of at most 512 tokens: on = in its base GEMM,
    over every slot's A (one GEMM over the weight and the pool's A rows), the expand then added by the kernel
    that reads the linear's output (rotary, norm or activation): two launches fewer per linear, for the bytes of
    every slot's A whatever the batch uses; off = the SGMV shrink and expand kernels over the batch's adapters;
    auto = on for each linear whose pool A rows (every page's) are at most its base rows, in pools of at most 16
    rank rows per page (the page sizes measured; on an H200, Llama-2-7B, r=16: 32 slots on every module took a
    batch-32 decode step from 8.69 to 6.16 ms, the 512-adapter q/v row of 256 slots from +2.75 to +1.36 ms per
    decode step over the base model: benchmarks/RESULTS.md, session 17), off where a linear is row-parallel. An
    FP8 linear (auto: the same rule over bytes, its e4m3 rows half an A row's) folds where its GEMM takes split
    activations (bf16 on a compute capability 9 GPU), at steps of at most 64 tokens (the A rows stay bf16, column
    tiles after the e4m3 weight's in the same launch; on an H200 with 32 adapters a batch-32 decode step took 5.08
    ms against 7.14 with the SGMV pair, session 28, and batch 64 6.65 against 8.68, session 29); on without split
    activations is refused at start. A paged pool (lora_page_rows < max_lora_rank) folds every page; each token's
    expand reads its slot's pages through the page table. A large pool whose batches use few of its slots or pages
    reads its A for nothing: off suits it. on: needs tensor_parallel_size 1."""
    max_cpu_loras: int | None = None
    """Adapters kept in the host-memory LRU cache (None: max_loras; at least max_loras)."""
    max_full_module_slots: int = knob(0, at_least(0))
    """Device slots for adapters' modules_to_save copies of embed_tokens / lm_head, one [vocab_size, hidden_size]
    matrix each (an adapter replacing both takes two); their memory is taken before the KV cache is sized. 0:
    such adapters are refused. A waiting adapter whose copies find no free slot waits; base requests never do."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    max_adapter_wait_steps: int = knob(32, at_least(0))
    """Aging bound of adapter admission, in scheduler steps: once a request that needs an adapter slot (all
    max_loras taken) has waited this long, one running adapter admits nothing new until its slot drains and
    the waiting adapter takes it."""
    scheduling_policy: Literal["fcfs", "fair"] = "fcfs"
    """fcfs: arrival order; fair: Virtual Token Counter across tenants (Sheng et al. OSDI 2024), the
    least-served backlogged tenant's request first (loraplex.engine.fairness)."""
    fair_prompt_token_weight: float = knob(1.0, at_least(0))
    """Service weight of one computed prompt token (VTC's w_p)."""
    fair_output_token_weight: float = knob(2.0, at_least(0))
    """Service weight of one generated token (VTC's w_q)."""
    quantization: Literal["fp8"] | None = None
    """fp8: the base model's projections (q/k/v, o, gate/up, down) quantized at load to FP8 e4m3 with
    per-output-channel scales, computed as W8A16 (activations, LoRA, embeddings and LM head stay in dtype;
    loraplex.engine.models.quantization). FP8 checkpoints (fbgemm_fp8, compressed-tensors float-quantized) are
    served as stored with or without it (ModelSpec.checkpoint_quantization); other quantized checkpoints are
    refused at load."""
    tensor_parallel_size: int = knob(1, at_least(1))
    """Ranks (processes; GPUs on CUDA) one model is split over, Megatron-style (loraplex.engine.tensor_parallel);
    must divide the model's KV heads, query heads and intermediate size."""
    tensor_parallel_all_reduce: Literal["auto", "symm_mem", "nccl"] = "auto"
    """The row-parallel layers' all-reduce on CUDA: auto = one-shot on symmetric memory (symm_mem; the engine
    refuses to start where it is unavailable), nccl = NCCL (decode steps then run eagerly). On CPU: gloo."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 while step N runs on the device (LLMEngine.step); sampled tokens of N enter
    N+1 on the device. Off by default (opt-in, as vLLM's; ``loraplex serve --async-scheduling``). On an H200 it
    made decode steps 5 to 11 percent faster and the GPU busy for 0.93-0.98 of a step instead of 0.77-0.86
    (benchmarks/RESULTS.md, session 7); behind the REST API (session 9) it lowered inter-token p99 at 32
    requests/s from 39.6 to 21.7 ms and raised saturation from ~42 to ~55 requests/s, with time to first token
    p50 within 4 ms of sync up to 16 requests/s (one outlier: TTFT p99 252 ms at 4 requests/s). Not with
    tensor_parallel_size > 1."""

    def __post_init__(self) -> None:
        self.validate(dataclasses.asdict(self))
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras

    @classmethod
    def validate(cls, values: Mapping[str, Any]) -> None:
        """Check ``values`` (field name -> value; fields left out take their defaults): each value's
        type and rule, then the rules across fields. Raises :class:`ConfigError` for the first bad one
        and ``TypeError`` for an unknown field name."""
        described = {f.name: f for f in config_fields()}
        unknown = set(values) - set(described)
        if unknown:
            raise TypeError(f"EngineConfig has no field {sorted(unknown)[0]!r}")
        merged = {name: f.default for name, f in described.items()} | dict(values)
        for name, value in values.items():
            described[name].check(value)
        max_cpu_loras = merged["max_cpu_loras"] if merged["max_cpu_loras"] is not None else merged["max_loras"]
        # LoRA knobs given another value than their default with LoRA disabled (max_cpu_loras: another value than
        # max_loras, what None resolves to): refused, never ignored
        lora_knobs = [name for name in ("max_loras", "max_lora_rank", "lora_page_rows", "max_lora_pages",
                                        "max_adapter_wait_steps") if merged[name] != described[name].default]
        if max_cpu_loras != merged["max_loras"]:
            lora_knobs.append("max_cpu_loras")
        pages_per_max_rank = -(-merged["max_lora_rank"] // min(merged["lora_page_rows"], merged["max_lora_rank"]))
        across = [
            (merged["max_lora_pages"] is None or merged["max_lora_pages"] >= pages_per_max_rank, "max_lora_pages",
             f"must be >= {pages_per_max_rank}, the pages of one max_lora_rank={merged['max_lora_rank']} adapter"),
            (max_cpu_loras >= merged["max_loras"], "max_cpu_loras", f"must be >= max_loras={merged['max_loras']}"),
            (merged["fair_prompt_token_weight"] + merged["fair_output_token_weight"] > 0, "fair_output_token_weight",
             "the two token weights must not both be 0"),
            (merged["quantization"] is None or merged["tensor_parallel_size"] == 1, "quantization",
             "fp8 is not implemented with tensor_parallel_size > 1"),
            (not merged["async_scheduling"] or merged["tensor_parallel_size"] == 1, "async_scheduling",
             "is not implemented with tensor_parallel_size > 1 (the worker ranks read host token ids)"),
            (merged["max_full_module_slots"] == 0 or merged["tensor_parallel_size"] == 1, "max_full_module_slots",
             "is not implemented with tensor_parallel_size > 1 (embed_tokens / lm_head adapters are not sharded)"),
            (merged["enable_lora"] or not lora_knobs, lora_knobs[0] if lora_knobs else "enable_lora",
             "needs enable_lora (an adapter setting of an engine that serves no adapters)"),
            (merged["lora_target_modules"] is None or merged["enable_lora"], "lora_target_modules",
             "needs enable_lora"),
            (merged["lora_fold_shrink"] != "on" or merged["enable_lora"], "lora_fold_shrink", "on needs enable_lora"),
            (merged["lora_fold_shrink"] != "on" or merged["tensor_parallel_size"] == 1,
             "lora_fold_shrink", "on needs tensor_parallel_size 1 (a row-parallel linear's shrink would need its own "
             "all-reduce before the expand)"),
            (merged["max_full_module_slots"] == 0 or merged["lora_target_modules"] is None
             or bool({"embed_tokens", "lm_head"} & set(module_names(merged["lora_target_modules"]) or ())),
             "max_full_module_slots", "needs embed_tokens or lm_head in lora_target_modules (the slots hold "
             "adapters' modules_to_save copies of those modules)"),
            (merged["max_full_module_slots"] == 0 or merged["enable_lora"], "max_full_module_slots",
             "needs enable_lora (the slots hold adapters' modules_to_save copies)"),
        ]
        for ok, name, rule in across:
            if not ok:
                raise ConfigError(name, merged[name], rule)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * (1 << 30))

    def resolve_device(self) -> torch.device:
        """The device to run on; raises ``ValueError`` if CUDA is asked for but absent."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device='cuda': no CUDA device is available")
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def lora_config(self, device: torch.device) -> LoRAConfig:
        """The adapter tiers' knobs. Adapter reads run on loader threads on CUDA (disk reads stay
        out of the GPU step) and inline on CPU (deterministic tests)."""
        from loraplex.adapters.config import LoRAConfig

        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, background_loads=device.type == "cuda",
                          max_full_module_slots=self.max_full_module_slots,
                          page_rows=min(self.lora_page_rows, self.max_lora_rank), num_pages=self.max_lora_pages)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The compute dtype: ``dtype``, or bfloat16 on CUDA / float32 on CPU for ``"auto"``."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype]


def module_names(text: str | None) -> tuple[str, ...] | None:
    """A ``lora_target_modules`` value as a tuple of names, first occurrences in order (None stays None)."""
    if text is None:
        return None
    return tuple(dict.fromkeys(name.strip() for name in text.split(",")))


def served_adapter_spec(lora_target_modules: str | None, spec: ModelSpec, *, vocab: bool) -> BaseModelSpec:
    """What adapters are checked against and the pool holds: ``spec``'s modules that ``lora_target_modules``
    serves (``ModelSpec.served_adapter_spec``; ``vocab``: embed_tokens / lm_head adapters possible at all). Raises
    :class:`ConfigError` naming the field for a module the model has no LoRA for (the engine and the CLI's
    upload check call this)."""
    try:
        return spec.served_adapter_spec(module_names(lora_target_modules), vocab=vocab)
    except ValueError as exc:
        raise ConfigError("lora_target_modules", lora_target_modules, str(exc)) from None


# -- the fields, described for the front ends ------------------------------------------------------
@dataclass(frozen=True)
class ConfigField:
    """One :class:`EngineConfig` field as a front end needs it. ``type``: ``int``, ``float``,
    ``bool`` or ``str``; ``optional``: None is a valid value; ``choices``: the allowed values
    (from a ``Literal`` or a ``one_of`` rule), else None; ``help``: the field's docstring."""

    name: str
    type: type
    optional: bool
    default: Any
    choices: tuple[Any, ...] | None
    rule: Rule | None
    help: str

    def check(self, value: Any) -> None:
        """Raises :class:`ConfigError` unless ``value`` has the field's type and passes its rule."""
        if value is None:
            if not self.optional:
                raise ConfigError(self.name, value, "must not be None")
            return
        if not _has_type(value, self.type):
            raise ConfigError(self.name, value, f"must be of type {self.type.__name__}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(self.name, value, "must be one of " + ", ".join(map(str, self.choices)))
        if self.rule is not None and not self.rule.ok(value):
            raise ConfigError(self.name, value, self.rule.text)
        if self.type is str and not value:
            raise ConfigError(self.name, value, "must not be empty")

    def parse(self, text: str) -> Any:
        """``text`` (a flag or env value) as the field's type; raises :class:`ConfigError`."""
        try:
            if self.type is bool:
                lowered = text.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError(text)
                return lowered in ("true", "1", "yes", "on")
            return self.type(text)
        except ValueError:
            raise ConfigError(self.name, text, f"must be {'an' if self.type is int else 'a'} "
                                               f"{self.type.__name__}") from None


def _has_type(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def config_fields() -> list[ConfigField]:
    """Every :class:`EngineConfig` field, in declaration order."""
    global _FIELDS
    if _FIELDS is None:
        hints = typing.get_type_hints(EngineConfig)
        docs = attribute_docstrings(EngineConfig)
        _FIELDS = [_describe(f, hints[f.name], docs.get(f.name, "")) for f in dataclasses.fields(EngineConfig)]
    return _FIELDS


_FIELDS: list[ConfigField] | None = None


def _describe(f: dataclasses.Field, hint: Any, doc: str) -> ConfigField:
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    choices = None
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        hint = type(choices[0])
    rule: Rule | None = f.metadata.get("rule")
    if rule is not None and rule.choices is not None:
        choices = rule.choices
    default = None if f.default is dataclasses.MISSING else f.default
    if hint not in (int, float, bool, str):
        raise TypeError(f"EngineConfig.{f.name}: type {hint!r} has no flag/env form; use int, float, bool, str, "
                        "a Literal of them, or Optional of those")
    return ConfigField(f.name, hint, optional, default, choices, rule, " ".join(doc.split()))


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its declaration in ``cls``'s source (as vLLM's
    ``get_attr_docs``); empty when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs
