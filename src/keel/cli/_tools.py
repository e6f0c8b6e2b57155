"""``keel bench faults`` (the Agent against seeded faulty runs) and ``keel tools ...``
(an operator's view of the exactly-once journal)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from keel.cli._app import JsonOption, app, bench_app, emit_json, out_console
from keel.cli._database import DatabaseOption
from keel.errors import UsageError

if TYPE_CHECKING:
    from keel.stores import Backends
    from keel.tools import JournalEntry, ToolJournal


@bench_app.command("faults")
def bench_faults_command(
    runs: Annotated[int, typer.Option("--runs", min=1, help="Randomized faulty runs.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed; the same seed, the same runs.")] = 0,
    kills: Annotated[
        int,
        typer.Option(
            "--kills", min=0, help="How many of the runs are a worker SIGKILLed mid-turn."
        ),
    ] = 4,
    pairs: Annotated[
        int,
        typer.Option("--pairs", min=0, help="How many of the runs are two workers on one session."),
    ] = 2,
    pair_turns: Annotated[
        int, typer.Option("--pair-turns", min=1, help="Turns each worker of a pair sends.")
    ] = 6,
    as_json: JsonOption = False,
) -> None:
    """Run seeded faulty runs through the Agent and count what went wrong, from the effects."""
    from keel.bench.faults import run_fault_bench

    report = run_fault_bench(runs, seed=seed, kills=kills, pairs=pairs, pair_turns=pair_turns)
    payload = report.model_dump()
    if as_json:
        emit_json(payload)
        return
    out_console.print(f"{report.runs} runs in {report.seconds:.1f} s (seed {seed})")
    for name, value in payload.items():
        if name not in ("runs", "seconds", "by_fault", "failures"):
            out_console.print(f"  {name:<30} {value}")
    out_console.print("by fault:")
    for fault, row in report.by_fault.items():
        detail = ", ".join(f"{status} {count}" for status, count in row.items() if status != "runs")
        out_console.print(f"  {fault:<24} {row['runs']:>4} runs: {detail}")
    for failure in report.failures:
        out_console.print(f"  [red]failure[/] {failure}", markup=True)


tools_app = typer.Typer(
    help="Operate on the tool journal: side-effecting calls that are in doubt after a crash.",
    no_args_is_help=True,
)
app.add_typer(tools_app, name="tools")


@contextlib.contextmanager
def _journal(database: str | None) -> Iterator[ToolJournal]:
    with _backends(database) as backends:
        yield backends.journal


@contextlib.contextmanager
def _backends(database: str | None) -> Iterator[Backends]:
    from keel.cli._database import database_settings
    from keel.stores import Backends

    with Backends.open(database_settings(database), memory=False, redis_url="") as backends:
        yield backends


def _revealed(backends: Backends, entries: list[JournalEntry]) -> list[JournalEntry]:
    """``entries`` with their arguments as the tool got them: each session's user's
    placeholders replaced by their values (the journal keeps them masked), each read logged
    on ``keel.service.access`` as the service logs an operator's."""
    access_log = logging.getLogger("keel.service.access")
    vault = backends.vault
    if vault is None:
        raise UsageError(
            "--reveal needs the PII key the agent masked with (KEEL_PII_KEY or "
            "KEEL_PII_KEY_FILE): without it no value was kept"
        )
    shown: list[JournalEntry] = []
    for entry in entries:
        checkpoint = backends.state.get(entry.session_id)
        runtime = None if checkpoint is None else checkpoint.state.runtime
        if runtime is None or not runtime.tenant_id or not runtime.user_id:
            shown.append(entry)  # no owner on record: nothing of anyone's to reveal
            continue
        access_log.info(
            "cli operator read the arguments of in-doubt call %r of tenant %r user %r",
            entry.key,
            runtime.tenant_id,
            runtime.user_id,
        )
        arguments = vault.user(runtime.tenant_id, runtime.user_id).reveal(entry.arguments)
        shown.append(entry.model_copy(update={"arguments": arguments}))
    return shown


@tools_app.command("in-doubt")
def tools_in_doubt_command(
    session: Annotated[
        str | None, typer.Option("--session", help="Only this session's calls.")
    ] = None,
    database: DatabaseOption = None,
    reveal: Annotated[
        bool,
        typer.Option(
            "--reveal",
            help="Show the arguments with the session user's values, as the tool got them "
            "(the journal keeps them masked; needs the PII key; each read is logged on "
            "keel.service.access).",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List side-effecting calls that started and recorded no result (check them by hand)."""
    with _backends(database) as backends:
        entries = backends.journal.in_doubt(session)
        if reveal:
            entries = _revealed(backends, entries)
    if as_json:
        emit_json({"in_doubt": [entry.model_dump() for entry in entries]})
        return
    if not entries:
        out_console.print("no tool calls in doubt")
        return
    for entry in entries:
        out_console.print(
            f"{entry.key}  session={entry.session_id} step={entry.step} "
            f"tool={entry.tool} attempts={entry.attempts} arguments={entry.arguments}"
        )


_SHOWN_CHARS = 200
"""How much of a settled call's recorded output ``keel tools resolve`` shows."""


class Outcome(StrEnum):
    """What really happened to a call in doubt, as the operator found it."""

    succeeded = "succeeded"
    failed = "failed"


@tools_app.command("resolve")
def tools_resolve_command(
    key: Annotated[str, typer.Argument(help="The idempotency key of the in-doubt call.")],
    # A choice, checked as it is parsed: a wrong --outcome is the first thing said, before a
    # missing --content.
    outcome: Annotated[
        Outcome, typer.Option("--outcome", help="What really happened: 'succeeded' or 'failed'.")
    ],
    content: Annotated[
        str, typer.Option("--content", help="The result the model will be shown on resume.")
    ],
    database: DatabaseOption = None,
) -> None:
    """Record the outcome of an in-doubt call after checking it by hand (a call already
    settled, by its late result or another operator, is left as it is, and said how)."""
    with _journal(database) as journal:
        entry = journal.get(key)
        if entry is None:
            raise UsageError(f"no tool call {key!r} in the journal")
        if not entry.in_doubt:
            # An operator's repeat, or a result that came in late: harmless, nothing to do. The
            # recorded output says how ("[settled by an operator] ..." or the tool's own).
            settled = " ".join((entry.output or entry.content or "").split())
            if len(settled) > _SHOWN_CHARS:
                settled = settled[: _SHOWN_CHARS - 1] + "…"
            ignored = f"; --outcome {outcome.value} not recorded"
            note = "" if entry.status == outcome.value else ignored
            out_console.print(
                f"{key} is already settled as {entry.status}: {settled} (nothing changed{note})",
                markup=False,
                highlight=False,
            )
            return
        journal.resolve(key, ok=outcome is Outcome.succeeded, content=content)
    out_console.print(f"{key}: recorded as {outcome.value}")
