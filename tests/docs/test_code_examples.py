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
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("KEEL_") and key != "XDG_CONFIG_HOME"
    }
    # A scratch data directory and no config file: an example reads only what it sets itself.
    environment.update(KEEL_DATA_DIR=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"


def test_examples_import_the_public_api_only() -> None:
    private = re.compile(r"^\s*(?:from|import)\s+keel(?:\.\w+)*\.(?:_\w+|demo)\b", re.M)
    found = [block.where for block in PYTHON if private.search(block.code)]
    assert found == []
