"""The data a trace holds: runs, their steps, queries over them, and per-session indicators.

All timestamps are timezone-aware UTC datetimes. Every text field has already been redacted by
the [`Tracer`][] before a model of this module reaches a store.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "ABANDON_SLACK_CAP_S",
    "DEFAULT_RUN_TIME_LIMIT_S",
    "RUN_STATUSES",
    "STEP_KINDS",
    "Run",
    "RunDetail",
    "RunQuery",
    "RunStatus",
    "SessionStats",
    "StatsThresholds",
    "Step",
    "StepKind",
    "StepMetric",
    "StepNode",
    "abandon_after_s",
]

RunStatus = Literal[
    "running", "succeeded", "failed", "limited", "escalated", "interrupted", "abandoned"
]
"""How a run ended: ``running`` until it ends; ``limited`` when a step or time limit stopped it;
``escalated`` when a guard handed it to a human or the caller (loop, tool in doubt);
``interrupted`` when it stopped before its turn ended and left the turn open for a later run
to finish: cancelled (Ctrl-C, a caller that stopped reading) or its process stopped (killed,
crashed) and another run took the turn over; its error says which; ``abandoned`` when it never
ended and no run took its turn over: its worker died (SIGKILL, power loss) mid-run.

``abandoned`` is never written; stores derive it when they read a run: a run still ``running``
whose last sign of life (its start, or its latest step written) is older than
[`abandon_after_s`][] of its time limit cannot be alive, since a run ends within its time
limit. A resumed run (``Tracer.resume_run``) is ``running`` again."""

RUN_STATUSES: tuple[RunStatus, ...] = (
    "running",
    "succeeded",
    "failed",
    "limited",
    "escalated",
    "interrupted",
    "abandoned",
)
"""Every run status, in lifecycle order."""

DEFAULT_RUN_TIME_LIMIT_S = 300.0
"""The time limit assumed for a run that recorded none (``GuardConfig.run_timeout_s``'s
default)."""


ABANDON_SLACK_CAP_S = 30.0
"""The most slack [`abandon_after_s`][] adds to a run's time limit."""


def abandon_after_s(time_limit_s: float | None) -> float:
    """Seconds without a sign of life after which a ``running`` run counts as abandoned.

    The run's time limit (or [`DEFAULT_RUN_TIME_LIMIT_S`][]) plus as much again, at most
    [`ABANDON_SLACK_CAP_S`][] more: slack for the last writes and for the clocks of
    different workers. Both trace stores compute the same bound in SQL.
    """
    limit = DEFAULT_RUN_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    return limit + min(limit, ABANDON_SLACK_CAP_S)


StepKind = Literal[
    "model", "tool", "transition", "reset", "guard", "checkpoint", "memory", "context", "other"
]
"""What a step is. ``reset`` is a state-machine reset after persistent failures (counted as a
state reset in the indicators); a ``guard`` step named ``loop`` is a loop caught."""

STEP_KINDS: tuple[StepKind, ...] = (
    "model",
    "tool",
    "transition",
    "reset",
    "guard",
    "checkpoint",
    "memory",
    "context",
    "other",
)
"""Every step kind."""

_MODEL = ConfigDict(extra="forbid", frozen=True)


def utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime (naive values are taken to be UTC already)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


UTCDateTime = Annotated[datetime, AfterValidator(utc)]
"""A datetime normalised to aware UTC."""


class Run(BaseModel):
    """One run of an agent: one user turn handled from message to reply, with its totals."""

    model_config = _MODEL

    run_id: str = Field(min_length=1, description="Unique id of the run.")
    session_id: str = Field(min_length=1, description="The conversation (session) the run is in.")
    user_id: str | None = Field(default=None, description="The end user the run served.")
    tenant_id: str | None = Field(default=None, description="The tenant the user belongs to.")
    agent: str = Field(default="agent", description="Name of the agent that ran.")
    status: RunStatus = Field(default="running", description="Where the run is in its lifecycle.")
    started_at: UTCDateTime = Field(description="When the run started (UTC).")
    ended_at: UTCDateTime | None = Field(
        default=None, description="When it ended; None if running."
    )
    input: str | None = Field(default=None, description="The user message (redacted).")
    output: str | None = Field(default=None, description="The reply to the user (redacted).")
    error_type: str | None = Field(default=None, description="Exception class that ended it.")
    error_message: str | None = Field(default=None, description="That exception's message.")
    step_count: int = Field(
        default=0,
        ge=0,
        description="Trace steps recorded in the run, of every kind (model calls, tool calls, "
        "guards, checkpoints, ...); ``model_calls`` is what a reply calls its steps.",
    )
    model_calls: int = Field(
        default=0,
        ge=0,
        description="Steps of kind ``model``: the run's steps in the runtime's sense (one per "
        "model call, as ``AgentReply.steps`` counts them).",
    )
    tool_calls: int = Field(default=0, ge=0, description="Steps of kind ``tool``.")
    tool_errors: int = Field(default=0, ge=0, description="Tool steps that recorded an error.")
    prompt_tokens: int = Field(default=0, ge=0, description="Prompt tokens over all steps.")
    completion_tokens: int = Field(default=0, ge=0, description="Completion tokens, all steps.")
    attributes: dict[str, Any] = Field(
        default_factory=dict, description="Free JSON attributes (redacted)."
    )
    time_limit_s: float | None = Field(
        default=None,
        gt=0,
        description="The run's wall-clock limit, if known; a ``running`` run silent for longer "
        "(see `abandon_after_s`) is reported ``abandoned``.",
    )

    @property
    def duration_ms(self) -> float | None:
        """Wall-clock length of the run in milliseconds; None while it runs."""
        if self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds() * 1000


