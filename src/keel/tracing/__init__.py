"""Run traces: every model call, tool call, guard event and state transition of a run, redacted,
stored next to the rest of keel's data, queryable from ``keel runs``, exportable to
OpenTelemetry.

The runtime records through a [`Tracer`][]:

```python
tracer = Tracer(backends.traces)             # keel.stores.Backends.open(settings)
run = await tracer.astart_run(session_id, user_id=user, input=message)
async with run:                              # ends succeeded, or with status_for(error)
    async with run.step("model", model.spec, state_version=3, budget=report) as call:
        completion = await model.acomplete(prompt, tools)
        call.update(completion=completion)   # tokens, model, finish reason, ttft, output
    for tool_call in completion.message.tool_calls:
        async with run.step("tool", tool_call.name, parent=call,
                            tool_call_id=tool_call.id,
                            tool_arguments=tool_call.arguments) as tool:
            tool.update(tool_result=result)  # stored whole
    run.transition("searching", "booking", state_version=4)
    await run.aend(output=reply)
```

Steps opened inside a ``with run.step(...)`` block get it as their parent (per task, through a
context variable); ``parent=`` overrides. ``run.record(...)`` writes an event that already
happened; ``run.guard``, ``run.loop_caught`` and ``run.state_reset`` record the guard events the
death-spiral indicators count. After a crash, ``tracer.resume_run(run_id)`` continues a run, or
a new run finishes the open turn and ``tracer.atake_over_turn`` ends the turn's earlier runs as
``interrupted``; a run whose worker died and that nobody resumes reads as ``abandoned`` once it
has been silent for longer than its time limit allows ([`abandon_after_s`][]).

Every text field, and every string inside JSON fields, passes through ``redact`` (default
[`redact_pii`][]: every PII kind [`PIIMasker`][] masks, and credentials)
before it is stored or exported. Identifiers (run, session, user, tenant ids) are stored as
given, because queries filter on them: use opaque ids, not e-mail addresses.

Tracing never raises into the agent: a failed write is logged on the ``keel.tracing`` logger
and counted in [`Tracer.write_failures`][] (the last one in [`Tracer.last_error`][]).
"""

from __future__ import annotations

from keel.tracing._loop import LoopStep, ToolOutcome, arecord_loop_step
from keel.tracing._models import (
    ABANDON_SLACK_CAP_S,
    DEFAULT_RUN_TIME_LIMIT_S,
    RUN_STATUSES,
    STEP_KINDS,
    Run,
    RunDetail,
    RunQuery,
    RunStatus,
    SessionStats,
    StatsThresholds,
    Step,
    StepKind,
    StepMetric,
    StepNode,
    abandon_after_s,
)
from keel.tracing._otel import OpenTelemetryExporter, export_run
from keel.tracing._redact import Redactor, redact_json, redact_pii, redact_secrets
from keel.tracing._render import render_run
from keel.tracing._stats import (
    LOOP_GUARD_NAME,
    CallFigures,
    call_figures,
    percentile,
    session_stats,
)
from keel.tracing._store import TraceBatch, TraceStore
from keel.tracing._time import parse_since
from keel.tracing._tracer import (
    RunTrace,
    StepFields,
    StepTrace,
    TraceExporter,
    Tracer,
    status_for,
)

__all__ = [
    "ABANDON_SLACK_CAP_S",
    "DEFAULT_RUN_TIME_LIMIT_S",
    "LOOP_GUARD_NAME",
    "RUN_STATUSES",
    "STEP_KINDS",
    "CallFigures",
    "LoopStep",
    "OpenTelemetryExporter",
    "Redactor",
    "Run",
    "RunDetail",
    "RunQuery",
    "RunStatus",
    "RunTrace",
    "SessionStats",
    "StatsThresholds",
    "Step",
    "StepFields",
    "StepKind",
    "StepMetric",
    "StepNode",
    "StepTrace",
    "ToolOutcome",
    "TraceBatch",
    "TraceExporter",
    "TraceStore",
    "Tracer",
    "abandon_after_s",
    "arecord_loop_step",
    "call_figures",
    "export_run",
    "parse_since",
    "percentile",
    "redact_json",
    "redact_pii",
    "redact_secrets",
    "render_run",
    "session_stats",
    "status_for",
]
