"""Retention: what ``vacuum()`` deletes (expired sessions, history past the policy) and how a
kept delta whose predecessor goes is rebased as a full snapshot."""

from __future__ import annotations

import time
from dataclasses import replace

from keel.errors import ExpiredError
from keel.state._backend import StateBackend, StoredCheckpoint
from keel.state._checkpoint import Retention, VacuumReport
from keel.state._delta import encode_full, replay

__all__ = ["drop_rows", "vacuum"]


def vacuum(
    backend: StateBackend, retention: Retention, *, now: float | None = None
) -> VacuumReport:
    """Vacuum a backend without knowing its state types (operators, ``keel state vacuum``).

    Deletes expired sessions and applies ``retention`` to every session; kept deltas whose
    predecessor goes are rebased as full snapshots. The head and the newest good checkpoint of
    every session are always kept.
    """
    now = time.time() if now is None else now
    expired = backend.purge_expired(now)
    deleted = rebased = 0
    if retention.keep_last is None and retention.max_age_s is None:
        return VacuumReport(expired_sessions=expired)
    for session_id in backend.sessions():
        try:
            rows = backend.history(session_id, now)
        except ExpiredError:
            continue  # removed by a later vacuum
        if len(rows) <= 1:
            continue
        keep = {row.version for row in rows}
        if retention.keep_last is not None:
            keep = {row.version for row in rows[-retention.keep_last :]}
        if retention.max_age_s is not None:
            cutoff = now - retention.max_age_s
            keep = {row.version for row in rows if row.version in keep and row.created_at >= cutoff}
        keep.add(rows[-1].version)
        good = [row.version for row in rows if row.good]
        if good:
            keep.add(good[-1])
        doomed = [row.version for row in rows if row.version not in keep]
        if not doomed:
            continue
        deleted += len(doomed)
        rebased += drop_rows(backend, session_id, rows, keep, now)
    return VacuumReport(
        expired_sessions=expired, checkpoints_deleted=deleted, checkpoints_rebased=rebased
    )


def drop_rows(
    backend: StateBackend,
    session_id: str,
    rows: list[StoredCheckpoint],
    keep: set[int],
    now: float,
) -> int:
    """Delete the versions of ``rows`` not in ``keep`` (never the head) in one rewrite; a kept
    delta whose predecessor goes is rebased as a full snapshot first. Returns how many were
    rebased."""
    rebased: list[StoredCheckpoint] = []
    for row in rows:
        if row.version in keep and row.kind == "delta" and (row.version - 1) not in keep:
            chain = backend.read_chain(session_id, row.version, now)
            if chain is None:
                continue
            data = replay(part.payload for part in chain.rows)
            rebased.append(replace(chain.rows[-1], kind="full", payload=encode_full(data)))
    doomed = [row.version for row in rows if row.version not in keep]
    backend.rewrite(session_id, doomed, rebased)
    return len(rebased)
