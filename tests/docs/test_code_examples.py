"""Every code example in the README and the documentation is a fenced block that names its
language, and every Python one runs (offline, in a scratch data directory) unless it says why
not."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs._markdown import CodeBlock, code_blocks, documents, prose_lines

BLOCKS = [block for path in documents() for block in code_blocks(path)]
PYTHON = [block for block in BLOCKS if block.language == "python"]


def test_the_documents_hold_python_examples() -> None:
    assert len(PYTHON) >= 10
    assert any(block.path.name == "README.md" for block in PYTHON)


def test_every_fenced_block_names_its_language() -> None:
    unnamed = [block.where for block in BLOCKS if not block.language]
    assert unnamed == []


def test_no_indented_code_block() -> None:
    """A block indented by four spaces after a blank line is code without a language."""
    found = []
    for path in documents():
        lines = prose_lines(path)
        for (_, before), (number, line) in itertools.pairwise(lines):
            if not before.strip() and line.startswith("    ") and line.strip():
                found.append(f"{path.name}:{number}")
    assert found == []


def test_a_block_not_run_says_why() -> None:
    silent = [block.where for block in PYTHON if block.not_run_reason == ""]
    assert silent == []


@pytest.mark.parametrize(
    "block", [block for block in PYTHON if block.not_run_reason is None], ids=lambda b: b.where
)
def test_python_example_runs(block: CodeBlock, tmp_path: Path) -> None:
    result = run_example(block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize(
    "block",
    [block for block in PYTHON if block.not_run_reason is None and block.path.name == "privacy.md"],
    ids=lambda b: b.where,
)
def test_a_privacy_example_runs_again_in_the_same_folder(block: CodeBlock, tmp_path: Path) -> None:
    """A reader runs an example twice (after editing it): the second run finds what the first
    one left (a vault sealed with the key that run made) and must still work."""
    first = run_example(block, tmp_path)
    assert first.returncode == 0, f"{block.where} failed:\n{first.stdout}\n{first.stderr}"
    second = run_example(block, tmp_path)
    assert second.returncode == 0, f"{block.where} failed again:\n{second.stderr}"


def run_example(block: CodeBlock, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as a script in ``folder``, offline, with a scratch data directory there."""
    script = folder / "example.py"
    script.write_text(block.code, encoding="utf-8")
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("KEEL_") and key != "XDG_CONFIG_HOME"
    }
    # A scratch data directory and no config file: an example reads only what it sets itself.
    environment.update(KEEL_DATA_DIR=str(folder / "data"), XDG_CONFIG_HOME=str(folder))
    environment["TMPDIR"] = str(folder)  # what an example puts in a temporary folder stays here
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )


def test_examples_import_the_public_api_only() -> None:
    private = re.compile(r"^\s*(?:from|import)\s+keel(?:\.\w+)*\.(?:_\w+|demo)\b", re.M)
    found = [block.where for block in PYTHON if private.search(block.code)]
    assert found == []


_SQLITE_FILE = re.compile(r"sqlite:///([\w./-]+)")


def test_an_example_with_its_own_pii_key_opens_no_file_an_earlier_one_opened() -> None:
    """A reader runs a page's examples in order in one folder: an example that sets
    ``KEEL_PII_KEY`` on a database file an earlier example sealed with keel's own key file
    fails with ``VaultKeyError`` (the integrations page's two checkpointer examples both
    used ``keel.db``)."""
    clashes = []
    for path in documents():
        opened: set[str] = set()
        for block in code_blocks(path):
            if block.language != "python" or block.not_run_reason is not None:
                continue
            files = set(_SQLITE_FILE.findall(block.code))
            if "KEEL_PII_KEY" in block.code and files & opened:
                clashes.append(f"{block.where}: {sorted(files & opened)}")
            opened |= files
    assert clashes == []
