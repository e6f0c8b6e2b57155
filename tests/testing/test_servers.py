"""The server fixtures themselves: real servers, isolated databases."""

from __future__ import annotations

import psycopg
import redis


def test_postgres_has_pgvector_and_isolated_databases(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        assert version is not None and int(version[0]) >= 160000
        row = conn.execute("SELECT '[1,2,3]'::vector <-> '[1,2,4]'::vector").fetchone()
        assert row is not None and abs(float(row[0]) - 1.0) < 1e-9
        conn.execute("CREATE TABLE marker (id INT)")


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
