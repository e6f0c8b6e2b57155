"""Running a benchmark as a user does: ``keel bench NAME OPTIONS --json`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def bench_json(name: str, *options: str) -> dict[str, Any]:
    """``keel bench NAME OPTIONS --json``'s last line, parsed (the command must succeed)."""
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", name, *options, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures
