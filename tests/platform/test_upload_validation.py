"""Every bad upload gets a 4xx naming the problem and leaves no DB row and no file."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import pytest
import torch
from platform_testlib import (
    adapter_members,
    make_peft_adapter,
    new_tenant,
    stored_state,
    tar_gz_bytes,
    zip_bytes,
)
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory):
    return adapter_members(make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("good"), r=4))


@pytest.fixture(scope="module")
def dora(tiny_llama_dir, tmp_path_factory):
    return adapter_members(make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("dora"), r=4, use_dora=True))


@pytest.fixture(scope="module")
def alora(good):
    """A LoRA variant still refused: Activated LoRA (``alora_invocation_tokens``)."""
    config = json.loads(good["adapter_config.json"]) | {"alora_invocation_tokens": [1, 2]}
    return {**good, "adapter_config.json": json.dumps(config).encode()}


@pytest.fixture(scope="module")
def rank16(tiny_llama_dir, tmp_path_factory):
    return adapter_members(make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("r16"), r=16))


@pytest.fixture(scope="module")
def wrong_shapes(good, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    (folder / "in.safetensors").write_bytes(good["adapter_model.safetensors"])
    tensors = load_file(str(folder / "in.safetensors"))
    name = next(n for n in tensors if "q_proj.lora_A" in n)
    tensors[name] = torch.randn(4, 32)  # hidden size 32, the model has 64
    save_file(tensors, str(folder / "out.safetensors"))
    return {**good, "adapter_model.safetensors": (folder / "out.safetensors").read_bytes()}


def zip_with(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for info, data in entries:
            archive.writestr(info, data)
    return buf.getvalue()


def zip_info(name: str, mode: int = 0o100644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo()
    info.filename = name  # set directly: the constructor would not keep a leading '/'
    info.external_attr = mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def tar_with(entries: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for info, data in entries:
            info.size = len(data) if info.isreg() else 0
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def long_name_tar_bomb(good: dict[str, bytes]) -> bytes:
    """A GNU long-name header of 3 MB: tarfile would read it into memory as the member's name."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as archive:
        for name, data in [("a" * 3_000_000, b"x"), *good.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def archive(data: bytes, filename: str = "a.zip", content_type: str = "application/zip") -> dict:
    return {"files": {"file": (filename, data, content_type)}}


def two_files(config: bytes, weights: bytes, weights_name: str = "adapter_model.safetensors") -> dict:
    return {"files": [("files", ("adapter_config.json", config, "application/json")),
                      ("files", (weights_name, weights, "application/octet-stream"))]}


def cases(good, alora, rank16, wrong_shapes) -> dict[str, tuple[dict, int, str]]:
    cfg, weights = good["adapter_config.json"], good["adapter_model.safetensors"]
    zeros = bytes(8 * 10**6)
    return {
        "pickle .bin weights": (two_files(cfg, weights, "adapter_model.bin"), 415, "safetensors only"),
        "pickle .bin in archive": (archive(zip_bytes({"adapter_config.json": cfg, "adapter_model.bin": weights})),
                                   415, "safetensors only"),
        "aLoRA variant": (archive(zip_bytes(alora)), 400, "Activated LoRA (aLoRA)"),
        "rank above max_lora_rank": (archive(zip_bytes(rank16)), 400, "max_lora_rank"),
        "wrong shapes": (archive(zip_bytes(wrong_shapes)), 400, "q_proj"),
        "corrupt safetensors": (two_files(cfg, weights[: len(weights) // 2]), 400, "adapter_model.safetensors"),
        "corrupt config": (two_files(b"{not json", weights), 400, "adapter_config.json"),
        "zip ../ traversal": (archive(zip_with([(zip_info("../adapter_config.json"), cfg),
                                                (zip_info("adapter_model.safetensors"), weights)])), 400, "traversal"),
        "tar ../ traversal": (archive(tar_with([(tar_info("x/../../adapter_config.json"), cfg),
                                                (tar_info("adapter_model.safetensors"), weights)]), "a.tar.gz",
                                      "application/gzip"), 400, "traversal"),
        "zip absolute path": (archive(zip_with([(zip_info("/tmp/adapter_config.json"), cfg),
                                                (zip_info("adapter_model.safetensors"), weights)])), 400, "absolute"),
        "tar absolute path": (archive(tar_with([(tar_info("/tmp/adapter_config.json"), cfg),
                                                (tar_info("adapter_model.safetensors"), weights)]), "a.tar.gz",
                                      "application/gzip"), 400, "absolute"),
        "zip symlink member": (archive(zip_with([(zip_info("adapter_config.json", 0o120777), b"/etc/passwd"),
                                                 (zip_info("adapter_model.safetensors"), weights)])), 400, "symlink"),
        "tar symlink member": (archive(tar_with([(tar_info("adapter_config.json", tarfile.SYMTYPE, "/etc/passwd"), b""),
                                                 (tar_info("adapter_model.safetensors"), weights)]), "a.tar.gz",
                                       "application/gzip"), 400, "symlink"),
        "tar hard link member": (archive(tar_with([(tar_info("adapter_config.json", tarfile.LNKTYPE, "x"), b""),
                                                   (tar_info("adapter_model.safetensors"), weights)]), "a.tar.gz",
                                         "application/gzip"), 400, "hard link"),
        "zip bomb": (archive(zip_bytes({"adapter_config.json": cfg, "adapter_model.safetensors": zeros})),
                     413, "uncompressed"),
        "tar.gz bomb": (archive(tar_gz_bytes({"adapter_config.json": cfg, "adapter_model.safetensors": zeros}),
                                "a.tar.gz", "application/gzip"), 413, "bytes"),
        "tar.gz long-name bomb": (archive(long_name_tar_bomb(good), "a.tar.gz", "application/gzip"), 413,
                                  "decompresses to more than"),
        "too many members": (archive(zip_bytes({**good, **{f"doc{i}.txt": b"x" for i in range(20)}})), 413,
                             "members"),
        "missing config": (archive(zip_bytes({"adapter_model.safetensors": weights})), 400, "adapter_config.json"),
        "wrong content type": (archive(zip_bytes(good), content_type="text/html"), 415, "text/html"),
        "not an archive": (archive(b"hello, not an archive", "a.zip", "application/octet-stream"), 415,
                           "neither a .zip nor a .tar.gz"),
        "three files": ({"files": [("files", (n, b"x", "application/octet-stream")) for n in ("a", "b", "c")]}, 400,
                        "got 3 files"),
    }


CASE_NAMES = ["pickle .bin weights", "pickle .bin in archive", "aLoRA variant", "rank above max_lora_rank",
              "wrong shapes", "corrupt safetensors", "corrupt config", "zip ../ traversal", "tar ../ traversal", "zip absolute path",
              "tar absolute path", "zip symlink member", "tar symlink member", "tar hard link member", "zip bomb",
              "tar.gz bomb", "tar.gz long-name bomb", "too many members", "missing config", "wrong content type",
              "not an archive", "three files"]


@pytest.fixture(scope="module")
def all_cases(good, alora, rank16, wrong_shapes):
    built = cases(good, alora, rank16, wrong_shapes)
    assert sorted(built) == sorted(CASE_NAMES)
    return built


@pytest.fixture
def live(serve):
    live = serve()
    new_tenant(live, "acme", max_upload_mb=2)
    return live


def test_bad_uploads_are_refused_and_store_nothing(live, all_cases):
    failures = []
    with live.admin() as admin:
        for name in CASE_NAMES:
            request, status, needle = all_cases[name]
            response = admin.post("/admin/tenants/acme/adapters", data={"name": "bad"}, **request)
            error = response.json().get("error", {})
            if response.status_code != status or needle.lower() not in error.get("message", "").lower():
                failures.append(f"{name}: {response.status_code} {error}")
            if stored_state(live) != (0, 0, []):
                failures.append(f"{name}: left {stored_state(live)}")
    assert not failures, "\n".join(failures)


def test_size_limits(live, good):
    with live.admin() as admin:
        assert admin.post("/admin/tenants", json={"name": "small", "max_upload_mb": 0.001}).status_code == 201
        response = admin.post("/admin/tenants/small/adapters", data={"name": "a"},
                              **archive(zip_bytes(good)))
        assert response.status_code == 413 and "limit is 1000 bytes" in response.json()["error"]["message"]
        # a JSON body instead of a multipart form
        response = admin.post("/admin/tenants/acme/adapters", json={"name": "a"})
        assert response.status_code == 415 and "multipart/form-data" in response.json()["error"]["message"]
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "a"})
        assert response.status_code in (400, 415)
    assert stored_state(live) == (0, 0, [])


def test_one_plain_peft_file_alone_is_named_as_such(live, good):
    """One of the two PEFT files sent alone: a 400 saying the other is missing, not "not an archive"."""
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "half"}, files={
            "files": ("adapter_config.json", good["adapter_config.json"], "application/json")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "files" and "adapter_model.safetensors" in error["message"]
    assert stored_state(live) == (0, 0, [])


def test_a_tenant_upload_limit_above_the_server_cap_is_refused(live, serve):
    """The server's ``max_upload_mb`` caps every upload: a tenant limit above it would be shown but never
    served, so it is refused (create, update); the settings' tenant default is capped the same way."""
    cap = live.ctx.settings.max_upload_mb
    with live.admin() as admin:
        created = admin.post("/admin/tenants", json={"name": "big", "max_upload_mb": cap + 1})
        patched = admin.patch("/admin/tenants/acme", json={"max_upload_mb": cap * 10})
        at_cap = admin.patch("/admin/tenants/acme", json={"max_upload_mb": cap})
        names = [t["name"] for t in admin.get("/admin/tenants").json()]
    for response in (created, patched):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "max_upload_mb"
        assert "LORAPLEX_MAX_UPLOAD_MB" in response.json()["error"]["message"]
    assert "big" not in names
    assert at_cap.status_code == 200 and at_cap.json()["max_upload_mb"] == cap
    small = serve(max_upload_mb=3, default_tenant_max_upload_mb=11)
    with small.admin() as admin:
        assert admin.post("/admin/tenants", json={"name": "default"}).json()["max_upload_mb"] == 3


def test_validate_upload_checks_without_storing(live, good, rank16):
    from loraplex.platform.errors import InvalidRequest
    from loraplex.platform.services.adapters import validate_upload
    from loraplex.platform.services.tenants import tenant_context
    from loraplex.platform.services.uploads import UploadPart

    ctx = live.ctx
    with ctx.sessions() as session:
        owner = tenant_context(session=session, name="acme")

    def parts(members):
        data = zip_bytes(members)
        return [UploadPart("a.zip", "application/zip", io.BytesIO(data), len(data))]

    info = validate_upload(ctx=ctx, tenant=owner, name="preview", parts=parts(good))
    assert (info.rank, len(info.version_id)) == (json.loads(good["adapter_config.json"])["r"], 64)
    with pytest.raises(InvalidRequest, match="max_lora_rank"):
        validate_upload(ctx=ctx, tenant=owner, name="preview", parts=parts(rank16))
    assert stored_state(live) == (0, 0, [])


def test_valid_upload_still_works_after_refusals(live, good):
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "ok"}, **archive(zip_bytes(good)))
    assert response.status_code == 201, response.text
    assert json.loads(good["adapter_config.json"])["r"] == response.json()["rank"]
    assert stored_state(live)[:2] == (1, 1)


