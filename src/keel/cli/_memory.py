"""``keel memory ...`` and the memory benchmarks (``keel bench locomo``, ``keel bench memory``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
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
from keel.cli._database import DatabaseOption

if TYPE_CHECKING:
    from keel.memory import Embedder, Memory, MemoryStore

memory_app = typer.Typer(help="Long-term memory: status and maintenance.", no_args_is_help=True)
app.add_typer(memory_app, name="memory")


def _progress_bar(enabled: bool) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=not enabled,
        transient=True,
    )


@contextmanager
def _stage_progress(name: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar on stderr, and the ``progress(stage, done, total)`` a bench reports to."""
    with _progress_bar(True) as progress:
        task = progress.add_task(name, total=None)

        def report(stage: str, done: int, total: int) -> None:
            progress.update(task, description=stage, completed=done, total=total)

        yield report


@contextmanager
def _memory(database: str | None) -> Iterator[Memory]:
    """The memory of ``--database`` (else the configured one), closed after."""
    from keel.cli._database import database_settings
    from keel.stores import Backends

    # Memory only; its records embed here, not in a background worker.
    backends = Backends.open(database_settings(database), redis_url="", background=False)
    memory = backends.memory
    assert memory is not None
    try:
        yield memory
    finally:
        backends.close()


