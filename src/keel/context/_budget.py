"""How the prompt's tokens are shared out: the window, the answer reserve and section caps.

A [`ContextBudget`][] is declarative (ratios, optional caps); [`ContextBudget.resolve`][]
turns it into the exact numbers for one model ([`ResolvedBudget`][]). [`PruningPolicy`][]
and [`SummaryPolicy`][] say how old tool output is cut and when old turns are summarized.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keel.errors import UsageError
from keel.tokens import ModelProfile

__all__ = ["ContextBudget", "PruningPolicy", "ResolvedBudget", "SummaryPolicy"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ContextBudget(BaseModel):
    """Token budget of a compiled prompt, per section.

    The *effective window* is the model's context window, or ``working_budget`` when that is
    smaller (a 128k model run on a 16k working budget keeps prompts cheap and fast). The answer
    reserve is taken off the effective window; what remains is the *prompt limit*, which every
    compiled prompt (messages, framing, reply priming and tool schemas) stays within.

    Inside the prompt limit, sections with a cap never take more than it: memories beyond
    ``memories_cap`` are dropped lowest-ranked first, a summary beyond ``summary_cap`` is
    re-summarized. The system prompt and the operating rules are never edited by keel (they
    carry identity, safety guardrails and output format); their caps are guards: a system
    prompt or rules block larger than its cap raises ``ContextOverflowError``. Whatever the
    fixed sections leave goes to the recent turns.
    """

    model_config = _FROZEN

    window: int | None = Field(
        default=None,
        gt=0,
        description=(
            "The model's context window in tokens (prompt + answer). None: the model profile's. "
            "Set it to override the catalogue (a deployment with a different limit)."
        ),
    )
    working_budget: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Use at most this many tokens of the window (prompt + answer reserve), even when the "
            "model accepts more. None: the whole window."
        ),
    )
    reserve_ratio: float = Field(
        default=0.12,
        ge=0.0,
        lt=1.0,
        description=(
            "Share of the effective window kept free for the answer, when reserve_tokens is not "
            "set. Never more than the model's maximum output tokens."
        ),
    )
    reserve_tokens: int | None = Field(
        default=None, ge=0, description="Exact tokens reserved for the answer (overrides ratio)."
    )
    system_cap: int | None = Field(
        default=None, gt=0, description="Guard: most tokens the system prompt may take."
    )
    rules_cap: int | None = Field(
        default=None, gt=0, description="Guard: most tokens the operating rules may take."
    )
    memories_cap: int | None = Field(
        default=None,
        gt=0,
        description="Most tokens for retrieved memories. None: memories_ratio of the limit.",
    )
    memories_ratio: float = Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        description="Memories cap as a share of the prompt limit, when memories_cap is not set.",
    )
    summary_cap: int | None = Field(
        default=None,
        gt=0,
        description="Most tokens for the running summary. None: summary_ratio of the limit.",
    )
    summary_ratio: float = Field(
        default=0.10,
        gt=0.0,
        le=1.0,
        description="Summary cap as a share of the prompt limit, when summary_cap is not set.",
    )

    def resolve(self, profile: ModelProfile) -> ResolvedBudget:
        """The exact numbers of this budget for ``profile``."""
        window = self.window or profile.context_window
        effective = min(window, self.working_budget) if self.working_budget else window
        if self.reserve_tokens is not None:
            reserve = self.reserve_tokens
        else:
            reserve = min(math.ceil(effective * self.reserve_ratio), profile.max_output_tokens)
        limit = effective - reserve
        if limit <= 0:
            raise UsageError(
                f"the answer reserve ({reserve} tokens) leaves no room for a prompt in a "
                f"{effective}-token window"
            )
        return ResolvedBudget(
            window=window,
            effective_window=effective,
            reserve=reserve,
            limit=limit,
            system_cap=self.system_cap,
            rules_cap=self.rules_cap,
            memories_cap=self.memories_cap or max(1, int(limit * self.memories_ratio)),
            summary_cap=self.summary_cap or max(1, int(limit * self.summary_ratio)),
        )


class ResolvedBudget(BaseModel):
    """A [`ContextBudget`][] resolved to exact token numbers for one model."""

    model_config = _FROZEN

    window: int = Field(description="The model's context window in tokens.")
    effective_window: int = Field(description="min(window, working budget): what is used.")
    reserve: int = Field(description="Tokens kept free for the answer.")
    limit: int = Field(description="Most tokens a compiled prompt may take: effective - reserve.")
    system_cap: int | None = Field(description="Guard on the system prompt's size, if any.")
    rules_cap: int | None = Field(description="Guard on the operating rules' size, if any.")
    memories_cap: int = Field(description="Most tokens for retrieved memories.")
    summary_cap: int = Field(description="Most tokens for the running summary.")


class PruningPolicy(BaseModel):
    """How tool results are cut once they are no longer among the newest messages.

    A pruned result keeps its head and tail around a marker that states the original size in
    tokens (``[... tool output pruned: the original had 20000 tokens; ...]``), and carries
    ``metadata["keel_cut"] = {"how": ..., "original_tokens": ...}`` (metadata is never sent).
    The context engine does not keep full outputs beyond the raw history; each compiled
    prompt's report carries the original of every cut message for the trace.
    """

    model_config = _FROZEN

    keep_recent_messages: int = Field(
        default=6,
        ge=0,
        description="Tool results among this many newest history messages are never pruned.",
    )
    max_tokens: int = Field(
        default=400, ge=16, description="Older tool results are cut to about this many tokens."
    )
    recent_share: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description=(
            "A recent tool result may take at most this share of the recent-turns budget; a "
            "larger one is cut to it, so one giant output cannot push the conversation out."
        ),
    )
    hard_max_tokens: int = Field(
        default=96,
        ge=16,
        description="Degradation step 1 cuts every tool result outside the newest turn to this.",
    )
    min_elided_tokens: int = Field(
        default=48,
        ge=8,
        description="Degradation elides a message down to no fewer content tokens than this.",
    )

    @model_validator(mode="after")
    def _check_order(self) -> PruningPolicy:
        if self.hard_max_tokens > self.max_tokens:
            raise ValueError("hard_max_tokens must not exceed max_tokens")
        return self


class SummaryPolicy(BaseModel):
    """When the oldest turns are summarized, and how many are kept raw.

    History size is measured as the recent turns would appear in a prompt (older tool output
    already pruned). When it passes ``trigger_ratio`` of the recent-turns budget, or the
    history holds more than ``max_turns`` turns, the oldest turns are folded into the running
    summary until it is back under ``target_ratio`` (and ``max_turns``), keeping at least
    ``keep_turns`` turns and the whole current turn raw.

    The defaults (trigger 0.75, target 0.65) keep the settled history at 65-75% of the turns
    budget and leave the rest to what the current work brings in: a large recent tool output
    may take up to ``PruningPolicy.recent_share`` (0.25) of the budget, and trigger + share
    = 1, so one big output does not push older turns out of the window, and the prompt stays
    flat (the history part moves within 10% of the budget). Each summarization folds about
    10% of the budget's worth of turns, so a model summarizer is called in useful batches.

    When several large outputs are recent at once, some older turns can still be left out of
    the window for those few messages (the report counts them as ``turns_outside_window``);
    they stay raw and return when the outputs are pruned. Set ``summarize_outside_window`` to
    fold such turns into the summary at once instead (smaller prompts afterwards).
    """

    model_config = _FROZEN

    trigger_ratio: float = Field(
        default=0.75, gt=0.0, le=4.0, description="Summarize past this share of the turns budget."
    )
    target_ratio: float = Field(
        default=0.65, gt=0.0, le=4.0, description="Summarize down to this share of it."
    )
    max_turns: int | None = Field(
        default=None, ge=1, description="Also summarize when more turns than this are held."
    )
    keep_turns: int = Field(
        default=3, ge=1, description="Newest turns never summarized (the window's floor)."
    )
    summarize_outside_window: bool = Field(
        default=False,
        description=(
            "Also summarize turns the last prompt left out of its window (a large recent "
            "output took the room). Off by default: those turns come back into the window "
            "once the output is pruned, and summarizing them early shrinks later prompts."
        ),
    )
    timeout_s: float | None = Field(
        default=30.0,
        gt=0,
        description="A summary taking longer is abandoned; the raw turns stay. None: no limit.",
    )

    @model_validator(mode="after")
    def _check_order(self) -> SummaryPolicy:
        if self.target_ratio > self.trigger_ratio:
            raise ValueError("target_ratio must not exceed trigger_ratio")
        return self