def test_dora_upload_is_accepted_listed_as_dora_and_served(live, good, dora):
    """A DoRA adapter (PEFT ``use_dora=True``) passes upload validation; the registry records its type."""
    key = new_tenant(live, "dora-tenant", max_upload_mb=2)
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "d"}, **archive(zip_bytes(dora)))
        assert response.status_code == 201, response.text
        assert response.json()["adapter_type"] == "dora"
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "l"}, **archive(zip_bytes(good)))
        assert response.status_code == 201 and response.json()["adapter_type"] == "lora"
        listed = admin.get("/admin/tenants/acme/adapters").json()
    rows = listed["data"] if isinstance(listed, dict) else listed
    assert {row["name"]: row["adapter_type"] for row in rows} == {"d": "dora", "l": "lora"}
    assert stored_state(live)[:2] == (2, 2)
    with live.admin() as admin:
        response = admin.post("/admin/tenants/dora-tenant/adapters", data={"name": "d"}, **archive(zip_bytes(dora)))
        assert response.status_code == 201, response.text
    with live.tenant(key) as client:
        done = client.post("/v1/completions", json={"model": "d", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert done.status_code == 200, done.text


def test_a_worker_whose_server_went_away_exits_quietly():
    """The server shut down while a check ran (its end of the pipe closed): the worker's reply finds a broken pipe,
    which it ignores instead of dying with a traceback."""
    import multiprocessing

    import torch

    from loraplex.platform.services.validation import _worker_main

    threads = torch.get_num_threads()
    receiver, sender = multiprocessing.Pipe(duplex=False)
    receiver.close()
    try:
        _worker_main(sender, str, "job", None)  # returns: no BrokenPipeError
    finally:
        torch.set_num_threads(threads)
    assert sender.closed
