"""``keel serve`` (the agent as an HTTP service) and ``keel keys`` (its API keys)."""

from __future__ import annotations

import errno
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel._urls import redact_url
from keel.cli._app import app, bench_app, emit_json, err_console, out_console
from keel.cli._database import CreateOption, DatabaseOption

if TYPE_CHECKING:
    import socket

    from keel.service import APIKeys, ServeOptions
    from keel.settings import Settings
    from keel.stores import Backends

keys_app = typer.Typer(
    help="API keys of `keel serve`: each names one tenant.", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")


def _keys(
    database: str | None, *, writes: bool = False, create: bool = False
) -> tuple[Backends, APIKeys]:
    from keel.cli._database import database_settings
    from keel.service import APIKeys as Keys
    from keel.stores import Backends as Stores

    settings = database_settings(database, writes=writes, create=create)
    # The keys live in the SQL database: no memory, and state stays off Redis.
    backends = Stores.open(settings, memory=False, redis_url="")
    return backends, Keys(backends.sql)


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    user: Annotated[
        str | None,
        typer.Option(help="The one user the key acts for (without: the tenant's operator key)."),
    ] = None,
    database: DatabaseOption = None,
    create: CreateOption = False,
) -> None:
    """Create a key for TENANT (for one USER of it, with --user) and print it: it is shown
    this once, only its hash is kept. A key without --user is the tenant's operator key: it
    reaches every user's sessions, memory and runs (its reads of them are logged)."""
    backends, keys = _keys(database, writes=True, create=create)
    try:
        created = keys.create(tenant, user)
        out_console.print(created, markup=False, highlight=False, soft_wrap=True)
    finally:
        backends.close()


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    database: DatabaseOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The keys (ids, tenants, scopes, dates; never their secrets). A key's scope is
    ``operator`` (tenant-wide) or ``user:<id>``."""
    backends, keys = _keys(database)
    try:
        found = keys.list(tenant)
    finally:
        backends.close()
    rows = [
        {
            "key_id": k.key_id,
            "tenant": k.tenant_id,
            "scope": k.scope,
            "user": k.user_id,
            "created_at": k.created_at,
            "revoked": k.revoked,
        }
        for k in found
    ]
    if as_json:
        emit_json({"keys": rows})
        return
    for row in rows:
        state = "revoked" if row["revoked"] else "active"
        line = f"{row['key_id']}  {row['tenant']}  {row['scope']}  {state}"
        out_console.print(line, markup=False)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (the part after keel_).")],
    database: DatabaseOption = None,
) -> None:
    """Revoke a key: requests with it get 401 (within the servers' key cache time)."""
    from keel.errors import UsageError

    backends, keys = _keys(database)
    try:
        if not keys.revoke(key_id):
            raise UsageError(f"no active key {key_id!r}")
    finally:
        backends.close()
    out_console.print(f"revoked {key_id}")


def _secret(name: str, environment: str, path: Path | None) -> str | None:
    """A secret from its file (``path``) or the environment: never from the arguments, which
    ``ps`` shows to every user of the machine."""
    import os

    from keel.errors import UsageError

    if path is not None:
        try:
            value = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UsageError(f"cannot read the {name} file {path}: {exc.strerror}") from exc
        if not value:
            raise UsageError(f"the {name} file {path} is empty")
        return value
    return os.environ.get(environment) or None


_DEFAULT_PROMPT = "You are a helpful, concise assistant."


def _listening_socket(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound here so that an address that cannot be had is
    one clear error before anything starts (uvicorn would log and exit 3 on its own).

    Raises:
        ConfigError: the address is in use, not this machine's, or not ours to take.
    """
    import socket as sockets

    from keel.errors import ConfigError

    family = sockets.AF_INET6 if ":" in host else sockets.AF_INET
    listening = sockets.socket(family, sockets.SOCK_STREAM)
    listening.setsockopt(sockets.SOL_SOCKET, sockets.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            why = "the address is already in use (stop what holds it or choose another --port)"
        elif exc.errno == errno.EACCES:
            why = "permission denied (ports below 1024 need privileges: choose another --port)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = "the address is not one of this machine's (check --host)"
        else:
            why = exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {where}: {why}") from None
    except (OverflowError, sockets.gaierror) as exc:
        listening.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    listening.set_inheritable(True)
    return listening


def _listening_line(
    listening: socket.socket, options: ServeOptions, settings: Settings, workers: int
) -> str:
    """What ``keel serve`` says once it takes traffic: where, what, on what."""
    host, port = listening.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    # A model server's URL in the spec may hold a password: the line goes to every log.
    serving = (
        f"agent {options.agent}"
        if options.agent
        else f"model {redact_url(options.model or settings.model)}"
    )
    count = "1 worker" if workers == 1 else f"{workers} workers"
    database = settings.parsed_database.redacted
    where = f"http://{shown_host}:{port}"
    return f"keel serve: listening on {where} · {serving} · database {database} · {count}"


def _say(line: str) -> None:
    # Logs go to stderr (JSON lines with --log-format json); this line is the command's output.
    out_console.print(line, markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()


def _run_workers(
    options: ServeOptions,
    workers: int,
    transport: dict[str, Any],
    listening: socket.socket,
    on_ready: Callable[[], None],
) -> None:
    """``workers`` processes, each building the service from ``options`` and draining on
    SIGTERM as a single process does; ``on_ready`` once every one of them takes traffic.

    Raises:
        ConfigError: a worker stopped before it was ready (its error is in the log).
    """
    import os

    from keel.errors import ConfigError
    from keel.service._drain import DrainingMultiprocess
    from keel.service._factory import SERVE_ENV
    from keel.service._protocol import ServiceConfig

    # Each worker process builds its own service from these options, validated again there
    # (the environment, not the arguments: they may hold a secret).
    os.environ[SERVE_ENV] = options.to_json()
    config = ServiceConfig(
        "keel.service._factory:create", factory=True, workers=workers, **transport
    )
    supervisor = DrainingMultiprocess(config, sockets=[listening], on_ready=on_ready)
    supervisor.run()
    if supervisor.failed_exit_code is not None:
        raise ConfigError(
            f"a worker stopped before it was ready (exit code {supervisor.failed_exit_code}); "
            "its error is logged above"
        )


@app.command("serve")
def serve_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free port).")
    ] = 8000,
    database: DatabaseOption = None,
    create: CreateOption = False,
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            help="Your application's agent, as MODULE:ATTRIBUTE (found from the current "
            "directory, as uvicorn finds main:app): an Agent, or a function returning one, "
            "called as f() or f(settings) once per tenant. Not with --model/--system-prompt.",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model spec (default: settings.model).")
    ] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option(help=f"The agent's system prompt (default: {_DEFAULT_PROMPT!r})."),
    ] = None,
    memory: Annotated[bool, typer.Option(help="Use long-term memory.")] = True,
    max_body_bytes: Annotated[int, typer.Option(help="Larger request bodies get 413.")] = 1_000_000,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes (any of them serves any session).")
    ] = 1,
    rate_limit: Annotated[
        int | None,
        typer.Option(help="Requests per API key and minute (429 beyond; off when not given)."),
    ] = None,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the token for GET /metrics (Prometheus), else KEEL_METRICS_TOKEN; "
            "without either the route is off."
        ),
    ] = None,
    metrics_token: Annotated[
        str | None, typer.Option(hidden=True, help="Refused: ps shows it.")
    ] = None,
    header_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a request's headers may take (else closed).")
    ] = 10.0,
    body_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a request's body may take (else 408).")
    ] = 30.0,
    drain_timeout: Annotated[
        float, typer.Option(min=0, help="On SIGTERM, the longest the turns in flight are awaited.")
    ] = 60.0,
    log_format: Annotated[
        str, typer.Option(help="Log lines as text or json (one access line per request).")
    ] = "text",
    operators_see_values: Annotated[
        bool,
        typer.Option(
            help="With a PII vault (KEEL_PII_KEY): a tenant's operator key reads its users' "
            "values in histories (without it, placeholders; a user key reads its own values)."
        ),
    ] = False,
) -> None:
    """Serve the agent over HTTP (sessions, turns as JSON or server-sent events, runs, and
    OpenAI's chat completions); every request needs an API key from `keel keys create
    --tenant T`. --agent serves your application's agent (`keel serve --agent main:build`),
    else --model with --system-prompt. With --workers N, N processes serve any session each,
    on the same database (use PostgreSQL, and Redis, to scale out). SIGTERM drains: turns in
    flight finish, new requests get 503 with Retry-After."""
    from keel.cli._database import database_settings
    from keel.service import ServeOptions

    settings = database_settings(database, writes=True, create=create)
    _refuse_flags(metrics_token, log_format, agent=agent, model=model, prompt=system_prompt)
    options = ServeOptions(
        database=database,
        model=model,
        agent=agent,
        system_prompt=system_prompt or _DEFAULT_PROMPT,
        memory=memory,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout,
        metrics_token=_secret("metrics token", "KEEL_METRICS_TOKEN", metrics_token_file),
        rate_limit_per_minute=rate_limit,
        operators_see_values=operators_see_values,
    )
    transport: dict[str, Any] = {
        "host": host,
        "port": port,
        "header_timeout_s": header_timeout,
        "body_timeout_s": body_timeout,
        "drain_timeout_s": drain_timeout,
        "log_format": log_format,
    }
    listening = _listening_socket(host, port)
    try:
        if workers > 1:
            _check_vault(settings)
            _check_agent(options, settings)
            line = _listening_line(listening, options, settings, workers)
            _run_workers(options, workers, transport, listening, partial(_say, line))
        else:
            _run_one(options, settings, transport, listening)
    finally:
        listening.close()


def _refuse_flags(
    metrics_token: str | None,
    log_format: str,
    *,
    agent: str | None,
    model: str | None,
    prompt: str | None,
) -> None:
    from keel.errors import UsageError

    if metrics_token is not None:
        raise UsageError(
            "--metrics-token shows in ps to every user of this machine: set KEEL_METRICS_TOKEN "
            "or pass --metrics-token-file"
        )
    if log_format not in ("text", "json"):
        raise UsageError(f"--log-format {log_format!r}: text or json")
    if agent is not None and (model is not None or prompt is not None):
        given = " and ".join(
            flag for flag, value in (("--model", model), ("--system-prompt", prompt)) if value
        )
        raise UsageError(
            f"--agent {agent} brings its own model and system prompt: drop {given} (set the "
            "model in your factory, or read it from the settings it is given)"
        )


def _check_vault(settings: Settings) -> None:
    """Open the stores once here, so that a PII master key that is malformed or not this
    vault's stops the command with its error (VaultKeyError) before any worker starts: a
    worker failing alone would be restarted, and nothing would say why."""
    from keel.stores import Backends as Stores

    Stores.open(settings, memory=False, redis_url="").close()


def _check_agent(options: ServeOptions, settings: Settings) -> None:
    """Load ``--agent`` and build it once here, for the same reason: a spec or a factory that
    fails is one error line, not workers failing and restarting."""
    if options.agent is None:
        return
    from keel.service._source import AgentSource, load_agent

    spec = options.agent
    built = AgentSource(load_agent(spec), f"--agent {spec!r}").check(settings)
    if built.backends is not None:
        built.backends.close()


def _run_one(
    options: ServeOptions,
    settings: Settings,
    transport: dict[str, Any],
    listening: socket.socket,
) -> None:
    """One process; SIGTERM: turns in flight finish, new requests get 503, then it stops."""
    import logging.config

    from keel.service import Drain, DrainingServer
    from keel.service._logging import logging_config
    from keel.service._protocol import ServiceConfig

    # The service's logging (stderr) from the start, as a worker process has it: what the
    # build logs (a Redis that can lose writes) is said where the server's lines are.
    logging.config.dictConfig(logging_config(transport["log_format"]))
    drain = Drain()
    service, _, _ = options.build(drain=drain, settings=settings)
    # Said once the app's start-up (the agent's servers, the embedder, the connections) is
    # done and the socket accepts: a client that waits for the line is then answered.
    said = partial(_say, _listening_line(listening, options, settings, 1))
    server = DrainingServer(ServiceConfig(service, **transport), drain, on_started=said)
    # Once drained, uvicorn raises again the signal it stopped on, with the handlers it found:
    # under the default ones this process would end killed by SIGTERM (143) or with a
    # KeyboardInterrupt, where `--workers N` exits 0. Handlers that take the raised signal
    # and do nothing make a drained stop exit 0 either way.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _drained)
    server.run(sockets=[listening])


def _drained(signum: int, frame: object) -> None:
    """The stop signal uvicorn raises again after its drain: already handled."""


@bench_app.command("serve")
def bench_serve_command(
    workers: Annotated[int, typer.Option(min=1, help="Worker processes on PostgreSQL.")] = 4,
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent sessions.")] = 200,
    duration: Annotated[
        float | None,
        typer.Option(
            min=1, help="Seconds of load (60; 30 with --hostile; 30 per kind with --chaos)."
        ),
    ] = None,
    kill_every: Annotated[
        float, typer.Option(min=0, help="Seconds between SIGKILLs of a random worker (0: none).")
    ] = 5.0,
    model_latency_ms: Annotated[
        float, typer.Option(min=0, help="The scripted model's latency per call.")
    ] = 300.0,
    think: Annotated[
        float, typer.Option(min=0, help="Mean seconds a session waits between its turns.")
    ] = 0.0,
    lease_ttl: Annotated[
        float, typer.Option(min=0.1, help="Session lease time to live (a dead worker's holds).")
    ] = 2.0,
    sqlite: Annotated[bool, typer.Option(help="Also run on SQLite with one worker.")] = True,
    memory: Annotated[
        bool,
        typer.Option(
            help="Give the workers' agents long-term memory (the embedder KEEL_EMBEDDER names)."
        ),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the kills and the client's jitter.")] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object last.")] = False,
    hostile: Annotated[
        bool,
        typer.Option(
            "--hostile",
            help="Instead: one SQLite worker serving 8 normal sessions while 20 clients send it "
            "10 MB chunked bodies and bodies a byte a second.",
        ),
    ] = False,
    chaos: Annotated[
        str | None,
        typer.Option(
            "--chaos",
            help="Instead of worker kills, infrastructure faults, one phase of --duration "
            "(default 30 s) per kind: postgres (stopped 2-10 s, fast or immediate), redis "
            "(stopped and restarted), network (a proxy resets connections), disk (the "
            "database's tmpfs full; needs root), mcp (an MCP server killed, hung, down). "
            "Comma-separated.",
        ),
    ] = None,
) -> None:
    """The service under load on PostgreSQL + Redis while workers are SIGKILLed and restarted:
    lost and duplicated turns, double effects (counted from the effects), keel-added latency,
    RSS; then the same on SQLite with one worker. With --hostile, against hostile clients; with
    --chaos, while PostgreSQL, Redis, the network, the disk or an MCP server fail (no kills)."""
    if hostile:
        _bench_hostile(duration or 30.0, seed, as_json)
        return
    if chaos is not None:
        from keel.bench.serve_chaos import run_chaos_bench

        kinds = [kind.strip() for kind in chaos.split(",") if kind.strip()]
        _bench_chaos(
            run_chaos_bench,
            kinds,
            as_json,
            workers=workers,
            sessions=sessions,
            duration_s=duration or 30.0,
            model_latency_ms=model_latency_ms,
            think_s=think,
            lease_ttl_s=lease_ttl,
            seed=seed,
            progress=lambda text: err_console.print(text, markup=False),
        )
        return
    from keel.bench.serve import run_serve_bench

    report = run_serve_bench(
        workers=workers,
        sessions=sessions,
        duration_s=duration or 60.0,
        kill_every_s=kill_every,
        model_latency_ms=model_latency_ms,
        think_s=think,
        lease_ttl_s=lease_ttl,
        sqlite=sqlite,
        memory=memory,
        seed=seed,
        progress=lambda text: err_console.print(text),
    )
    if as_json:
        emit_json(report)
        return
    runs = [("postgresql+redis", report)]
    if "sqlite" in report:
        runs.append(("sqlite", report["sqlite"]))
    for name, figures in runs:
        added = figures["keel_added_ms"]
        out_console.print(
            f"{name}: {figures['workers']} workers, {figures['sessions']} sessions, "
            f"{figures['kills']} kills: {figures['turns_committed']} turns committed "
            f"({figures['turns_per_s']}/s), keel-added p50/p95/p99 {added['p50']}/"
            f"{added['p95']}/{added['p99']} ms on turns no kill touched; lost "
            f"{figures['lost_turns']}, duplicated {figures['duplicated_turns']}, double effects "
            f"{figures['double_effects']}; RSS max {figures['rss_mb_max']} MB",
            markup=False,
        )


def _bench_chaos(run: Any, kinds: list[str], as_json: bool, **options: Any) -> None:
    """``keel bench serve --chaos``: the report, one line per kind (or the JSON)."""
    try:
        report = run(kinds, **options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--chaos") from None
    if as_json:
        emit_json(report)
        return
    for kind, figures in report["chaos"].items():
        if "skipped" in figures:
            out_console.print(f"{kind}: skipped ({figures['skipped']})", markup=False)
            continue
        out_console.print(
            f"{kind}: {figures['injections']} faults, {figures['down_s']} s down; "
            f"{figures['committed']} of {figures['turns_sent']} turns committed, "
            f"{figures['failed_fast']} answers 503 (slowest {figures['failed_fast_ms_max']} ms); "
            f"lost {figures['lost_turns']}, duplicated {figures['duplicated_turns']}, double "
            f"effects {figures['double_effects']}, in doubt {figures['in_doubt']}; recovered "
            f"in {figures['recover_s_p50']} s p50, {figures['recover_s_max']} s max",
            markup=False,
        )
    added = report["keel_added_ms"]
    out_console.print(
        f"keel-added outside the fault windows: p50 {added['p50']} ms, p99 {added['p99']} ms",
        markup=False,
    )


def _bench_hostile(duration_s: float, seed: int, as_json: bool) -> None:
    from keel.bench.serve import run_hostile_bench

    report = run_hostile_bench(
        duration_s=duration_s, seed=seed, progress=lambda text: err_console.print(text)
    )
    if as_json:
        emit_json(report)
        return
    out_console.print(
        f"{report['hostile_requests']} hostile requests ({report['refused_413']} refused 413, "
        f"{report['timed_out_408']} timed out 408); normal turns lost "
        f"{report['normal_turns_lost']} of {report['normal_turns_sent']}; peak RSS "
        f"{report['peak_rss_mb']} MB = {report['peak_rss_ratio']}x idle; /health p99 "
        f"{report['health_p99_ms']} ms",
        markup=False,
    )
