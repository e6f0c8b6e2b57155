"""Memory retention: what ``keel memory prune`` and ``keel serve``'s pruning task delete.

A tenant's policy ([`RetentionPolicy`][keel.memory.RetentionPolicy], its own or the ``"*"``
one) limits each kind of memory (episodic, semantic, procedural) by age, by count per user, or
both. Pruning is deletes only, each idempotent (a record past the policy is deleted by whoever
gets there first), so several workers may prune the same database at once without a lease:
the second finds nothing left to do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from keel.memory._config import RetentionPolicies
from keel.memory._store import MemoryStore

__all__ = ["PruneReport", "prune_memory"]


@dataclass(frozen=True)
class PruneReport:
    """What one pruning deleted: records by tenant and kind."""

    removed: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every record deleted."""
        return sum(sum(kinds.values()) for kinds in self.removed.values())


def prune_memory(
    store: MemoryStore,
    policies: RetentionPolicies,
    *,
    tenant_id: str | None = None,
    now: float | None = None,
) -> PruneReport:
    """Apply each tenant's retention policy to ``store`` (only ``tenant_id``'s when given);
    what went. A tenant without a policy (nor a ``"*"`` one) keeps everything."""
    if policies.empty:
        return PruneReport()
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    tenants = [tenant_id] if tenant_id is not None else store.tenants()
    removed: dict[str, dict[str, int]] = {}
    for tenant in tenants:
        policy = policies.for_tenant(tenant)
        if policy is None:
            continue
        for kind, rule in policy.rules().items():
            before = (
                None if rule.max_age_days is None else moment - timedelta(days=rule.max_age_days)
            )
            count = store.prune(tenant, kind, before=before, keep=rule.max_count)
            if count:
                removed.setdefault(tenant, {})[kind] = count
    return PruneReport(removed=removed)