class Step(BaseModel):
    """One step of a run: a model call, a tool call, a guard event, a state transition, ...

    Large fields (``raw_output``, ``tool_result``) are stored whole, even when the model was
    shown a pruned or truncated version.
    """

    model_config = _MODEL

    run_id: str = Field(min_length=1, description="The run this step belongs to.")
    step_id: str = Field(min_length=1, description="Unique id of the step within its run.")
    parent_id: str | None = Field(
        default=None, description="The step this one ran inside; None for a top-level step."
    )
    seq: int = Field(ge=0, description="Order in which the step started within its run.")
    kind: StepKind = Field(description="What the step is.")
    name: str = Field(default="", description="Model name, tool name, guard or transition name.")
    started_at: UTCDateTime = Field(description="When the step started (UTC).")
    ended_at: UTCDateTime | None = Field(default=None, description="When it ended (UTC).")
    latency_ms: float | None = Field(default=None, ge=0, description="Wall time of the step.")
    ttft_ms: float | None = Field(
        default=None, ge=0, description="Time to first token of a streamed model call, in ms."
    )
    attempt: int = Field(
        default=1, ge=1, description="1 for a first try; 2+ for a retry of the same call."
    )
    prompt_tokens: int = Field(default=0, ge=0, description="Prompt tokens of a model call.")
    completion_tokens: int = Field(default=0, ge=0, description="Completion tokens of a call.")
    model: str | None = Field(default=None, description="Model that answered a model call.")
    finish_reason: str | None = Field(default=None, description="The model's finish reason.")
    budget: dict[str, Any] | None = Field(
        default=None, description="The context compiler's budget report for this call."
    )
    state_version: int | None = Field(
        default=None, description="Version of the session state the step read."
    )
    raw_output: str | None = Field(default=None, description="The model's raw output, whole.")
    parsed_action: Any = Field(
        default=None, description="What the runtime made of the output (JSON value)."
    )
    tool_name: str | None = Field(default=None, description="Name of the tool called.")
    tool_call_id: str | None = Field(default=None, description="Id of the tool call.")
    tool_arguments: str | None = Field(
        default=None, description="Tool arguments exactly as the model sent them (raw JSON text)."
    )
    tool_result: str | None = Field(default=None, description="The tool's whole result.")
    error_type: str | None = Field(default=None, description="Class name of the step's error.")
    error_message: str | None = Field(default=None, description="The error's message.")
    attributes: dict[str, Any] = Field(
        default_factory=dict, description="Free JSON attributes (redacted)."
    )

    @property
    def failed(self) -> bool:
        """True when the step recorded an error."""
        return self.error_type is not None


class StepNode(BaseModel):
    """A step with the steps that ran inside it, for tree displays."""

    model_config = ConfigDict(extra="forbid")

    step: Step = Field(description="The step.")
    children: list[StepNode] = Field(
        default_factory=list, description="Steps whose parent is this one, in start order."
    )


class RunDetail(BaseModel):
    """A run with all of its steps in start order."""

    model_config = _MODEL

    run: Run = Field(description="The run and its totals.")
    steps: tuple[Step, ...] = Field(description="Every step of the run, ordered by ``seq``.")

    def tree(self) -> list[StepNode]:
        """The steps as a forest: top-level steps with their children nested, in start order.

        A step whose parent is missing (never written, e.g. after a crash) is shown at the top
        level rather than dropped.
        """
        nodes = {step.step_id: StepNode(step=step) for step in self.steps}
        roots: list[StepNode] = []
        for step in self.steps:
            node = nodes[step.step_id]
            parent = nodes.get(step.parent_id) if step.parent_id else None
            if parent is None or parent is node:
                roots.append(node)
            else:
                parent.children.append(node)
        return roots


