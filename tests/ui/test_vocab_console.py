"""The console's adapter table and upload preview show LoRA on embed_tokens / lm_head and modules_to_save copies."""

from __future__ import annotations

import pytest
from tiny_models import make_vocab_adapter

from loraplex.platform.errors import InvalidRequest
from loraplex.platform.schemas import TenantCreate
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import tenants as tenant_service
from loraplex.ui import adapters_tab
from loraplex.ui.session import ConsoleSession, acting_tenant
from ui_testlib import ADMIN_KEY

FILES = ("adapter_config.json", "adapter_model.safetensors")


def test_table_and_preview_show_vocab_targets_and_copies(ctx, tiny_llama_dir, tmp_path):
    admin = ConsoleSession(role="admin", key=ADMIN_KEY)
    with ctx.sessions() as db:
        tenant_service.create_tenant(session=db, ctx=ctx, spec=TenantCreate(name="acme", max_upload_mb=5))
    ctx.max_full_module_slots = 1  # as the engine would report with --max-full-module-slots 1
    folder = make_vocab_adapter(tiny_llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                                target_modules=["q_proj", "lm_head"], modules_to_save=["embed_tokens"])
    files = [str(folder / name) for name in FILES]
    preview = adapters_tab.check_upload(ctx, admin, "acme", "mixed", files)[1]
    assert "- targets: q_proj, lm_head in 2 layer(s)" in preview
    assert "- modules_to_save (full copies): embed_tokens" in preview
    table = adapters_tab.confirm_upload(ctx, admin, "acme", "mixed", files)[0]
    with ctx.sessions() as db:
        [listed] = adapter_service.list_adapters(session=db, tenant_id=acting_tenant(ctx, admin, "acme").tenant_id)
    assert (listed.target_modules, listed.modules_to_save) == (["q_proj", "lm_head"], ["embed_tokens"])
    row = table.to_dict("records")[0]
    assert (row["type"], row["target modules"], row["modules_to_save"]) == ("lora", "q_proj, lm_head", "embed_tokens")
    ctx.max_full_module_slots = 0
    with pytest.raises(InvalidRequest, match="needs 1 full-module slot\\(s\\) .* max_full_module_slots=0"):
        adapters_tab.check_upload(ctx, admin, "acme", "mixed", files)


def test_dora_adapter_with_a_copy_lists_both_columns_and_dora_on_the_head_is_refused(ctx, tiny_llama_dir, tmp_path):
    admin = ConsoleSession(role="admin", key=ADMIN_KEY)
    with ctx.sessions() as db:
        tenant_service.create_tenant(session=db, ctx=ctx, spec=TenantCreate(name="acme", max_upload_mb=5))
    ctx.max_full_module_slots = 1
    folder = make_vocab_adapter(tiny_llama_dir, tmp_path / "d", 2, r=4, lora_alpha=8, target_modules=["q_proj"],
                                modules_to_save=["lm_head"], use_dora=True)
    files = [str(folder / name) for name in FILES]
    preview = adapters_tab.check_upload(ctx, admin, "acme", "dora-head", files)[1]
    assert "valid PEFT DoRA adapter" in preview and "- modules_to_save (full copies): lm_head" in preview
    row = adapters_tab.confirm_upload(ctx, admin, "acme", "dora-head", files)[0].to_dict("records")[0]
    assert (row["type"], row["target modules"], row["modules_to_save"]) == ("dora", "q_proj", "lm_head")
    refused = make_vocab_adapter(tiny_llama_dir, tmp_path / "r", 3, r=4, lora_alpha=8,
                                 target_modules=["q_proj", "lm_head"], use_dora=True)
    with pytest.raises(InvalidRequest, match="use_dora=true with LoRA on lm_head .*DoRA on embed_tokens / lm_head is "
                                             "not served"):
        adapters_tab.check_upload(ctx, admin, "acme", "dora-lm", [str(refused / name) for name in FILES])
    ctx.max_full_module_slots = 0
