"""``keel serve`` with a PII master key, as an operator runs it (real subprocesses, real
HTTP): a bad key stops it before it serves, and ``--workers 2`` forget takes effect in every
worker at once (nothing is cached across requests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from keel.privacy import MasterKey
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing.servers import free_port
from tests.service.conftest import create_key, keel_serve

EMAIL = "grace.hopper@example.com"


def _serve_fails(env: dict[str, str], *arguments: str) -> tuple[int, str]:
    """``keel serve ARGUMENTS``' exit status and stderr, once it stopped; a server still
    running after 90 s is a failure (and is stopped, its workers with it)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "serve", "--model", "scripted:echo", *arguments],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("keel serve kept running with a bad PII key")
    return process.returncode, stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bad_pii_key_stops_keel_serve_before_it_serves(tmp_path: Path, workers: str) -> None:
    base = {**os.environ, "KEEL_DATA_DIR": str(tmp_path / "data"), "KEEL_EMBEDDER": "hashing:64"}
    base.pop("KEEL_PII_KEY_FILE", None)
    arguments = ("--no-memory", "--workers", workers, "--port", str(free_port()))
    status, stderr = _serve_fails({**base, "KEEL_PII_KEY": "not-a-key"}, *arguments)
    assert status != 0
    assert "KEEL_PII_KEY" in stderr and "Traceback" not in stderr
    # A well-formed key that is not the one this vault's data keys are wrapped with.
    settings = load_settings(data_dir=tmp_path / "data", embedder="hashing:64")
    Backends.open(settings, memory=False, pii_key=MasterKey.generate()).close()
    status, stderr = _serve_fails({**base, "KEEL_PII_KEY": MasterKey.new_key_text()}, *arguments)
    assert status != 0
    assert "not this vault's" in stderr and "Traceback" not in stderr


def test_forget_takes_effect_in_every_worker_at_once(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": postgres_url,
        "KEEL_REDIS_URL": redis_url,
        "KEEL_PII_KEY": MasterKey.new_key_text(),
    }
    env.pop("KEEL_PII_KEY_FILE", None)
    user_key, operator_key = create_key_for_user("acme", "ada", env), create_key("acme", env)
    arguments = ("--workers", "2", "--model", "scripted:echo", "--no-memory")
    with keel_serve(*arguments, env=env) as served:
        ada = httpx.Client(
            base_url=served.url, headers={"Authorization": f"Bearer {user_key}"}, timeout=60
        )
        operator = httpx.Client(
            base_url=served.url, headers={"Authorization": f"Bearer {operator_key}"}, timeout=60
        )
        with ada, operator:
            body = {"message": f"my email is {EMAIL}", "user": "ada"}
            reply = ada.post("/v1/sessions/s1/turns", json=body)
            assert reply.status_code == 200 and reply.json()["text"] == body["message"]
            # 16 reads, each on a new connection (the workers share the listening socket, so
            # the reads are spread over them): every one shows the value until the forget,
            # and none after it, whichever worker answered.
            before = [
                ada.get("/v1/sessions/s1", headers={"Connection": "close"}).text for _ in range(16)
            ]
            assert all(EMAIL in read for read in before)
            forgot = operator.post("/v1/privacy/forget", json={"user_id": "ada"})
            assert forgot.status_code == 200 and forgot.json()["erased"] == 1
            after = [
                ada.get("/v1/sessions/s1", headers={"Connection": "close"}).text for _ in range(16)
            ]
            assert not any(EMAIL in read for read in after)
            assert all("<EMAIL_1>" in read for read in after)


def create_key_for_user(tenant: str, user: str, env: dict[str, str]) -> str:
    """``keel keys create --tenant TENANT --user USER``; the key it printed."""
    created = subprocess.run(
        [sys.executable, "-m", "keel", "keys", "create", "--tenant", tenant, "--user", user],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    return created.stdout.strip().splitlines()[-1]
