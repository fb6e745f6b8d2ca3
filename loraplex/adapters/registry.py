"""Registered adapters and the version rules of registration.

The int id is the identity: one name may be registered under several ids (a re-uploaded
adapter's new version gets a new id while requests on the old one finish); one id never
changes its name, path or ``version_id``. A removed adapter that accepted requests still hold
(``holds``: queued or running, not finished) or running requests pin stays registered, marked
``pending_removal``: it accepts no new requests, and the requests it accepted finish on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.adapters.errors import AdapterConflictError, UnknownAdapterError
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import (
    AdapterLayout,
    FileSignature,
    pack_layout,
    pack_stored,
    unpack_layout,
    unpack_stored,
)
from loraplex.adapters.tensor_file import StoredTensor


@dataclass
class Registration:
    """``signature``: the files' stat when registered or last verified (``None``: could not stat);
    ``layout``: the header checks' result, reused by reads while the signature holds;
    ``verified``: the content was hashed and matched ``version_id`` under ``signature``
    (change detection: later reads trust ``version_id`` while the signature is unchanged);
    ``stored``: the safetensors header's tensors (``stored_tensors``) as parsed by the last read, under
    ``signature`` (later reads under the same signature skip parsing it);
    ``holds``: accepted requests on it that have not finished (``LoRASlotPool.hold`` / ``release``).

    ``layout`` and ``stored`` are kept packed (``peft_format.pack_layout`` / ``pack_stored``: tuples the
    garbage collector does not walk) and rebuilt on each access: read them once per read, on the reading
    thread (``read_state``)."""

    request: LoRARequest
    version_id: str
    signature: FileSignature | None
    pending_removal: bool = field(default=False, kw_only=True)
    verified: bool = field(default=False, kw_only=True)
    holds: int = field(default=0, kw_only=True)
    _layout: tuple | None = field(default=None, repr=False, kw_only=True)
    _stored: tuple | None = field(default=None, repr=False, kw_only=True)

    @property
    def layout(self) -> AdapterLayout | None:
        return None if self._layout is None else unpack_layout(self._layout)

    @layout.setter
    def layout(self, layout: AdapterLayout | None) -> None:
        self._layout = None if layout is None else pack_layout(layout)

    def read_state(self) -> tuple[tuple | None, tuple | None]:
        """``(packed layout, packed stored)`` for a read on another thread (``AdapterLoader._read`` unpacks
        them there: rebuilding ~200 objects per adapter is not the scheduler thread's work)."""
        return self._layout, self._stored

    @property
    def stored(self) -> dict[str, StoredTensor] | None:
        return None if self._stored is None else unpack_stored(self._stored)

    @stored.setter
    def stored(self, stored: dict[str, StoredTensor] | None) -> None:
        self._stored = None if stored is None else pack_stored(stored)


class AdapterRegistry:
    """Registrations by int id."""

    def __init__(self) -> None:
        self._by_id: dict[int, Registration] = {}

    def get(self, int_id: int) -> Registration | None:
        return self._by_id.get(int_id)

    def add(self, registration: Registration) -> None:
        self._by_id[registration.request.lora_int_id] = registration

    def remove(self, int_id: int) -> None:
        del self._by_id[int_id]

    def accepting(self, int_id: int) -> Registration:
        """The registration of ``int_id`` if it accepts new requests.

        Raises ``UnknownAdapterError`` (not registered, or being removed).
        """
        registration = self._by_id.get(int_id)
        if registration is None:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is not registered")
        if registration.pending_removal:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is being removed and accepts no new requests")
        return registration

    def usable(self, int_id: int) -> Registration:
        """The registration of ``int_id`` if requests may use it: it accepts new requests, or it is being removed
        and requests it accepted earlier still hold it (they finish on it).

        Raises ``UnknownAdapterError`` (not registered, or being removed with no request holding it).
        """
        registration = self._by_id.get(int_id)
        if registration is not None and registration.pending_removal and registration.holds > 0:
            return registration
        return self.accepting(int_id)

    def version_id(self, int_id: int) -> str:
        """Raises ``UnknownAdapterError`` if ``int_id`` is not registered."""
        registration = self._by_id.get(int_id)
        if registration is None:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is not registered")
        return registration.version_id

    def name(self, int_id: int) -> str:
        return self._by_id[int_id].request.lora_name

    def items(self, *, pending_removal: bool) -> list[tuple[int, Registration]]:
        """Registrations by int id, those being removed or those accepting requests."""
        return [(i, r) for i, r in sorted(self._by_id.items()) if r.pending_removal == pending_removal]

    @staticmethod
    def check_same(known: Registration, request: LoRARequest) -> None:
        """Version rules: ``request`` re-registers ``known`` (same int id) only with the same name,
        path and (when declared) ``version_id``, and not while it is being removed.

        Raises ``AdapterConflictError`` naming the clashing field.
        """
        if known.pending_removal:
            raise AdapterConflictError(
                f"LoRARequest.lora_int_id={request.lora_int_id} is being removed (requests it accepted are still queued "
                "or running)"
            )
        for field_name in ("lora_name", "lora_path"):
            old, new = getattr(known.request, field_name), getattr(request, field_name)
            if old != new:
                raise AdapterConflictError(
                    f"LoRARequest.{field_name}={new!r}: lora_int_id={request.lora_int_id} is already registered "
                    f"with {field_name}={old!r}"
                )
        if request.version_id is not None and request.version_id != known.version_id:
            raise AdapterConflictError(
                f"LoRARequest.version_id={request.version_id!r}: lora_int_id={request.lora_int_id} is already "
                f"registered with version_id={known.version_id!r}"
            )
