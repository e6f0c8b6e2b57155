"""What a turn takes from long-term memory and hands to it: memories retrieved for the prompt,
the turn's words and a finished workflow run remembered after the commit, and committed
summaries archived (the context engine's [`MemorySink`][keel.context.MemorySink])."""

from __future__ import annotations

from collections.abc import Sequence

from keel._bridge import run_blocking
from keel.context import ContextMemory
from keel.memory import Memory, Provenance, Scope
from keel.messages import Message, ToolCall
from keel.privacy import Vault
from keel.runtime._replies import Recent

__all__ = ["SUMMARY_KEY_PREFIX", "MemoryHandOff", "hand_off"]

SUMMARY_KEY_PREFIX = "keel:summary:"
"""A session's running summary is kept in memory under this prefix and the session id."""


def hand_off(
    memory: Memory | None,
    vault: Vault | None,
    tenant_id: str,
    budget_tokens: int,
    owners: Recent[str, tuple[str, str]],
) -> MemoryHandOff | None:
    """The agent's hand-off to ``memory`` (None without memory). A memory with no vault of
    its own is given the agent's: what is written to it outside the turns (the service's
    memory route, MCP) numbers its values as the turns do, in the user's vault."""
    if memory is None:
        return None
    if memory.vault is None and vault is not None:
        memory.vault = vault
    return MemoryHandOff(memory, tenant_id=tenant_id, budget_tokens=budget_tokens, owners=owners)


class MemoryHandOff:
    """One agent's traffic with its long-term memory, scoped to its tenant.

    Memory keeps one summary per session, the latest: each running summary restates most of
    the one before (which the prompt held), so storing every one filled memory with copies
    (158 of 166 summaries over a 507-turn ``keel demo``). What a summary drops is in the turns.

    Args:
        memory: the long-term memory.
        tenant_id: the tenant every record is scoped to.
        budget_tokens: tokens retrieved memories may take.
        owners: each session key's (session id, user id), as the turns on it set them: a
            summary is archived under the session's owner.
    """

    def __init__(
        self,
        memory: Memory,
        *,
        tenant_id: str,
        budget_tokens: int,
        owners: Recent[str, tuple[str, str]],
    ) -> None:
        self.memory = memory
        self.tenant_id = tenant_id
        self.budget_tokens = budget_tokens
        self._owners = owners

    def _scope(self, user_id: str) -> Scope:
        return Scope(tenant_id=self.tenant_id, user_id=user_id)

    async def recall(self, user_id: str, query: str) -> list[ContextMemory]:
        """The memories for ``query``, within the budget."""
        if not query.strip() or self.budget_tokens <= 0:
            return []
        packed = await self.memory.aretrieve(
            query, scope=self._scope(user_id), budget_tokens=self.budget_tokens
        )
        return [
            ContextMemory(text=item.text, score=item.score, id=",".join(item.record_ids))
            for item in packed.items
        ]

    async def remember_turn(
        self, session_id: str, user_id: str, turn: int, request: str, reply: str
    ) -> None:
        """The turn's words in memory, each with its speaker's provenance: what the user wrote
        is the user's claim; what the model answered is the assistant's, never the user's (a
        model inventing "you live at 1027 Bergen Street" is not the user saying so). The
        writes (and the memory's masking through the user's vault) run off the event loop."""
        said: tuple[tuple[str, str, Provenance], ...] = (
            ("user", f"User: {request}", "user_claim"),
            ("assistant", f"Assistant: {reply}", "inferred"),
        )
        for speaker, text, provenance in said:
            await run_blocking(
                self.memory.add,
                text,
                scope=self._scope(user_id),
                kind="episodic",
                type="turn",
                provenance=provenance,
                session_id=session_id,
                turn=turn,
                metadata={"speaker": speaker},
            )

    async def remember_run(
        self, session_id: str, user_id: str, task: str, tool_calls: Sequence[ToolCall]
    ) -> None:
        """A workflow run that reached its goal, to be replayed as an example."""
        if not tool_calls:
            return
        await run_blocking(
            self.memory.remember_run,
            self._scope(user_id),
            task,
            tool_calls,
            succeeded=True,
            session_id=session_id,
        )

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        """Keep a committed summary (the evicted turns are there already: every turn is
        remembered as it ends)."""
        owner = self._owners.get(session_id)
        if owner is None or not summary.strip():
            return
        plain_session, user_id = owner
        # Under the session's key the new summary replaces the last one in the same
        # transaction, so a retried summary is safe and only the newest is kept.
        await run_blocking(
            self.memory.add,
            summary,
            scope=self._scope(user_id),
            kind="episodic",
            type="summary",
            provenance="inferred",
            session_id=plain_session,
            key=f"{SUMMARY_KEY_PREFIX}{plain_session}",
        )
