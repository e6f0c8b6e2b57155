"""``keel bench mcp``: a worker SIGKILLed (with its MCP server) after the server applied a write
is resumed by a new process that does not run the write again (it is in doubt and settled from
the server's effects); the JSON line has the figures the issue asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_a_write_applied_before_a_sigkill_is_never_repeated_by_the_resumed_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "mcp", "--calls", "30", "--kills", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"added_ms_p50", "added_ms_p95", "calls", "kills", "doubled", "missing"} <= set(report)
    assert report["calls"] == 30 and report["kills"] == 2
    # Each resumed turn found its write in doubt: not run again, and settled, never lost.
    assert report["in_doubt_after_resume"] == 2
    assert report["doubled"] == 0 and report["missing"] == 0
