"""Issue 14 item 14: every upload field, fuzzed (hypothesis): the answer is a 4xx (or 201)
in the OpenAI error format, never a 5xx. Fields: the form's ``name``, one archive or two
files, their file names and content types, the config (a valid one with one field replaced
by any JSON value, deep nesting up to 100,000 levels, numbers past Python's limits, raw
bytes) and the weights (valid, truncated, a forged header, raw bytes)."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile

import httpx
import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from platform_testlib import adapter_members, make_peft_adapter, make_settings, new_tenant, run_server

CONFIG_FIELDS = ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "layers_to_transform",
                 "exclude_modules", "use_rslora", "peft_type", "bias", "use_dora", "modules_to_save",
                 "init_lora_weights", "fan_in_fan_out", "unknown_field"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def fuzz_live(tiny_llama_dir, tmp_path_factory):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.platform.main import create_app

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    num_kv_blocks=64, max_num_seqs=4))
    live = run_server(create_app(make_settings(tmp_path_factory.mktemp("fuzz"), served_model_name="tiny"), engine))
    live.key = new_tenant(live, "fuzz", max_adapters=10_000, max_upload_mb=1)
    live.members = adapter_members(make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("a"), r=4))
    yield live
    live.stop()


@st.composite
def configs(draw, valid: bytes) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "nested", "big number", "bytes", "valid"]))
    if kind == "field":
        config = json.loads(valid)
        config[draw(st.sampled_from(CONFIG_FIELDS))] = draw(json_values)
        return json.dumps(config).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([1, 31, 32, 33, 1000, 100_000]))
        opener = draw(st.sampled_from([b"[", b'{"a":']))
        closer = b"]" if opener == b"[" else b"}"
        return opener * depth + b"1" + closer * depth
    if kind == "big number":
        return b'{"r": 4, "lora_alpha": 1' + b"0" * draw(st.sampled_from([300, 400, 5000])) + b', "target_modules": ["q_proj"]}'
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return valid


@st.composite
def weights(draw, valid: bytes) -> bytes:
    kind = draw(st.sampled_from(["valid", "truncated", "forged header", "bytes"]))
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid)))]
    if kind == "forged header":
        header = json.dumps(draw(st.dictionaries(st.text(max_size=20), json_values, max_size=3))).encode()
        length = draw(st.sampled_from([len(header), 0, 2**63, len(header) + 5]))
        return struct.pack("<Q", length % 2**64) + header + draw(st.binary(max_size=64))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return valid


def archive(kind: str, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w") as out:
            for name, data in members.items():
                out.writestr(name, data)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz") as out:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
    return buf.getvalue()


text = st.text(max_size=80)


@st.composite
def uploads(draw, members: dict[str, bytes]) -> tuple[dict, list]:
    """One field fuzzed, the others valid (so the fuzzed one is what the server has to judge)."""
    fuzzed = draw(st.sampled_from(["name", "file names", "content type", "form", "config", "config", "config",
                                   "weights", "weights"]))
    config, tensors = members["adapter_config.json"], members["adapter_model.safetensors"]
    name, names, form, content_type = "ok", ("adapter_config.json", "adapter_model.safetensors"), "zip", None
    if fuzzed == "config":
        config = draw(configs(config))
    elif fuzzed == "weights":
        tensors = draw(weights(tensors))
    elif fuzzed == "name":
        name = draw(st.one_of(st.sampled_from(["a" * 64, "a" * 65, "", "../x", "tiny", "a\x00b"]), text))
    elif fuzzed == "file names":
        names = draw(st.tuples(text, text))
    elif fuzzed == "content type":
        content_type = draw(text)
    else:
        form = draw(st.sampled_from(["tar.gz", "two files", "raw"]))
    if form == "two files":
        files = [("files", (names[0], config, content_type or "application/json")),
                 ("files", (names[1], tensors, content_type or "application/octet-stream"))]
    elif form == "raw":
        files = [("file", ("adapter.zip", tensors, content_type or "application/zip"))]
    else:
        try:
            packed = archive(form, dict(zip(names, (config, tensors))))
        except (ValueError, IndexError, UnicodeError):  # zipfile / tarfile cannot write such member names
            reject()
        files = [("file", ("adapter." + form, packed, content_type or "application/octet-stream"))]
    return {"name": name}, files


def test_no_upload_field_gives_a_server_error(fuzz_live):
    nested = {**fuzz_live.members, "adapter_config.json": b"[" * 100_000 + b"]" * 100_000}

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(uploads(fuzz_live.members))
    @example(({"name": "ok"}, [("file", ("a.zip", archive("zip", nested), "application/zip"))]))  # the issue's
    def check(upload):
        data, files = upload
        try:
            with fuzz_live.tenant(fuzz_live.key) as client:
                response = client.post("/v1/adapters", data=data, files=files)
        except (httpx.LocalProtocolError, UnicodeEncodeError, ValueError, TypeError):
            reject()  # the client itself cannot send this (e.g. a newline in a header value)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]

    check()
