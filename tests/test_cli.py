"""The CLI as a user runs it: a real subprocess, real exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _keel(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_the_commands() -> None:
    result = _keel("--help")
    assert result.returncode == 0
    for command in ("doctor", "tokens", "bench"):
        assert command in result.stdout


def test_tokens_json_matches_the_contract() -> None:
    result = _keel("tokens", "--model", "gpt-4o", "--json", "Hello, world!")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["encoding"] == "o200k_base"
    assert payload["tokens"] == 4
    assert payload["exact"] is True
    assert payload["model"] == "gpt-4o"


def test_tokens_plain_output() -> None:
    result = _keel("tokens", "-m", "gpt-4", "The quick brown fox jumps over the lazy dog.")
    assert result.returncode == 0
    assert result.stdout.strip() == "10 tokens (cl100k_base)"


def test_unknown_model_is_one_error_line_without_traceback() -> None:
    result = _keel("tokens", "--model", "no-such-model", "hi")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "no-such-model" in lines[0]
    estimate = _keel("tokens", "--model", "no-such-model", "--estimate", "--json", "hi")
    assert json.loads(estimate.stdout)["exact"] is False


def test_unreadable_config_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("model = = broken")
    result = _keel("doctor", env={"KEEL_CONFIG": str(bad)})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error:") and "not valid TOML" in result.stderr


def test_doctor_is_healthy_on_the_embedded_default(tmp_path: Path) -> None:
    # A misspelt setting is ignored (KEEL_ is also a prefix of the user's own variables):
    # the doctor names it, as a warning.
    result = _keel("doctor", "--json", env={"KEEL_MODLE": "openai:gpt-4o"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["healthy"] is True
    by_name = {check["name"]: check for check in report["checks"]}
    assert by_name["database"]["status"] == "ok"
    assert by_name["o200k_base"]["status"] == "ok"
    assert by_name["smollm2 (GGUF)"]["status"] == "ok"
    assert by_name["local:smollm2"]["status"] == "ok"
    assert by_name["local:all-minilm-l6-v2"]["status"] == "ok"
    assert (tmp_path / "data" / "keel.db").exists()
    assert report["model"] == "local:smollm2"
    assert "135M-parameter demo model" in report["model_note"]
    environment = by_name.get("environment", {})
    assert environment.get("status") == "warn", sorted(by_name)
    assert environment["detail"] == "not keel settings, so ignored: KEEL_MODLE"


def test_doctor_says_the_default_model_is_a_demo_model_and_how_to_set_a_real_one() -> None:
    bundled = " ".join(_keel("doctor").stdout.split())
    assert "model: local:smollm2" in bundled and "135M-parameter demo model" in bundled
    assert "KEEL_MODEL=openai:gpt-4o-mini" in bundled
    # A model server's URL may hold a password: the doctor's report hides it.
    model = "openai-compatible:llama@http://proxy:s3cret-pw@10.1.2.3:8000/v1"
    real = _keel("doctor", env={"KEEL_MODEL": model})
    shown = "model: openai-compatible:llama@http://proxy:***@10.1.2.3:8000/v1"
    assert shown in real.stdout and "KEEL_MODEL" not in real.stdout, real.stdout
    assert "s3cret-pw" not in real.stdout + real.stderr


def test_doctor_prints_what_it_found_as_written(tmp_path: Path) -> None:
    # Its lines were read as rich markup: a bracketed word vanished, as "[local]" did from
    # the advice "pip install 'keel-runtime[local]'" on a machine without llama-cpp-python.
    data = tmp_path / "data[local]"
    result = _keel("doctor", env={"KEEL_DATA_DIR": str(data)})
    printed = "".join(result.stdout.split())  # rich wraps long lines; the path has no spaces
    assert f"datadirectory{data}" in printed and f"sqlite:///{data}/keel.db" in printed


def test_an_error_line_prints_its_message_as_written(tmp_path: Path) -> None:
    # Error lines were rich markup: "[local]" vanished from a message (the advice
    # "pip install 'keel-runtime[local]'" among them) and "[/x]" raised MarkupError.
    for folder in ("x[local]", "[/x]"):
        url = f"sqlite:///{tmp_path / folder / 'keel.db'}"
        result = _keel("users", "erase", "acme", "bob", "--database", url)
        assert "Traceback" not in result.stderr, result.stderr
        printed = "".join(result.stderr.split())
        assert result.returncode == 2 and f"nodatabaseat{tmp_path / folder}" in printed, printed


def test_doctor_fails_on_a_corrupt_database(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "keel.db").write_bytes(b"garbage" * 1000)
    result = _keel("doctor")
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "corrupt" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_doctor_fails_on_a_database_from_a_newer_keel(tmp_path: Path) -> None:
    import sqlite3

    data = tmp_path / "data"
    data.mkdir()
    conn = sqlite3.connect(data / "keel.db")
    conn.execute(
        "CREATE TABLE keel_schema (component TEXT PRIMARY KEY, version INT, applied_at REAL)"
    )
    conn.execute("INSERT INTO keel_schema VALUES ('core', 99, 0)")
    conn.commit()
    conn.close()
    result = _keel("doctor")
    assert result.returncode == 1
    assert "newer than this keel knows" in result.stdout


def test_doctor_fails_on_an_unusable_data_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    result = _keel("doctor", env={"KEEL_DATA_DIR": str(blocker / "data")})
    assert result.returncode == 1
    assert "FAIL" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_doctor_checks_a_postgresql_database_and_shows_no_password(postgres_url: str) -> None:
    # On PostgreSQL the doctor answered FAIL ("opened by Backends.open, not as the embedded
    # SQLite database") and exit 1, and a Redis URL's password was printed whole.
    redis = "redis://:s3cret-pw@127.0.0.1:1/0"  # nothing listens on port 1
    env = {"KEEL_DATABASE": postgres_url, "KEEL_REDIS_URL": redis, "KEEL_PII_VAULT": "off"}
    result = _keel("doctor", "--json", env=env)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    by_name = {check["name"]: check for check in report["checks"]}
    assert by_name["database"]["status"] == "ok", by_name["database"]
    assert "PostgreSQL 18" in by_name["database"]["detail"]
    assert report["healthy"] is True and result.returncode == 0
    assert by_name["redis"]["status"] == "warn" and ":***@127.0.0.1:1" in by_name["redis"]["detail"]
    assert "s3cret-pw" not in result.stdout + result.stderr
