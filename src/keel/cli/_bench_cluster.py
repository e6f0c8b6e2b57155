"""``keel bench redis-cluster``: state writes on a real Redis Cluster while a slot range is
resharded and a primary killed, then every node crashed: lost and duplicated writes, counted
from the state, with the durability docs/deployment.md asks for and with none."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonLastOption, bench_app, emit_or_show, err_console, out_console

_CONFIGURATIONS = ("durable", "defaults")


@bench_app.command("redis-cluster")
def bench_redis_cluster_command(
    sessions: Annotated[int, typer.Option(min=1, help="Sessions the writers share.")] = 200,
    writers: Annotated[int, typer.Option(min=1, help="Concurrent writers (one process).")] = 32,
    seconds: Annotated[
        float, typer.Option(min=2, help="Seconds of load around the reshard and the failover.")
    ] = 12.0,
    slots: Annotated[
        int, typer.Option(min=1, max=5000, help="Slots `redis-cli --cluster reshard` moves.")
    ] = 2000,
    only: Annotated[
        str | None,
        typer.Option(
            help="One configuration: durable (appendfsync always, WAIT 1) or defaults (no "
            "persistence, no WAIT)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the writers' choices.")] = 48,
    as_json: JsonLastOption = False,
) -> None:
    """A 3+3 Redis Cluster on loopback ports (redis-server, redis-cli), once durable and once
    as the tests run it: writers update sessions with compare-and-set while slots are
    resharded and a primary is SIGKILLed, then every node is SIGKILLed and started again;
    acknowledged writes lost, writes duplicated, sessions whose version disagrees with their
    items, writes per second, takeover time."""
    from keel.bench.redis_cluster import run_redis_cluster_bench

    if only is not None and only not in _CONFIGURATIONS:
        raise typer.BadParameter(f"--only takes durable or defaults, not {only!r}")
    report = run_redis_cluster_bench(
        sessions=sessions,
        writers=writers,
        seconds=seconds,
        slots=slots,
        seed=seed,
        configurations=_CONFIGURATIONS if only is None else (only,),
        progress=err_console.print,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    for name in _CONFIGURATIONS:
        if name not in report:
            continue
        run = report[name]
        faults, crash = run["after_reshard_and_failover"], run["after_every_node_crashed"]
        out_console.print(
            f"{name} (WAIT {run['wait_replicas']}, {run['appendfsync']}): "
            f"{run['writes_per_s']} writes/s; reshard + failover: {faults['lost']} of "
            f"{faults['acknowledged']} acknowledged writes lost, {faults['duplicated']} "
            f"duplicated; every node crashed: {crash['lost']} lost, "
            f"{crash['sessions_missing']} sessions gone",
            markup=False,
        )