@memory_app.command("status")
def status_command(
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show which embedding models produced the stored vectors."""
    with _memory(database) as memory:
        status = memory.embedding_status()
    payload = {
        "configured": status.configured,
        "counts": status.counts,
        "stale": status.stale,
        "missing": status.missing,
        "needs_reembed": status.needs_reembed,
    }
    if as_json:
        emit_json(payload)
        return
    out_console.print(f"embedding model: {status.configured}")
    for model, count in sorted(status.counts.items()):
        out_console.print(f"  {model or '(not embedded yet)'}: {count} records")
    if status.needs_reembed:
        out_console.print(f"{status.stale} records use another model: run keel memory reembed")


@memory_app.command("prune")
def prune_command(
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="Prune this tenant only (default: every tenant)."),
    ] = None,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Apply the memory retention policies (KEEL_MEMORY_RETENTION: per tenant, by age and by
    count per user, for each kind) once: delete the records past them. Safe beside running
    workers (`keel serve` prunes on its own every KEEL_MEMORY_PRUNE_EVERY_S)."""
    from keel.cli._database import database_settings
    from keel.errors import UsageError
    from keel.memory import RetentionPolicies, prune_memory
    from keel.stores import Backends

    if tenant is not None and not tenant.strip():
        # Else it names no tenant at all and prunes nothing, reported as a clean run.
        raise UsageError("--tenant is empty: name a tenant, or leave it out to prune every one")
    settings = database_settings(database)
    policies = RetentionPolicies.parse(settings.memory_retention)
    if policies.empty:
        report_total, removed = 0, {}
    else:
        # Deleting needs no embedder and no vault: the memory store alone, on the database.
        with Backends.open(settings, redis_url="", memory=False, vault=False, only=()) as opened:
            store = opened.memory_store
            report = prune_memory(store, policies, tenant_id=tenant) if store else None
        removed = {} if report is None else report.removed
        report_total = 0 if report is None else report.total
    payload = {"policies": not policies.empty, "removed": removed, "total": report_total}
    emit_or_show(payload, as_json, _show_prune)


def _show_prune(payload: dict[str, Any]) -> None:
    if not payload["policies"]:
        out_console.print("no memory retention policy (set KEEL_MEMORY_RETENTION): nothing pruned")
        return
    out_console.print(f"pruned {payload['total']} memory records")
    for tenant, kinds in sorted(payload["removed"].items()):
        counts = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
        out_console.print(f"  {tenant}: {counts}")


@memory_app.command("reembed")
def reembed_command(
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Rebuild the vectors of every record not embedded by the configured model."""
    with _memory(database) as memory:
        before = memory.embedding_status()
        with _progress_bar(not as_json) as progress:
            task = progress.add_task("re-embedding", total=None)

            def report(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            done = memory.reembed(progress=report)
        after = memory.embedding_status()
    if as_json:
        emit_json(
            {
                "reembedded": done,
                "model": after.configured,
                "before": before.counts,
                "after": after.counts,
            }
        )
        return
    out_console.print(f"re-embedded {done} records with {after.configured}")


def _memory_store_on(
    stack: ExitStack, url: str, embedder: Embedder, *, hnsw: bool = True, halfvec: bool = False
) -> MemoryStore:
    """Memory's store on the bench's database ``url``, opened as keel opens it (closed by
    ``stack``), on a pool of 8 connections."""
    from keel.bench.memory import memory_backends
    from keel.settings import load_settings

    settings = load_settings().model_copy(update={"postgres_pool_size": 8})
    backends = stack.enter_context(
        memory_backends(url, embedder, settings=settings, hnsw=hnsw, halfvec=halfvec)
    )
    assert backends.memory is not None
    return backends.memory.store


def _fresh_postgres(stack: ExitStack, settings: dict[str, str] | None = None) -> str:
    """The URL of an empty database on a PostgreSQL started for this run (stopped by ``stack``)."""
    from keel.testing.servers import postgres_server

    server = stack.enter_context(postgres_server(settings=settings))
    return stack.enter_context(server.throwaway_database())


@bench_app.command("locomo")
def bench_locomo_command(
    data: Annotated[Path, typer.Option("--data", help="A LoCoMo-format JSON file.")],
    postgres: Annotated[
        bool,
        typer.Option(
            "--postgres/--no-postgres",
            help="Store the memories in a fresh PostgreSQL instead of the embedded SQLite.",
        ),
    ] = False,
    embedder_spec: Annotated[
        str,
        typer.Option(
            "--embedder",
            help="Embedder spec (default: the bundled all-MiniLM-L6-v2); local:minilm-static "
            "measures the static embeddings distilled from it.",
        ),
    ] = "local:all-minilm-l6-v2",
    cv: Annotated[
        bool,
        typer.Option(
            "--cv/--no-cv",
            help="Also cross-validate the retrieval levers leave-one-conversation-out: each "
            "lever's constants chosen on the other conversations by a grid, scored on the "
            "held-out one (adds cv_recall_at_10_mean, cv_recall_at_10_spread, cv_folds).",
        ),
    ] = False,
    as_json: JsonLastOption = False,
) -> None:
    """Turn-level evidence recall of keel's default memory search on LoCoMo."""

    from keel.bench.locomo import run_locomo
    from keel.memory import embedder_from_spec
    from keel.settings import load_settings

    embedder = embedder_from_spec(embedder_spec, load_settings())

    with ExitStack() as stack, _stage_progress("LoCoMo") as report:
        factory = None
        if postgres:
            url = _fresh_postgres(stack)
            factory = lambda: _memory_store_on(stack, url, embedder)  # noqa: E731
        result = run_locomo(data, embedder=embedder, progress=report, store=factory, cv=cv)
    emit_or_show(result, as_json, _print_locomo)


def _print_locomo(result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"LoCoMo retrieval ({result['questions']} questions)")
    for column in ("system", "R@5", "R@10", "All@10", "tokens@10", "p50 ms", "p95 ms"):
        table.add_column(column)
    rows = [("keel", result), *((name, r) for name, r in result["baselines"].items())]
    for name, r in rows:
        table.add_row(
            name,
            str(r["recall_at_5"]),
            str(r["recall_at_10"]),
            str(r["all_at_10"]),
            str(r["tokens_at_10"]),
            str(r["search_ms_p50"]),
            str(r["search_ms_p95"]),
        )
    out_console.print(table)
    budget = Table(
        title="At keel's tokens (per question: hits while they fit in keel's top 5 / 10)"
    )
    for column in ("system", "R@5", "R@10", "All@10", "tokens@10"):
        budget.add_column(column)
    budget.add_row(
        "keel",
        *(str(result[key]) for key in ("recall_at_5", "recall_at_10", "all_at_10", "tokens_at_10")),
    )
    for name, r in result["at_keel_budget"].items():
        budget.add_row(
            name,
            *(str(r[key]) for key in ("recall_at_5", "recall_at_10", "all_at_10", "tokens_at_10")),
        )
    out_console.print(budget)
    for category, r in result["by_category"].items():
        out_console.print(f"  {category}: R@10 {r['recall_at_10']} ({r['questions']} questions)")
    out_console.print(f"dropped evidence ids: {result['dropped_evidence_ids']}")
    if "cv" in result:
        cross = result["cv"]
        out_console.print(f"cross-validation: {cross['procedure']}")
        for name, lever in [*cross["levers"].items(), ("all", cross["all"])]:
            folds = ", ".join(str(fold["recall_at_10"]) for fold in lever["folds"])
            out_console.print(
                f"  {name}: R@10 {lever['recall_at_10_mean']} (folds {folds}; spread "
                f"{lever['recall_at_10_spread']}), chosen on all: {lever['chosen_on_all']}"
            )


@bench_app.command("memory")
def bench_memory_command(
    records: Annotated[
        int, typer.Option("--records", min=100, help="Records to ingest.")
    ] = 100_000,
    postgres: Annotated[
        bool, typer.Option("--postgres/--no-postgres", help="Also run on a fresh PostgreSQL.")
    ] = False,
    postgres_records: Annotated[
        int | None,
        typer.Option("--postgres-records", min=100, help="Records for PostgreSQL (default: same)."),
    ] = None,
    postgres_shared_buffers: Annotated[
        str,
        typer.Option(
            "--postgres-shared-buffers",
            help="shared_buffers of the PostgreSQL server started for the run. 100k records "
            "with MiniLM vectors and their indexes take about 520 MB; PostgreSQL's stock "
            "128MB would measure its page cache misses, not keel.",
        ),
    ] = "1GB",
    embedder_spec: Annotated[
        str,
        typer.Option(
            "--embedder",
            help="Embedder spec (default: the bundled all-MiniLM-L6-v2); hashing:384 measures "
            "the storage and index path without model inference.",
        ),
    ] = "local:all-minilm-l6-v2",
    sqlite: Annotated[
        bool, typer.Option("--sqlite/--no-sqlite", help="Run on the embedded SQLite store.")
    ] = True,
    bulk: Annotated[
        bool,
        typer.Option(
            "--bulk/--no-bulk",
            help="Load as a bulk import: Memory.add_many, 512 records a transaction, and on "
            "PostgreSQL the HNSW index built once after the load (index_build_s).",
        ),
    ] = False,
    recall_queries: Annotated[
        int,
        typer.Option(
            "--recall-queries",
            min=0,
            max=200,
            help="Queries whose PostgreSQL HNSW results are compared with exact search "
            "(hnsw_recall_at_10).",
        ),
    ] = 0,
    maintenance_work_mem: Annotated[
        str,
        typer.Option(
            "--postgres-maintenance-work-mem",
            help="maintenance_work_mem of the PostgreSQL server: an HNSW build is fast while "
            "its graph fits (about 2 GB at 1M 384-dimension vectors).",
        ),
    ] = "1GB",
    halfvec: Annotated[
        bool,
        typer.Option(
            "--postgres-halfvec/--no-postgres-halfvec",
            help="Index PostgreSQL's vectors as 16-bit halfvec: half the graph's bytes "
            "(PostgresMemoryStore(halfvec=True)).",
        ),
    ] = False,
    as_json: JsonLastOption = False,
) -> None:
    """Ingest synthetic records into the embedded memory, then measure search latency."""

    from keel.bench.memory import run_memory_bench
    from keel.memory import embedder_from_spec
    from keel.settings import load_settings

    with ExitStack() as stack:
        if not (sqlite or postgres):
            raise typer.BadParameter("--no-sqlite needs --postgres: nothing to measure")
        server_settings = {
            "shared_buffers": postgres_shared_buffers,
            "maintenance_work_mem": maintenance_work_mem,
        }
        embedder = embedder_from_spec(embedder_spec, load_settings())
        on_postgres = (
            _on_fresh_postgres(stack, server_settings, embedder, halfvec) if postgres else {}
        )
        with _stage_progress("memory") as report:
            result = run_memory_bench(
                records,
                embedder=embedder,
                postgres_records=postgres_records,
                progress=report,
                sqlite=sqlite,
                bulk=bulk,
                recall_queries=recall_queries,
                **on_postgres,
            )
        if postgres:
            result["postgres"]["server_settings"] = server_settings
            result["postgres"]["halfvec"] = halfvec
    emit_or_show(result, as_json, _print_memory)


def _on_fresh_postgres(
    stack: ExitStack, settings: dict[str, str], embedder: Embedder, halfvec: bool = False
) -> dict[str, Any]:
    """``run_memory_bench``'s PostgreSQL arguments, on a server started with ``settings``: its
    store, the VACUUM ANALYZE after ingestion, and the server's CPU reading."""
    from keel.bench.memory import postgres_server_cpu

    url = _fresh_postgres(stack, settings)

    def factory(hnsw: bool) -> MemoryStore:
        return _memory_store_on(stack, url, embedder, hnsw=hnsw, halfvec=halfvec)

    def vacuum() -> None:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE)")

    return {
        "postgres_store": factory,
        "postgres_settle": vacuum,
        "postgres_cpu": postgres_server_cpu(url),
    }


def _print_memory(result: dict[str, Any]) -> None:
    for backend in ("sqlite", "postgres"):
        if backend in result:
            r = result[backend]
            out_console.print(
                f"{backend}: {r['records']} records, ingest {r['ingest_records_per_s']} rec/s "
                f"(writes {r['write_records_per_s']}/s, embedding {r['embed_records_per_s']}/s), "
                f"search p50 {r['search_ms_p50']} ms, p95 {r['search_ms_p95']} ms"
            )


@bench_app.command("ann")
def bench_ann_command(
    sizes: Annotated[
        str, typer.Option("--sizes", help="Comma-separated index sizes, in vectors.")
    ] = "100000,1000000",
    embedder_spec: Annotated[
        str,
        typer.Option(
            "--embedder",
            help="Embedder of the synthetic notes (default: the static embeddings distilled "
            "from MiniLM, which embed a million notes in minutes on 2 cores).",
        ),
    ] = "local:minilm-static",
    threads: Annotated[int, typer.Option(min=1, help="Threads for the libraries' builds.")] = 2,
    libraries: Annotated[
        bool,
        typer.Option(
            "--libraries/--no-libraries",
            help="Also build hnswlib and usearch (at 1M vectors, 10 minutes or more each).",
        ),
    ] = True,
    as_json: JsonLastOption = False,
) -> None:
    """keel's embedded vector index against hnswlib and usearch: build time, memory, search
    p50/p95 and recall@10 against exact search, at each size."""
    from keel.bench.ann import run_ann_bench
    from keel.memory import embedder_from_spec
    from keel.settings import load_settings

    try:
        wanted = [int(part) for part in sizes.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter("--sizes takes whole numbers, e.g. 100000,1000000") from None
    if not wanted or min(wanted) < 100:
        raise typer.BadParameter("--sizes needs sizes of at least 100 vectors")
    embedder = embedder_from_spec(embedder_spec, load_settings())
    result = run_ann_bench(
        wanted,
        embedder=embedder,
        threads=threads,
        libraries=libraries,
        progress=err_console.print,
    )
    emit_or_show(result, as_json, _print_ann)


def _print_ann(result: dict[str, Any]) -> None:
    for size, figures in result["sizes"].items():
        out_console.print(f"[bold]{int(size):,} vectors[/bold]")
        for name, r in figures.items():
            if not r.get("installed", True):
                out_console.print(f"  {name}: not installed")
                continue
            out_console.print(
                f"  {name}: recall@10 {r['recall_at_10']}, p50 {r['search_ms_p50']} ms, "
                f"p95 {r['search_ms_p95']} ms, build {r['build_s']} s, {r['memory_mb']} MB"
            )
