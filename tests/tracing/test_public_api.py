from __future__ import annotations

import subprocess
import sys

import keel.tracing


def test_all_is_importable() -> None:
    for name in keel.tracing.__all__:
        assert getattr(keel.tracing, name) is not None, name
    assert len(set(keel.tracing.__all__)) == len(keel.tracing.__all__)


def test_importing_tracing_loads_no_driver_or_sdk() -> None:
    code = (
        "import sys, keel.tracing; "
        "print(sorted(m for m in ('psycopg', 'psycopg_pool', 'opentelemetry') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
