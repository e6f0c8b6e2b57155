from __future__ import annotations

import importlib
import inspect

import pytest


@pytest.mark.parametrize("module", ["keel.state", "keel.state.examples"])
def test_all_is_sorted_importable_and_documented(module: str) -> None:
    imported = importlib.import_module(module)
    names = list(imported.__all__)
    assert names == sorted(names)
    for name in names:
        value = getattr(imported, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), name


def test_core_state_package_imports_no_driver() -> None:
    import subprocess
    import sys

    code = (
        "import sys, keel.state, keel.stores;"
        "print(sorted(m for m in ('psycopg', 'psycopg_pool', 'redis') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
