from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keel.bench.locomo import _score, _within, parse_session_date, repair_evidence, run_locomo
from keel.bench.memory import postgres_server_cpu, run_memory_bench, synthetic_corpus
from keel.errors import ConfigError
from keel.memory import STOPWORDS, HashingEmbedder
from keel.stores import PostgresDatabase, PostgresMemoryStore
from keel.tokens import counter_for
from tests.bench._cli import bench_json
from tests.cli import keel_process


def _tiny_locomo(path: Path) -> Path:
    """A made-up conversation in LoCoMo's format (not LoCoMo data)."""
    turns1 = [
        {"speaker": "Ann", "dia_id": "D1:1", "text": "I started pottery classes this week."},
        {"speaker": "Ben", "dia_id": "D1:2", "text": "Nice, what did you make?"},
        {
            "speaker": "Ann",
            "dia_id": "D1:3",
            "text": "A blue bowl for my mother.",
            "blip_caption": "a photo of a blue ceramic bowl",
        },
    ]
    turns2 = [
        {"speaker": "Ben", "dia_id": "D2:1", "text": "I adopted a dog named Rex."},
        {"speaker": "Ann", "dia_id": "D2:2", "text": "Rex is a lovely name for a dog!"},
    ]
    item = {
        "sample_id": "tiny-1",
        "conversation": {
            "speaker_a": "Ann",
            "speaker_b": "Ben",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": turns1,
            "session_2_date_time": "10:00 am on 2 June, 2023",
            "session_2": turns2,
        },
        "qa": [
            {
                "question": "What did Ann make in pottery class?",
                "answer": "a bowl",
                "evidence": ["D1:3"],
                "category": 4,
            },
            {
                "question": "What is the name of Ben's dog?",
                "answer": "Rex",
                "evidence": ["D2:1; D2:2"],
                "category": 1,
            },
            {
                "question": "When did Ann start pottery?",
                "answer": "May 2023",
                "evidence": ["D:1:1", "D9:99"],
                "category": 2,
            },
            {"question": "Unanswerable", "answer": "", "evidence": [], "category": 5},
            {"question": "No evidence at all", "answer": "x", "evidence": ["D7:7"], "category": 3},
        ],
    }
    path.write_text(json.dumps([item]), encoding="utf-8")
    return path


def test_evidence_repair_and_dates() -> None:
    known = {"D8:6", "D9:17", "D11:26"}
    assert repair_evidence(["D8:6; D9:17"], known) == (["D8:6", "D9:17"], 0)
    assert repair_evidence(["D:11:26", "D40:1"], known) == (["D11:26"], 1)
    assert parse_session_date("1:56 pm on 8 May, 2023") == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert parse_session_date("sometime") is None


def test_locomo_harness_on_a_tiny_file(tmp_path: Path) -> None:
    report = run_locomo(_tiny_locomo(tmp_path / "tiny.json"), embedder=HashingEmbedder(64))
    assert report["questions"] == 3
    assert report["questions_without_evidence"] == 1
    assert report["dropped_evidence_ids"] == 2
    assert report["recall_at_10"] == 1.0 and report["all_at_10"] == 1.0
    assert report["session_recall_at_10"] == 1.0
    assert set(report["baselines"]) == {"bm25", "dense", "keel_without_neighbours"}
    # Like-for-like: at keel's budget no baseline gets more tokens than keel took.
    assert set(report["at_keel_budget"]) == set(report["baselines"])
    for row in report["at_keel_budget"].values():
        assert 0 < row["tokens_at_10"] <= report["tokens_at_10"]
        assert row["questions"] == report["questions"]
    assert set(report["by_category"]) == {"single_hop", "multi_hop", "temporal"}
    assert 0 < report["tokens_at_10"] < 200
    with pytest.raises(ConfigError):
        run_locomo(tmp_path / "missing.json", embedder=HashingEmbedder(8))


def test_locomo_cli_on_files_it_cannot_score(tmp_path: Path) -> None:
    # Each was a traceback: bytes that are not UTF-8 (UnicodeDecodeError), a conversation
    # without questions (statistics' fmean of nothing); a file of none reported zeros.
    tiny = json.loads(_tiny_locomo(tmp_path / "tiny.json").read_text())
    (tmp_path / "latin1.json").write_bytes('[{"qa": [], "conversation": "\xe9"}]'.encode("latin-1"))
    (tmp_path / "none.json").write_text(json.dumps([{**tiny[0], "qa": []}]))
    for name, said in [("latin1", "is not UTF-8"), ("none", "holds no questions")]:
        path = str(tmp_path / f"{name}.json")
        result = keel_process("bench", "locomo", "--data", path, "--embedder", "hashing:8")
        assert "Traceback" not in result.stderr, result.stderr
        assert result.returncode == 2 and said in result.stderr, result.stderr
    mixed = tmp_path / "mixed.json"
    quiet = {**tiny[0], "sample_id": "quiet", "qa": []}
    mixed.write_text(json.dumps([*tiny, {**tiny[0], "sample_id": "tiny-2"}, quiet]))
    report = bench_json("locomo", "--data", str(mixed), "--embedder", "hashing:8", "--cv")
    assert report["questions"] == 6 and set(report["per_conversation"]) == {"tiny-1", "tiny-2"}
    # A conversation without questions is no fold (it was one, of recall 0).
    assert len(report["cv_folds"]) == 2 and min(report["cv_folds"]) > 0


