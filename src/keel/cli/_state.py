"""``keel bench state`` (the durable-state benchmark) and ``keel state ...`` (operations)."""

from __future__ import annotations

import difflib
from contextlib import closing
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import (
    JsonLastOption,
    JsonOption,
    app,
    bench_app,
    emit_json,
    emit_or_show,
    err_console,
    out_console,
)

if TYPE_CHECKING:
    from keel.state import StateBackend


@bench_app.command("state")
def bench_state_command(
    steps: Annotated[int, typer.Option(help="Steps (one message and one checkpoint each).")] = 1000,
    writers: Annotated[int, typer.Option(help="Concurrent writers in the conflict phase.")] = 16,
    increments: Annotated[int, typer.Option(help="Increments per concurrent writer.")] = 5,
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", "-b", help="sqlite, postgres, redis (repeat; default all)."),
    ] = None,
    postgres_url: Annotated[
        str | None, typer.Option(help="PostgreSQL URL; default: start a local server.")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL; default: start a local redis-server.")
    ] = None,
    langgraph: Annotated[
        bool, typer.Option(help="Also run LangGraph's SqliteSaver on the same workload.")
    ] = True,
    as_json: JsonLastOption = False,
) -> None:
    """Checkpoints/s, read latency, bytes and lost updates per backend, versus LangGraph."""
    from keel.bench.state import run_state_bench
    from keel.errors import UsageError

    chosen = tuple(backend or ("sqlite", "postgres", "redis"))
    unknown = sorted(set(chosen) - {"sqlite", "postgres", "redis"})
    if unknown:
        raise UsageError(f"unknown backend(s) {', '.join(unknown)}: use sqlite, postgres, redis")
    if steps < 1 or writers < 1 or increments < 1:
        raise UsageError("steps, writers and increments must be >= 1")
    results = run_state_bench(
        steps=steps,
        writers=writers,
        increments=increments,
        backends=chosen,
        postgres_url=postgres_url,
        redis_url=redis_url,
        langgraph=langgraph,
        progress=err_console.print,
    )
    emit_or_show(results, as_json, _show_bench)


def _show_bench(results: dict[str, Any]) -> None:
    for name, figures in results["backends"].items():
        out_console.print(
            f"{name:<9} {figures['checkpoints_per_s']:>9.1f} checkpoints/s  "
            f"read p50 {figures['read_ms_p50']:.2f} ms  {figures['bytes_total']:>10} bytes  "
            f"conflicts {figures['conflicts_detected']}  lost updates {figures['lost_updates']}"
        )
    lang = results.get("langgraph_sqlite")
    if lang:
        out_console.print(
            f"{'langgraph':<9} {lang['checkpoints_per_s']:>9.1f} checkpoints/s  "
            f"read p50 {lang['read_ms_p50']:.2f} ms  {lang['bytes_total']:>10} bytes"
        )


state_app = typer.Typer(
    help="Inspect and maintain stored session state (sessions, history, vacuum).",
    no_args_is_help=True,
)
app.add_typer(state_app, name="state")

_URL_HELP = (
    "The state's database URL (sqlite:///..., postgresql://..., redis://...; default: "
    "KEEL_REDIS_URL when set, else KEEL_DATABASE, else keel.db in the data directory). A "
    "SQLite file must exist."
)
UrlOption = Annotated[str | None, typer.Option("--database", "--url", help=_URL_HELP)]


def _open(url: str | None) -> StateBackend:
    """The state backend ``url`` names, alone: closing it closes its database. A URL says
    where the state is, whatever ``KEEL_REDIS_URL`` says; without one, the state is where the
    configured deployment keeps it (on ``KEEL_REDIS_URL`` when set, as its agents do)."""
    from keel._urls import parse_database_url
    from keel.cli._database import database_settings
    from keel.settings import load_settings
    from keel.stores import Backends

    if url is not None and parse_database_url(url).kind == "redis":
        opened = Backends.open(url, settings=load_settings(), only=("state",))
    elif url is None:
        opened = Backends.open(database_settings(None), only=("state",))
    else:
        opened = Backends.open(database_settings(url), only=("state",), redis_url="")
    return opened.state.backend


@state_app.command("sessions")
def state_sessions_command(
    url: UrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the stored sessions."""
    with closing(_open(url)) as backend:
        sessions = backend.sessions()
    if as_json:
        emit_json({"sessions": sessions})
        return
    for session_id in sessions:
        out_console.print(session_id)


def near_sessions(typed: str, sessions: list[str], most: int = 3) -> list[str]:
    """The stored sessions ``typed`` may have meant: those spelled nearly alike (difflib, as
    click suggests commands), in full or without the tenant (``chat`` finds ``default/chat``:
    the store's keys name the tenant)."""
    tails: dict[str, list[str]] = {}
    for key in sessions:
        tails.setdefault(key.rpartition("/")[2], []).append(key)
    found = difflib.get_close_matches(typed, sessions, n=most)
    for tail in difflib.get_close_matches(typed.rpartition("/")[2], list(tails), n=most):
        found += tails[tail]
    return list(dict.fromkeys(found))[:most]


@state_app.command("history")
def state_history_command(
    session_id: Annotated[str, typer.Argument(help="The session.")],
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.")] = 20,
    url: UrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """A session's checkpoints: version, time, step, reason, storage kind and size, marks."""
    from keel.errors import StateError
    from keel.state import AgentState, StateStore

    with closing(_open(url)) as backend:
        every = StateStore(backend, AgentState).history(session_id)
        near = [] if every else near_sessions(session_id, backend.sessions())
    if not every:
        hint = "; keel state sessions lists them"
        if near:
            hint = f"; did you mean {' or '.join(map(repr, near))}? ({hint[2:]})"
        raise StateError(f"no state stored for session {session_id!r}{hint}")
    infos = every[:limit]
    if as_json:
        emit_json(
            {"session_id": session_id, "checkpoints": [i.model_dump(mode="json") for i in infos]}
        )
        return
    marks = {True: "good", False: "bad", None: ""}
    for info in infos:
        out_console.print(
            f"v{info.version:<6} {info.created_at:%Y-%m-%d %H:%M:%S}  step {info.step:<5} "
            f"{info.reason:<20} {info.kind:<5} {info.size_bytes:>8} B  {marks[info.good]}"
        )


@state_app.command("vacuum")
def state_vacuum_command(
    keep_last: Annotated[
        int | None, typer.Option(help="Keep at most this many checkpoints per session.")
    ] = None,
    max_age: Annotated[
        float | None, typer.Option(help="Drop checkpoints older than this many seconds.")
    ] = None,
    url: UrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete expired sessions and old checkpoints (the head and last good one always stay)."""
    from pydantic import ValidationError

    from keel.errors import UsageError
    from keel.state import Retention, vacuum

    try:
        retention = Retention(keep_last=keep_last, max_age_s=max_age)
    except ValidationError as exc:
        raise UsageError(f"invalid retention: {exc.errors()[0]['msg']}") from exc
    with closing(_open(url)) as backend:
        report = vacuum(backend, retention)
    if as_json:
        emit_json(report.model_dump())
        return
    out_console.print(
        f"expired sessions removed: {len(report.expired_sessions)}; checkpoints deleted: "
        f"{report.checkpoints_deleted}; rebased as snapshots: {report.checkpoints_rebased}"
    )
