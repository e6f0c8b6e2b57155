"""``keel approvals list / approve / reject``: a tenant's operator works the approvals queue.

The command line holds no agent (the tools run in the application's process), so it decides
on the queue itself: one compare-and-set, as ``agent.decide`` makes it. The turn waiting on
the request resumes in the application's process, which reads the decision from the queue.

What it records is what ``agent.decide`` would: the note and corrected arguments masked
through the request's user's view of the PII vault (the tool is given the values back, and a
``forget`` erases them), corrected arguments validated first against the tool's arguments
schema the request carries (none recorded: corrections are refused, there is nothing to check
them against), and a decision that did not take effect refused with the outcome that stands.
"""

from __future__ import annotations

import getpass
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer

from keel._bridge import run_blocking, run_sync
from keel.cli._app import JsonLastOption, JsonOption, app, bench_app, emit_json, out_console
from keel.cli._database import DatabaseOption

if TYPE_CHECKING:
    from keel.approvals import ApprovalRequest, ApprovalStatus
    from keel.stores import Backends

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


def _on_backends(database: str | None, work: Any) -> Any:
    """Run ``work(backends)`` (a coroutine function) on the configured database's stores, on
    keel's bridge loop as every sync entry does (Ctrl-C cancels it there and waits for its
    clean-up)."""
    from keel.cli._database import database_settings
    from keel.stores import Backends

    async def run() -> Any:
        backends = Backends.open(database_settings(database), memory=False, redis_url="")
        try:
            return await work(backends)
        finally:
            await backends.aclose()

    return run_sync(run())


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

    async def pending(backends: Backends) -> list[ApprovalRequest]:
        return await backends.approvals.alist(tenant, user_id=user, session_id=session, limit=1000)

    requests: list[ApprovalRequest] = _on_backends(database, pending)
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


def _corrected(arguments: str | None) -> dict[str, Any] | None:
    """The ``--arguments`` JSON object (checked against the tool's schema when deciding)."""
    from keel.errors import UsageError

    if arguments is None:
        return None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--arguments is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--arguments must be a JSON object of the tool's arguments")
    return value


@dataclass(frozen=True)
class _Verdict:
    """What the operator decided, as typed: nothing masked or checked yet."""

    approve: bool
    by: str
    note: str | None
    arguments: dict[str, Any] | None
    action: Literal["retry", "skip", "answer"] | None = None


def _decide(request_id: str, tenant: str, database: str | None, verdict: _Verdict) -> None:
    """Settle the request with ``verdict``; a repeat of the standing decision is no error.

    Raises:
        UsageError: no such request; corrected arguments for a request that names no schema.
        ToolArgumentsError: corrected arguments the tool's schema refuses (nothing recorded).
        ApprovalSettledError: the request was already settled otherwise.
    """
    from keel.approvals import (
        ApprovalDecision,
        arguments_digest,
        check_corrected_arguments,
        repeats_standing,
    )
    from keel.errors import ApprovalSettledError, UsageError

    async def settle(backends: Backends) -> tuple[ApprovalRequest, bool]:
        found = await backends.approvals.aget(tenant, request_id)
        if found is None:
            raise UsageError(f"no approval request {request_id!r} in tenant {tenant!r}")
        if verdict.arguments is not None:
            check_corrected_arguments(found, verdict.arguments)
        note, arguments = await run_blocking(_masked, backends, found, verdict)
        decision = ApprovalDecision(
            approve=verdict.approve,
            by=verdict.by,
            note=note,
            arguments=arguments,
            action=verdict.action,
            decided_at=time.time(),
            channel="cli",
            # Bound to exactly what it approves: the corrected arguments, else the request's.
            arguments_digest=arguments_digest(arguments or found.arguments),
        )
        status: ApprovalStatus = "approved" if verdict.approve else "rejected"
        try:
            standing, settled = await backends.approvals.adecide(
                tenant, request_id, status, decision
            )
        except KeyError:
            raise UsageError(f"no approval request {request_id!r} in tenant {tenant!r}") from None
        if not settled and not repeats_standing(standing, decision):
            raise ApprovalSettledError(standing)
        return standing, settled

    request, settled = _on_backends(database, settle)
    verb = "approved" if verdict.approve else "rejected"
    by = request.decision.by if request.decision is not None else verdict.by
    out_console.print(f"{request_id}: {'' if settled else 'already '}{verb} by {by}")


def _masked(
    backends: Backends, request: ApprovalRequest, verdict: _Verdict
) -> tuple[str | None, str | None]:
    """The verdict's note and corrected arguments (JSON) as the queue stores them: masked
    as the request's user's own turns are.

    Raises:
        UsageError: corrected arguments hold a value that only a PII vault could give the
            tool back, and there is none (it would be given a placeholder).
    """
    from keel.errors import UsageError
    from keel.tracing import redact_json

    note = None if verdict.note is None else _mask_for_user(backends, request, verdict.note)
    if verdict.arguments is None:
        return note, None
    masked = redact_json(verdict.arguments, lambda text: _mask_for_user(backends, request, text))
    if backends.vault is None and masked != verdict.arguments:
        raise UsageError(
            "the corrected arguments hold personal data, and without a PII vault "
            "(KEEL_PII_KEY) the tool would be given placeholders instead of the values: "
            "nothing was decided"
        )
    return note, json.dumps(masked, ensure_ascii=False, sort_keys=True)


def _mask_for_user(backends: Backends, request: ApprovalRequest, text: str) -> str:
    """``text`` as keel stores what concerns the request's user: masked with the configured
    masker through the user's view of the vault, so that a value has the one placeholder it
    has in every turn of theirs and resolves for the tool (without a vault, numbered per
    text: the values are gone; with masking off, as it is)."""
    masker = backends.privacy
    if masker is None or not text:
        return text
    if backends.vault is None:
        return masker.mask_text(text, tenant_id=request.tenant_id)
    user_vault = backends.vault.user(request.tenant_id, request.user_id)
    return masker.mask_text(
        text, tenant_id=request.tenant_id, batch_numbering=user_vault.placeholders
    )


def _verdict(
    approve: bool,
    by: str | None,
    note: str | None,
    arguments: dict[str, Any] | None,
    action: Literal["retry", "skip", "answer"] | None = None,
) -> _Verdict:
    name = by or getpass.getuser()
    who = name if name.startswith("operator:") else f"operator:{name}"
    return _Verdict(approve, who, note, arguments, action)


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
    chosen = cast('Literal["retry", "skip", "answer"] | None', action)
    _decide(request_id, tenant, database, _verdict(True, by, note, _corrected(arguments), chosen))


@approvals_app.command("reject")
def approvals_reject_command(
    request_id: Annotated[str, typer.Argument(help="The request's id (keel approvals list).")],
    note: Annotated[str, typer.Option("--note", help="Why: the model is shown it.")],
    by: ByOption = None,
    tenant: TenantOption = "default",
    database: DatabaseOption = None,
) -> None:
    """Reject a request: the call does not run; the model is told who rejected it and why."""
    _decide(request_id, tenant, database, _verdict(False, by, note, None))


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
