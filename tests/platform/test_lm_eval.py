"""lm-evaluation-harness (``lm_eval``, model ``local-completions``) against the live server,
as teams evaluate adapters (issue 23): a local multiple-choice task (YAML + JSONL written
here, no hub download) once on the base model and once on an adapter, and a
``generate_until`` task. References: HF transformers (+ PEFT) in fp32 with the same
context/continuation split lm-eval uses, and HF greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
from platform_testlib import adapter_members, make_peft_adapter, new_tenant, zip_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

SUBJECTS = ["Paris", "Berlin", "The fox", "The dog", "Red", "Numbers", "A model", "LoRA"]
CHOICES = [["is a city.", "is a color.", "jumps."], ["blue", "green", "red"], ["one", "two", "three", "four"]]


def _items() -> list[dict]:
    items = []
    for i in range(30):
        choices = CHOICES[i % 3]
        items.append({"question": f"{SUBJECTS[i % len(SUBJECTS)]} {i}:", "choices": choices,
                      "answer": i % len(choices)})
    return items


def _write_tasks(folder) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(item) + "\n" for item in _items()))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "reference": "x"}) + "\n"
                                              for p in ["The quick brown", "Paris is", "你好", "def add(a, b):"]))
    (folder / "loraplex_mc.yaml").write_text(f"""task: loraplex_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (folder / "loraplex_gen.yaml").write_text(f"""task: loraplex_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: reference
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("lm-eval-adapter"), seed=9)


def _reference_model(model_dir, adapter_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """As lm-eval splits: context tokens, then the rest of the whole string's tokens."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def _evaluate(live_url: str, model: str, tokenizer_dir, tasks_dir, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{live_url}/v1/completions", "tokenizer": str(tokenizer_dir),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
                    "batch_size": 4, "max_length": 256},
        tasks=tasks, task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.mark.parametrize("model", ["tiny", "style"])
def test_lm_eval_loglikelihoods_equal_transformers(serve, tiny_llama_dir, adapter_dir, tmp_path, monkeypatch,
                                                   model):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    live = serve()
    key = new_tenant(live, "acme")
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "style"},
                              files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")})
        assert response.status_code == 201, response.text
    monkeypatch.setenv("OPENAI_API_KEY", key)
    _write_tasks(tmp_path)
    results = _evaluate(live.url, model, tiny_llama_dir, tmp_path, ["loraplex_mc", "loraplex_gen"])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    reference = _reference_model(tiny_llama_dir, adapter_dir if model == "style" else None)

    samples = results["samples"]["loraplex_mc"]
    assert len(samples) == 30
    correct = 0
    for sample in samples:
        got = [resp[0][0] for resp in sample["resps"]]
        expected = [_loglikelihood(reference, tokenizer, *args) for args in sample["arguments"]]
        assert got == pytest.approx(expected, abs=1e-4)
        correct += int(max(range(len(expected)), key=expected.__getitem__) == sample["doc"]["answer"])
    assert results["results"]["loraplex_mc"]["acc,none"] == pytest.approx(correct / 30)
    if model == "style":  # the adapter really changes the scores
        base = _reference_model(tiny_llama_dir, None)
        first = samples[0]["arguments"][0]
        assert abs(_loglikelihood(base, tokenizer, *first) - samples[0]["resps"][0][0][0]) > 1e-2

    generated = results["samples"]["loraplex_gen"]
    assert len(generated) == 4 and any(sample["resps"][0][0] for sample in generated)
    for sample in generated:
        prompt = sample["arguments"][0][0]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                     dtype=torch.long), max_new_tokens=8, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == text
