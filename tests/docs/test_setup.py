"""The two commands: `make demo` and `make test` each run the set-up first, and the set-up stops
at once, without pip, when .venv holds the stamp of a finished set-up from the same
pyproject.toml, setup.sh and pinned bundled models (src/keel/_assets.py)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# What the stamp hashes: the dependencies, the set-up's steps, the bundled models' pins.
_STAMPED = ("pyproject.toml", "setup.sh", "src/keel/_assets.py")


def _scratch_copy(tmp_path: Path) -> Path:
    """setup.sh and pyproject.toml in a scratch folder, with a real .venv that has no pip: any
    install the set-up starts fails there ("No module named pip") instead of reaching a
    registry, so a run that exits 0 installed nothing."""
    for name in _STAMPED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    venv.EnvBuilder(with_pip=False).create(tmp_path / ".venv")
    return tmp_path


def _stamp_of(folder: Path) -> str:
    content = b"".join((folder / name).read_bytes() for name in _STAMPED)
    return hashlib.sha256(content).hexdigest()


def _setup(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "KEEL_SETUP_FORCE"}
    environment.update(PYTHON=sys.executable, **env)
    return subprocess.run(
        ["bash", str(folder / "setup.sh")],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )


def test_a_current_stamp_stops_the_setup_before_pip(tmp_path: Path) -> None:
    folder = _scratch_copy(tmp_path)
    (folder / ".venv/.keel-setup-stamp").write_text(_stamp_of(folder) + "\n")
    result = _setup(folder)
    assert result.returncode == 0, result.stderr
    assert "set-up is current" in result.stdout
    assert "No module named pip" not in result.stderr


@pytest.mark.parametrize("changed", _STAMPED)
def test_a_changed_input_installs_again_and_drops_the_stale_stamp(
    tmp_path: Path, changed: str
) -> None:
    folder = _scratch_copy(tmp_path)
    stamp = folder / ".venv/.keel-setup-stamp"
    stamp.write_text(_stamp_of(folder) + "\n")
    with (folder / changed).open("a") as file:
        file.write("\n# changed\n")
    result = _setup(folder)
    assert result.returncode != 0
    assert "No module named pip" in result.stderr  # it went on to install
    assert not stamp.exists()  # a set-up that stopped half-way is not marked done


def test_no_stamp_or_a_forced_setup_installs(tmp_path: Path) -> None:
    folder = _scratch_copy(tmp_path)
    assert "No module named pip" in _setup(folder).stderr
    (folder / ".venv/.keel-setup-stamp").write_text(_stamp_of(folder) + "\n")
    assert "No module named pip" in _setup(folder, KEEL_SETUP_FORCE="1").stderr


def _dry_run(target: str) -> list[str]:
    result = subprocess.run(
        ["make", "--dry-run", "--no-print-directory", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def test_make_demo_and_make_test_run_the_setup_first() -> None:
    demo = _dry_run("demo")
    assert demo == ["./setup.sh", ".venv/bin/keel demo"]
    test = _dry_run("test")
    assert test[0] == "./setup.sh"
    joined = "\n".join(test)
    for step in ("ruff check", "mypy src", "mkdocs build --strict", "pytest -q"):
        assert step in joined, f"make test does not run {step}"


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None, "the README opens with no bash block of its commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_gives_two_commands_and_ci_runs_its_test_command() -> None:
    assert _readme_commands() == ["make demo", "make test"]
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    steps = [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert steps == ["make test"]