def test_the_budget_keeps_the_leading_hits_that_fit() -> None:
    counter = counter_for("gpt-4o", allow_estimate=True)
    records = [
        SimpleNamespace(id=f"r{i}", text=f"turn {i} " + "word " * (5 * i)) for i in range(1, 5)
    ]
    hits: list[Any] = [SimpleNamespace(records=(r,)) for r in records]
    costs = [counter.count_text(r.text) for r in records]
    assert _within(hits, costs[0] + costs[1], counter) == hits[:2]
    assert _within(hits, costs[0] + costs[1] - 1, counter) == hits[:1]
    assert _within(hits, 0, counter) == []
    # A turn already kept (a neighbour shared by two hits) costs nothing again.
    shared = SimpleNamespace(records=(records[0], records[1]))
    assert _within([hits[0], shared], costs[0] + costs[1], counter) == [hits[0], shared]


def test_session_recall_counts_the_sessions_holding_the_evidence() -> None:
    counter = counter_for("gpt-4o", allow_estimate=True)
    dia_of = {"a": "D1:3", "b": "D2:7", "c": "D2:9", "d": "D5:1"}
    hits: list[Any] = [
        SimpleNamespace(records=(SimpleNamespace(id=record, text=f"turn {record}"),))
        for record in ("b", "d")
    ]
    # Evidence in sessions 1 and 2; session 2 is retrieved through another of its turns.
    scored = _score(hits, ["D1:3", "D2:9"], dia_of, counter)
    assert scored.recall == 0.0 and scored.session_recall == 0.5
    assert _score(hits, ["D2:7", "D5:1"], dia_of, counter).session_recall == 1.0
    assert _score([], ["D2:7"], dia_of, counter).session_recall == 0.0


def test_the_stopwords_are_a_general_english_list() -> None:
    """NLTK's published English list (179 words): no words picked from benchmark questions."""
    assert len(STOPWORDS) == 179
    assert {"what", "did", "the", "of", "when", "who", "how", "don", "ll", "t"} <= STOPWORDS
    assert not {"kind", "type", "like", "ever", "let", "could", "would"} & STOPWORDS


def test_memory_bench_small() -> None:
    texts, queries = synthetic_corpus(300)
    assert len(texts) == 300 and len(queries) == 200 and texts == synthetic_corpus(300)[0]
    report = run_memory_bench(300, embedder=HashingEmbedder(64), batch=100)
    assert report["records"] == 300 and report["ingest_records_per_s"] > 0
    assert (
        report["write_records_per_s"]
        > report["ingest_records_per_s"]
        < report["embed_records_per_s"]
    )
    assert report["search_ms_p95"] >= report["search_ms_p50"] > 0
    # The keys, and the embedder's own rate on the same texts next to indexing's.
    assert report["write_per_s"] == report["write_records_per_s"]
    assert report["index_per_s"] == report["embed_records_per_s"]
    assert report["raw_embed_per_s"] > 0 and report["index_vs_raw"] > 0


@pytest.mark.postgres
def test_locomo_runs_on_postgresql(tmp_path: Path, postgres_url: str) -> None:
    with PostgresDatabase(postgres_url) as database:
        report = run_locomo(
            _tiny_locomo(tmp_path / "tiny.json"),
            embedder=HashingEmbedder(64),
            store=lambda: PostgresMemoryStore(database),
        )
    assert report["store"] == "PostgresMemoryStore"
    assert report["questions"] == 3 and report["recall_at_10"] == 1.0


