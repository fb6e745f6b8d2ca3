"""Typed errors of the adapters package.

Every message names the offending field (or file / tensor) and its value, e.g.
``adapter_config.json: r=64 exceeds max_lora_rank=16``, so the platform can
return it to the uploader unchanged.

- ``AdapterError(ValueError)``: base of every refusal of an adapter.
  - ``AdapterFormatError``: the folder is not a well-formed PEFT LoRA adapter
    (missing / corrupt / truncated files, bad config values, tensors that
    disagree with the config, an A without its B, NaN/Inf values).
  - ``AdapterIncompatibleError``: a well-formed adapter that does not fit this
    base model or engine (wrong hidden size, layer index beyond the model, rank
    above ``max_lora_rank``, modules the model does not have).
  - ``AdapterUnsupportedError``: a PEFT feature loraplex does not serve (pickle
    weights, LoRA variants other than DoRA, DoRA with tensor parallelism, ``modules_to_save``, LoRA on
    ``embed_tokens`` / ``lm_head``, ``bias`` other than ``"none"``).
  - ``AdapterNotServedError`` (both of the two above): a well-formed adapter that this server's settings do
    not serve (``lora_target_modules``, ``max_lora_rank``, ``max_full_module_slots``, tensor parallelism); a
    server started with other settings would. Its files are not at fault; ``reason`` is the message without
    the engine's adapter label.
  - ``AdapterConflictError``: a registration clashes with a known adapter
    (same int id with another name or path, same name under another int id).
  - ``UnknownAdapterError``: an int id that is not registered (or is being
    removed).
  - ``AdapterChangedError``: an adapter re-read from disk no longer has the
    ``version_id`` it was registered with.
- ``SlotPoolError(RuntimeError)``: misuse of the slot pool (unpin without pin).
  - ``NoFreeSlotError``: every GPU adapter slot, or the weight pages the adapter
    needs, are held by pinned adapters; the caller (scheduler) should wait until a
    request finishes.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base class: the adapter cannot be accepted; the message says why."""


class AdapterFormatError(AdapterError):
    """The folder is not a well-formed PEFT LoRA adapter."""


class AdapterIncompatibleError(AdapterError):
    """The adapter does not fit the base model or the engine's limits."""


class AdapterUnsupportedError(AdapterError):
    """The adapter uses a PEFT feature that loraplex does not serve."""


class AdapterNotServedError(AdapterIncompatibleError, AdapterUnsupportedError):
    """A well-formed adapter this server's settings do not serve; ``reason``: why, without the adapter's label
    (the platform shows it to the tenant)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason

    def __reduce__(self):  # pickled to the gateway (engine process, replicas) with its reason
        return type(self), (str(self), self.reason)


class AdapterConflictError(AdapterError):
    """A registration clashes with an adapter already known to the pool."""


class UnknownAdapterError(AdapterError):
    """The int id is not registered (or is being removed)."""


class AdapterChangedError(AdapterError):
    """The files on disk no longer match the registered ``version_id``."""


class SlotPoolError(RuntimeError):
    """The slot pool was used against its protocol (e.g. unpin without pin)."""


class NoFreeSlotError(SlotPoolError):
    """Every adapter slot is pinned by running requests of other adapters."""
