"""The command line as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def keel_process(
    *args: str, stdin: str = "", env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``keel ARGS`` in a subprocess, with this test's environment (and ``env`` over it)."""
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
