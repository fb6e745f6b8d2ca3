"""One kernel op: its semantics, written once, and its two implementations of one signature.

Each op file ends with an :class:`Op`: ``reference`` is the public plain-torch
function whose signature and docstring (shapes, dtypes, errors) are the op's;
``triton`` is the launcher of the Triton kernel, taking the same arguments
(plus, at most, keyword-only launch overrides with defaults, for benchmarks).
:class:`~loraplex.kernels.ops.Kernels` binds every op to one backend.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

Backend = Literal["triton", "reference"]
BACKENDS: tuple[Backend, ...] = ("triton", "reference")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Op(Generic[F]):
    """A kernel op and its implementations.

    Attributes:
        name: the op's name (used in error messages).
        semantics: the op's meaning in index notation, e.g. ``out[t] = silu(x[t, :I]) * x[t, I:]``.
        reference: plain-torch implementation; its signature and docstring document the op.
        triton: Triton launcher with the reference's parameters (same names, kinds and defaults);
            extra parameters must be keyword-only with defaults.

    Raises:
        TypeError: at construction, when the launcher's parameters differ from the reference's.
    """

    name: str
    semantics: str
    reference: F
    triton: F

    def __post_init__(self) -> None:
        ref = list(inspect.signature(self.reference).parameters.values())
        tri = list(inspect.signature(self.triton).parameters.values())
        extra = tri[len(ref) :]
        same = [(p.name, p.kind, p.default) for p in ref] == [(p.name, p.kind, p.default) for p in tri[: len(ref)]]
        if not same or any(p.kind is not p.KEYWORD_ONLY or p.default is p.empty for p in extra):
            raise TypeError(f"op {self.name}: triton launcher parameters {tri} do not extend the reference's {ref}")

    def select(self, backend: Backend) -> F:
        """The implementation of ``backend`` ("triton" or "reference")."""
        return self.triton if backend == "triton" else self.reference