@pytest.mark.postgres
def test_memory_bench_measures_postgresql_again_once_settled(postgres_url: str) -> None:
    settled: list[bool] = []
    with PostgresDatabase(postgres_url) as database:
        report = run_memory_bench(
            100,
            embedder=HashingEmbedder(64),
            postgres_store=lambda hnsw: PostgresMemoryStore(database, hnsw=hnsw),
            postgres_records=150,
            postgres_settle=lambda: settled.append(True),
            postgres_cpu=postgres_server_cpu(postgres_url),
            batch=50,
        )
    assert settled == [True]
    postgres = report["postgres"]
    assert postgres["index_server_cpu_s"] >= 0 and "index_server_cpu_s" not in report["sqlite"]
    assert postgres["records"] == 150 and report["records"] == 100
    assert postgres["settled"]["queries"] == 200
    assert postgres["settled"]["search_ms_p95"] >= postgres["settled"]["search_ms_p50"] > 0


def test_ann_bench_scores_every_index_against_exact_search() -> None:
    figures = bench_json("ann", "--sizes", "500,21000", "--embedder", "hashing:64")
    assert figures["embedding_model"] == "keel-hashing-64" and figures["queries"] == 200
    small, large = figures["sizes"]["500"], figures["sizes"]["21000"]
    # Up to 20,000 vectors keel's index is exact: scored against exact search, it is perfect.
    assert small["keel"]["recall_at_10"] == 1.0
    # Above that, the sign-bit shortlist: approximate, and measured as such (64 hashed
    # dimensions give it few bits to go on).
    assert 0 < large["keel"]["recall_at_10"] < 1.0
    for size in (small, large):
        for name in ("keel", "hnswlib", "usearch"):
            result = size[name]
            assert result["search_ms_p95"] >= result["search_ms_p50"] > 0
            assert result["memory_mb"] > 0 and 0 < result["recall_at_10"] <= 1


def test_ann_bench_measures_keel_alone_without_the_libraries() -> None:
    figures = bench_json("ann", "--sizes", "500", "--embedder", "hashing:64", "--no-libraries")
    assert set(figures["sizes"]["500"]) == {"keel"}


@pytest.mark.postgres
def test_the_server_cpu_reading_counts_the_servers_own_work(postgres_url: str) -> None:
    import psycopg

    read = postgres_server_cpu(postgres_url)
    before = read()
    assert before is not None and before > 0
    with psycopg.connect(postgres_url) as conn:
        conn.execute("SELECT count(*) FROM generate_series(1, 3000000)").fetchone()
        during = read()  # the backend that ran it is alive
    assert during is not None and during - before >= 0.1
    # Once it exits and the postmaster reaps it, its CPU is still counted (in cutime).
    deadline = time.monotonic() + 30
    after = read()
    while (after is None or after < during) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = read()
    assert after is not None and after >= during


@pytest.mark.postgres
def test_memory_bench_bulk_load_builds_the_index_after_and_sizes_each_store(
    postgres_url: str,
) -> None:
    with PostgresDatabase(postgres_url) as database:
        report = run_memory_bench(
            200,
            embedder=HashingEmbedder(64),
            postgres_store=lambda hnsw: PostgresMemoryStore(database, hnsw=hnsw),
            postgres_settle=lambda: None,
            batch=100,
            bulk=True,
            recall_queries=5,
        )
    sqlite, postgres = report["sqlite"], report["postgres"]
    assert report["bulk"] is True and sqlite["records"] == postgres["records"] == 200
    # The graph is built once, after the load, and searched: scored against exact search.
    assert postgres["indexes_built"] == ["memory_vectors_64_hnsw"]
    assert postgres["index_build_s"] >= 0 and postgres["search_ms_p95"] > 0
    assert 0 < postgres["hnsw_recall_at_10"] <= 1 and postgres["recall_queries"] == 5
    assert postgres["hnsw_index_bytes"] > 0
    assert postgres["disk_bytes"] == sum(postgres["relation_bytes"].values())
    for figures in (sqlite, postgres):
        assert figures["bytes_per_record"] == round(figures["disk_bytes"] / 200) > 0
    assert sqlite["peak_rss_bytes"] > 0 and sqlite["raw_embed_per_s"] is None


def test_memory_bench_cli_needs_a_store() -> None:
    from typer.testing import CliRunner

    from keel.cli import app

    result = CliRunner().invoke(app, ["bench", "memory", "--records", "100", "--no-sqlite"])
    assert result.exit_code != 0 and "--no-sqlite needs --postgres" in result.output


def test_memory_bench_cli_refuses_fewer_postgres_records_than_it_measures() -> None:
    result = keel_process(
        "bench", "memory", "--records", "100", "--postgres", "--postgres-records", "-5"
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2 and "--postgres-records" in result.stderr


@pytest.mark.postgres
def test_memory_bench_cli_names_a_server_setting_postgresql_refuses() -> None:
    result = keel_process(
        "bench", "memory", "--records", "100", "--postgres", "--no-sqlite",
        "--embedder", "hashing:8", "--postgres-shared-buffers", "lots",
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2 and "shared_buffers = 'lots'" in result.stderr
