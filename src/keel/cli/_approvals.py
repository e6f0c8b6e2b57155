"""``keel approvals list / approve / reject``: a tenant's operator works the approvals queue.

The command line holds no agent (the tools run in the application's process), so it decides
on the queue itself: one compare-and-set, as ``agent.decide`` makes it. The turn waiting on
the request resumes in the application's process, which reads the decision from the queue.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import JsonLastOption, JsonOption, app, bench_app, emit_json, fail, out_console
from keel.cli._database import DatabaseOption

if TYPE_CHECKING:
    from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus, ApprovalStore

approvals_app = typer.Typer(
    help="Work the approvals queue: tool calls and escalated turns waiting for an operator.",
    no_args_is_help=True,
)
app.add_typer(approvals_app, name="approvals")

TenantOption = Annotated[
    str, typer.Option("--tenant", help="The tenant whose queue to work (the agent's tenant_id).")
]
ByOption = Annotated[
    str | None,
    typer.Option("--by", help="Who decides (recorded as operator:NAME; default: your login)."),
]


def _run_on_queue(database: str | None, work: Any) -> Any:
    """Run ``work(store)`` (a coroutine function) on the configured database's queue."""
    from keel.cli._database import database_settings
    from keel.stores import Backends

    async def run() -> Any:
        backends = Backends.open(database_settings(database), memory=False, redis_url="")
        try:
            return await work(backends.approvals)
        finally:
            await backends.aclose()

    return asyncio.run(run())


def _summary(request: ApprovalRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", exclude={"metadata"})


@approvals_app.command("list")
def approvals_list_command(
    session: Annotated[str | None, typer.Option("--session", help="Only this session's.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Only this user's.")] = None,
    tenant: TenantOption = "default",
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the pending requests, oldest first."""

    async def pending(store: ApprovalStore) -> list[ApprovalRequest]:
        return await store.alist(tenant, user_id=user, session_id=session, limit=1000)

    requests: list[ApprovalRequest] = _run_on_queue(database, pending)
    if as_json:
        emit_json({"approvals": [_summary(request) for request in requests]})
        return
    if not requests:
        out_console.print("no approvals pending")
        return
    for request in requests:
        what = request.tool or "escalated turn"
        expires = "" if request.expires_at is None else f" expires={_clock(request.expires_at)}"
        out_console.print(
            f"{request.id}  {request.kind} session={request.session_id} user={request.user_id} "
            f"{what} {request.arguments}  reason: {request.reason or '-'}{expires}"
        )


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _corrected(arguments: str | None) -> str | None:
    """The ``--arguments`` JSON object, normalized (the agent validates it against the tool)."""
    from keel.errors import UsageError

    if arguments is None:
        return None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--arguments is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--arguments must be a JSON object of the tool's arguments")
    return json.dumps(value, ensure_ascii=False)


def _decide(request_id: str, tenant: str, database: str | None, decision: ApprovalDecision) -> None:
    """Settle the request with ``decision``; a repeat of the standing decision is no error."""
    from keel.errors import UsageError

    async def settle(store: ApprovalStore) -> tuple[ApprovalRequest, bool]:
        status: ApprovalStatus = "approved" if decision.approve else "rejected"
        return await store.adecide(tenant, request_id, status, decision)

    try:
        request, settled = _run_on_queue(database, settle)
    except KeyError:
        raise UsageError(f"no approval request {request_id!r} in tenant {tenant!r}") from None
    verb = "approved" if decision.approve else "rejected"
    if settled:
        out_console.print(f"{request_id}: {verb} by {decision.by}")
        return
    standing = request.decision
    if request.status == verb and standing is not None and standing.by == decision.by:
        out_console.print(f"{request_id}: already {verb} by {standing.by}")
        return
    by = f" by {standing.by}" if standing is not None else ""
    reason = f" ({request.status_reason})" if request.status_reason else ""
    fail(f"{request_id} is already {request.status}{by}{reason}")


def _decision(
    approve: bool,
    by: str | None,
    note: str | None,
    arguments: str | None,
    action: str | None = None,
) -> Any:
    from keel.approvals import ApprovalDecision

    name = by or getpass.getuser()
    who = name if name.startswith("operator:") else f"operator:{name}"
    return ApprovalDecision(
        approve=approve,
        by=who,
        note=note,
        arguments=arguments,
        action=action,
        decided_at=time.time(),
    )


@approvals_app.command("approve")
def approvals_approve_command(
    request_id: Annotated[str, typer.Argument(help="The request's id (keel approvals list).")],
    by: ByOption = None,
    note: Annotated[str | None, typer.Option("--note", help="Why (kept in the trace).")] = None,
    arguments: Annotated[
        str | None,
        typer.Option("--arguments", help="Corrected arguments (a JSON object) to run with."),
    ] = None,
    action: Annotated[
        str | None,
        typer.Option(
            "--action",
            help="For an escalated turn: retry the stopped call, skip it, or answer (--note "
            "is the answer for the model).",
        ),
    ] = None,
    tenant: TenantOption = "default",
    database: DatabaseOption = None,
) -> None:
    """Approve a request: the call runs (once), with --arguments if given; an escalated turn
    goes on as --action says."""
    from keel.errors import UsageError

    if action not in (None, "retry", "skip", "answer"):
        raise UsageError(f"--action must be retry, skip or answer, not {action!r}")
    decision = _decision(True, by, note, _corrected(arguments), action)
    _decide(request_id, tenant, database, decision)


@approvals_app.command("reject")
def approvals_reject_command(
    request_id: Annotated[str, typer.Argument(help="The request's id (keel approvals list).")],
    note: Annotated[str, typer.Option("--note", help="Why: the model is shown it.")],
    by: ByOption = None,
    tenant: TenantOption = "default",
    database: DatabaseOption = None,
) -> None:
    """Reject a request: the call does not run; the model is told who rejected it and why."""
    _decide(request_id, tenant, database, _decision(False, by, note, None))


@bench_app.command("approvals")
def bench_approvals_command(
    flows: Annotated[int, typer.Option("--flows", min=1, help="Approval flows in all.")] = 1000,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed (default: a random one, printed).")
    ] = None,
    sessions: Annotated[int, typer.Option("--sessions", min=1, help="Sessions they go to.")] = 8,
    kills: Annotated[
        int, typer.Option("--kills", min=0, help="How many flows get a worker SIGKILLed.")
    ] = 30,
    as_json: JsonLastOption = False,
) -> None:
    """Approval flows through two worker processes (approvals, rejections, corrections,
    expiries, duplicate and concurrent decisions, SIGKILLs), counted from the tool's effects."""
    import random

    from keel.bench.approvals import run_approval_bench

    chosen = random.SystemRandom().randrange(2**31) if seed is None else seed
    out_console.print(f"seed {chosen}")
    report = run_approval_bench(flows, seed=chosen, sessions=sessions, kills=kills)
    payload = report.model_dump()
    if as_json:
        emit_json(payload)
        return
    out_console.print(f"{report.flows} flows in {report.seconds:.1f} s")
    for name, value in payload.items():
        if name not in ("flows", "seconds", "failures", "seed"):
            out_console.print(f"  {name:<28} {value}")
    for failure in report.failures:
        out_console.print(f"  [red]failure[/] {failure}", markup=True)
