"""Two workers on one session, as `keel serve` runs them: the worker that did not write the
session's latest turns reads only the checkpoints written since the version it holds, never the
whole chain (issue 46: a decision's cost was the session's length). Counted from the rows the
state backend hands back, not timed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keel.state._backend import Chain
from tests.runtime.test_turn_cost_flat import lookup_agent


def _count_chain_rows(backend: Any) -> list[int]:
    """The rows each chain read of ``backend`` returns from now on (its methods wrapped on the
    instance, as the state store looks them up per call)."""
    counted: list[int] = []
    for name in ("read_chain", "read_head_chain"):
        sync, asynchronous = getattr(backend, name), getattr(backend, f"a{name}")

        def counting(*args: Any, _sync: Any = sync, **kwargs: Any) -> Chain | None:
            chain: Chain | None = _sync(*args, **kwargs)
            counted.append(0 if chain is None else len(chain.rows))
            return chain

        async def acounting(*args: Any, _async: Any = asynchronous, **kwargs: Any) -> Any:
            chain: Chain | None = await _async(*args, **kwargs)
            counted.append(0 if chain is None else len(chain.rows))
            return chain

        setattr(backend, name, counting)
        setattr(backend, f"a{name}", acounting)
    return counted


async def test_a_worker_another_moved_on_reads_only_the_checkpoints_written_since(
    tmp_path: Path,
) -> None:
    first, second = lookup_agent(tmp_path), lookup_agent(tmp_path)
    key = first.session_key("shared")
    try:
        for turn in range(20):
            assert (await first.handle("shared", "u1", f"look up order {turn}")).status == (
                "completed"
            )
        whole = _count_chain_rows(second.state.backend)
        assert (await second.handle("shared", "u1", "look up order 20")).status == "completed"
        assert whole and whole[0] > 40, whole  # a stranger to the session reads its chain
        held = second.state.get(key)
        assert held is not None

        for turn in range(21, 24):
            assert (await first.handle("shared", "u1", f"look up order {turn}")).status == (
                "completed"
            )
        head = first.state.get(key)
        assert head is not None
        written_since = head.version - held.version

        counted = _count_chain_rows(second.state.backend)
        reply = await second.handle("shared", "u1", "look up order 24")
        assert reply.status == "completed"
        # It catches up from the rows after the version it held; no read of the turn, the
        # later ones of its own head included, returns the whole chain.
        assert counted and 0 < counted[0] <= written_since < whole[0], (counted, written_since)
        assert max(counted) <= written_since, (counted, written_since)
        assert [m.content for m in second.session_state("shared").messages][-1] == (  # type: ignore[union-attr]
            reply.text
        )
    finally:
        await first.aclose()
        await second.aclose()