class RunQuery(BaseModel):
    """Filters for listing runs; every filter is optional and they combine with AND."""

    model_config = _MODEL

    session_id: str | None = Field(default=None, description="Only runs of this session.")
    user_id: str | None = Field(default=None, description="Only runs for this user.")
    tenant_id: str | None = Field(default=None, description="Only runs of this tenant.")
    agent: str | None = Field(default=None, description="Only runs of this agent.")
    status: RunStatus | None = Field(default=None, description="Only runs with this status.")
    min_steps: int | None = Field(
        default=None, ge=0, description="Only runs with >= N trace steps (of every kind)."
    )
    min_model_calls: int | None = Field(
        default=None,
        ge=0,
        description="Only runs with >= N model calls (the steps a reply counts).",
    )
    tool_error: bool | None = Field(
        default=None,
        description="True: only runs with a failed tool call; False: only runs without one.",
    )
    since: UTCDateTime | None = Field(default=None, description="Only runs started at or after.")
    until: UTCDateTime | None = Field(default=None, description="Only runs started before.")
    limit: int = Field(default=100, ge=1, le=100_000, description="At most this many runs.")


@dataclass(frozen=True, slots=True)
class StepMetric:
    """The few columns of a step that the death-spiral indicators need.

    A plain dataclass, not a Pydantic model: stats read thousands of these per query.
    """

    session_id: str
    """Session of the step's run."""
    run_id: str
    """Run of the step."""
    kind: str
    """Kind of the step (a [`StepKind`][])."""
    name: str
    """Name of the step."""
    started_at: datetime
    """When the step started (aware UTC)."""
    attempt: int
    """Attempt number (2+ is a retry)."""
    prompt_tokens: int
    """Prompt tokens."""
    ttft_ms: float | None
    """Time to first token in ms, if measured."""
    failed: bool
    """Whether the step recorded an error."""


class StatsThresholds(BaseModel):
    """Where each death-spiral indicator starts to warn."""

    model_config = _MODEL

    max_retry_rate: float = Field(
        default=0.2, ge=0, description="Warn when more than this share of calls are retries."
    )
    max_prompt_growth: float = Field(
        default=1.5,
        gt=0,
        description="Warn when the average prompt of the later half of the model calls is "
        "more than this many times that of the earlier half (context creeping up) while "
        "retries climb; growth alone is the window filling, not a spiral.",
    )
    max_state_resets: int = Field(default=0, ge=0, description="Warn above this many resets.")
    max_ttft_p95_ms: float = Field(
        default=5000.0, gt=0, description="Warn when the p95 time to first token exceeds this."
    )
    max_loops: int = Field(default=0, ge=0, description="Warn above this many loops caught.")
    max_abandoned_runs: int = Field(
        default=0, ge=0, description="Warn above this many abandoned runs (workers killed)."
    )
    min_calls_for_trend: int = Field(
        default=4, ge=2, description="Model calls needed before the prompt trend is judged."
    )


class SessionStats(BaseModel):
    """Death-spiral indicators of one session, from its stored traces."""

    model_config = _MODEL

    session_id: str = Field(description="The session.")
    runs: int = Field(description="Runs in the window (with steps).")
    abandoned_runs: int = Field(
        default=0, description="Runs still 'running' long after their time limit: abandoned."
    )
    steps: int = Field(description="Steps in the window.")
    model_calls: int = Field(description="Model-call steps.")
    tool_calls: int = Field(description="Tool-call steps.")
    tool_errors: int = Field(description="Tool calls that failed.")
    retries: int = Field(description="Model and tool calls that were retries (attempt > 1).")
    retry_rate: float = Field(description="retries / (model calls + tool calls); 0 if none.")
    avg_prompt_tokens: float = Field(description="Average prompt tokens per model call.")
    prompt_tokens_slope: float = Field(
        description="Least-squares change in prompt tokens per model call (positive: growing)."
    )
    prompt_growth: float = Field(
        description="Average prompt of the later half of calls over the earlier half (1 = flat)."
    )
    prompt_creeping: bool = Field(
        description="True when prompt_growth is over its threshold while retries climb (more "
        "retried model calls, as ``retries`` counts them, in the later half than in the "
        "earlier half)."
    )
    state_resets: int = Field(description="State-machine resets (steps of kind ``reset``).")
    ttft_p50_ms: float | None = Field(description="Median time to first token; None if unknown.")
    ttft_p95_ms: float | None = Field(description="95th percentile time to first token.")
    loops_caught: int = Field(description="Guard steps named ``loop``.")
    first_at: datetime | None = Field(description="Start of the first step counted.")
    last_at: datetime | None = Field(description="Start of the last step counted.")
    warnings: tuple[str, ...] = Field(description="One line per indicator over its threshold.")
