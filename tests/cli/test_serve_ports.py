"""``keel serve`` on a port it cannot have: one clear error line, no traceback, exit 2 (the
option is what to change), through a real subprocess as a user runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _serve(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEEL_DATA_DIR": str(tmp_path), "KEEL_EMBEDDER": "hashing:64"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "serve",
            "--model",
            "scripted:echo",
            "--no-memory",
            "--port",
            str(port),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_port_out_of_range_is_one_line(tmp_path: Path) -> None:
    failed = _serve(tmp_path, 99999)
    assert failed.returncode == 2
    assert "Traceback" not in failed.stderr
    [line] = failed.stderr.strip().splitlines()
    assert "--port" in line and "65535" in line, line


def test_a_port_in_use_is_one_line_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        failed = _serve(tmp_path, port)
    assert failed.returncode == 2
    assert "Traceback" not in failed.stderr and "uvicorn" not in failed.stderr
    [line] = failed.stderr.strip().splitlines()
    assert line == (
        f"error: cannot listen on 127.0.0.1:{port}: the address is already in use "
        "(stop what holds it or choose another --port)"
    )


def test_the_listening_line_masks_the_database_password(tmp_path: Path) -> None:
    from keel.cli._serve import _listening_line
    from keel.service import ServeOptions
    from keel.settings import load_settings

    settings = load_settings(
        data_dir=tmp_path, database="postgresql://keel:s3cret-pw@db.internal:5432/keel"
    )
    options = ServeOptions(model="scripted:echo")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        line = _listening_line(listening, options, settings, 4)
    assert line == (
        f"keel serve: listening on http://127.0.0.1:{port} · model scripted:echo · "
        "database postgresql://keel:***@db.internal:5432/keel · 4 workers"
    )


def test_the_listening_line_masks_the_model_servers_password(tmp_path: Path) -> None:
    # The model spec names its server's URL, password and all, as a proxy's may hold one.
    from keel.cli._serve import _listening_line
    from keel.service import ServeOptions
    from keel.settings import load_settings

    settings = load_settings(data_dir=tmp_path)
    options = ServeOptions(model="openai-compatible:llama@http://proxy:s3cret@pw@10.1.2.3:8000/v1")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        line = _listening_line(listening, options, settings, 1)
    assert "model openai-compatible:llama@http://proxy:***@10.1.2.3:8000/v1 · " in line, line
    assert "s3cret" not in line and "pw@" not in line
