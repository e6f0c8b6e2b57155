"""``python -m keel.bench.tau2 worker FOLDER TASK [KILL_POINT]``: a process of the kill mode."""

from __future__ import annotations

import sys
from pathlib import Path

from keel.bench.tau2._run import worker

if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m keel.bench.tau2 worker FOLDER TASK [KILL_POINT]")
    worker(Path(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
