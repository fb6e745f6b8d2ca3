"""Fair service across tenants: the Virtual Token Counter (VTC).

Source: Y. Sheng, S. Cao, D. Li, B. Zhu, Z. Li, D. Zhuo, J. E. Gonzalez, I. Stoica,
"Fairness in Serving Large Language Models", OSDI 2024 (Algorithm 2).

Each tenant has a virtual counter of the weighted service it received::

    counter[t] += (prompt_token_weight * prompt_tokens_computed
                   + output_token_weight * output_tokens_generated) / weight[t]

Service is charged when the scheduler plans it (the step that computes the tokens), so the
counters equal the service actually delivered; a cached prefix (no compute) and the
recomputation of a preempted sequence are not charged. Admission takes the waiting request
of the *backlogged* tenant (one with waiting or swapped requests) with the smallest counter.
A tenant that becomes backlogged again after being idle has its counter lifted to the
smallest counter among the backlogged tenants (or, when none is backlogged, to the counter
of the tenant that left the backlog last), so idle time is not banked as credit.

Guarantee (the paper's Theorem): over any interval in which two tenants are both
backlogged, the difference of their weight-normalised service is bounded by a constant
that does not grow with the interval, about ``2 * max(prompt_token_weight * L_prompt,
output_token_weight * M)`` where ``L_prompt`` is the longest prompt and ``M`` is the number
of tokens the running batch can hold; so over long windows service splits in proportion to
the weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShare:
    """Who a request is served for: ``tenant_id`` (any string; "" = anonymous) and the
    tenant's ``weight`` (> 0; a tenant of weight 3 gets 3x the service of weight 1 when
    both are backlogged). Raises ``ValueError`` for a non-positive weight."""

    tenant_id: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"TenantShare.weight={self.weight!r}: must be > 0")


@dataclass(frozen=True)
class TenantServiceStats:
    """One tenant's scheduler state: ``num_waiting`` / ``num_running`` sequences,
    ``prompt_tokens_served`` (computed, cache hits excluded), ``output_tokens_served``,
    ``virtual_counter`` (weighted service / weight, the VTC)."""

    tenant_id: str
    weight: float
    num_waiting: int
    num_running: int
    prompt_tokens_served: int
    output_tokens_served: int
    virtual_counter: float


class VirtualTokenCounter:
    """Per-tenant virtual counters (see the module docstring). Plain bookkeeping: the
    scheduler calls :meth:`arrive` when a tenant's request enters the queue,
    :meth:`charge` for each planned piece of work, :meth:`left` when a tenant's queue
    empties."""

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> None:
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.prompt_served: dict[str, int] = {}
        self.output_served: dict[str, int] = {}
        self._last_left: float = 0.0

    def arrive(self, tenant: str, weight: float, backlogged: dict[str, int]) -> None:
        """A request of ``tenant`` enters the queue; ``backlogged`` maps tenants to their
        queued (waiting + swapped) sequences before this one. Lifts a returning tenant."""
        self.weights[tenant] = weight
        counter = self.counters.get(tenant, 0.0)
        if not backlogged.get(tenant):
            others = [self.counters.get(t, 0.0) for t, n in backlogged.items() if n and t != tenant]
            floor = min(others) if others else self._last_left
            counter = max(counter, floor)
        self.counters[tenant] = counter

    def left(self, tenant: str) -> None:
        """``tenant`` has no queued request any more."""
        self._last_left = self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Add service: ``prompt_tokens`` computed and ``output_tokens`` generated for ``tenant``."""
        if not prompt_tokens and not output_tokens:
            return
        cost = self.prompt_token_weight * prompt_tokens + self.output_token_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)
        self.prompt_served[tenant] = self.prompt_served.get(tenant, 0) + prompt_tokens
        self.output_served[tenant] = self.output_served.get(tenant, 0) + output_tokens

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)
