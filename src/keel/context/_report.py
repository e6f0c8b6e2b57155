"""The budget report of a compiled prompt: where every token went and what gave way, and why.

It is a Pydantic model so the runtime can write it into traces as JSON
(``report.model_dump_json()``). The full text of pruned tool output is on each
[`PrunedOutput`][] as ``original`` for the caller to keep, but left out of the JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BudgetReport",
    "DegradationStep",
    "DroppedItem",
    "PrunedOutput",
    "SectionTokens",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

DegradationName = Literal[
    "elide_oversized",
    "prune_tools_harder",
    "drop_memories",
    "shorten_summary",
    "elide_messages",
    "drop_below_floor",
]
"""The degradation steps, in the order they are tried."""


class SectionTokens(BaseModel):
    """Tokens per section of one compiled prompt; they add up to the prompt's total."""

    model_config = _FROZEN

    system: int = Field(description="The system prompt message.")
    memories: int = Field(description="The retrieved-memories block (0 when absent).")
    summary: int = Field(description="The running-summary block (0 when absent).")
    turns: int = Field(description="The recent turns kept in the window, current turn included.")
    rules: int = Field(description="The operating-rules block (0 when absent).")
    tools: int = Field(description="The tool schemas sent with the request.")
    reply_priming: int = Field(description="Tokens the chat format adds to prime the answer.")


class PrunedOutput(BaseModel):
    """A message whose content was cut (a pruned tool result or an elided message)."""

    model_config = _FROZEN

    message_index: int = Field(description="Position of the cut message in the prompt.")
    role: str = Field(description="Role of the cut message.")
    tool_call_id: str | None = Field(description="For a tool result: the call it answers.")
    original_tokens: int = Field(description="Tokens of the original content.")
    kept_tokens: int = Field(description="Tokens of the content sent, marker included.")
    how: Literal["pruned", "pruned_hard", "elided"] = Field(
        description="pruned: older tool output; pruned_hard: degradation step 1; "
        "elided: the middle of an oversized message (last degradation step)."
    )
    original: str = Field(
        default="",
        exclude=True,
        repr=False,
        description="The full original content, for the trace (not serialized).",
    )


class DroppedItem(BaseModel):
    """Something left out of the prompt, with how much it weighed and why."""

    model_config = _FROZEN

    section: Literal["memories", "summary", "turns"] = Field(description="Where it came from.")
    count: int = Field(description="How many items (memories, turns) were left out.")
    tokens: int = Field(description="Tokens they would have cost.")
    reason: str = Field(description="Why they were left out.")


class DegradationStep(BaseModel):
    """One degradation step that was applied because the prompt did not fit."""

    model_config = _FROZEN

    step: DegradationName = Field(description="Which step, in the documented order.")
    tokens_saved: int = Field(description="Tokens the step removed from the prompt.")
    detail: str = Field(description="What the step did, in words.")


class BudgetReport(BaseModel):
    """Everything about one compiled prompt's budget, for traces and debugging."""

    model_config = _FROZEN

    model: str = Field(description="The model the prompt was counted for.")
    exact: bool = Field(description="Whether the counts are exact for that model.")
    window: int = Field(description="The model's context window.")
    effective_window: int = Field(description="The window used: min(window, working budget).")
    reserve: int = Field(description="Tokens kept free for the answer.")
    limit: int = Field(description="Most tokens the prompt may take: effective window - reserve.")
    prompt_tokens: int = Field(description="Exact tokens of the compiled prompt, tools included.")
    sections: SectionTokens = Field(description="Tokens per section.")
    memories_cap: int = Field(description="Cap of the memories section.")
    summary_cap: int = Field(description="Cap of the summary section.")
    turns_kept: int = Field(description="Turns (atomic units) in the window.")
    messages_kept: int = Field(description="History messages in the window.")
    turns_outside_window: int = Field(
        description="Turns still held raw but left out of this prompt (awaiting a summary)."
    )
    turns_summarized: int = Field(description="Turns folded into the running summary so far.")
    summary_pending: bool = Field(
        description="The conversation has passed its summary trigger: summarize before long."
    )
    pruned: tuple[PrunedOutput, ...] = Field(
        default=(), description="Messages whose content was cut."
    )
    dropped: tuple[DroppedItem, ...] = Field(default=(), description="What was left out, and why.")
    degradations: tuple[DegradationStep, ...] = Field(
        default=(), description="Degradation steps applied, in order (empty when it fit)."
    )

    @property
    def headroom(self) -> int:
        """Tokens still free under the limit."""
        return self.limit - self.prompt_tokens
