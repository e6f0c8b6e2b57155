"""The shape issue 34 set, kept: measured with ``scripts/shape.py`` (Python's ``ast``), so that a
change that grows ``Agent`` back, writes a 1,000-line module or hides an import inside a function
without saying why fails here, not in a review months later. Which package may import which is
``make lint``'s ``lint-imports`` (the contracts in pyproject.toml)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _shape() -> ModuleType:
    spec = importlib.util.spec_from_file_location("keel_shape", ROOT / "scripts" / "shape.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHAPE = _shape()
FIGURES = SHAPE.measure()


def test_the_agent_class_is_configuration_and_the_public_api() -> None:
    assert FIGURES["agent_class_lines"] <= 400


def test_no_source_file_is_over_1000_lines() -> None:
    assert FIGURES["files_over_1000"] == 0


def test_long_functions_and_big_classes_stay_few() -> None:
    assert FIGURES["functions_over_80"] <= 10
    assert FIGURES["classes_over_30_methods"] <= 3


def test_every_import_inside_a_function_says_why() -> None:
    assert FIGURES["lazy_uncommented"] == 0
    assert FIGURES["lazy_keel_imports"] <= 30


def test_no_modules_import_each_other_around_a_circle() -> None:
    # Counted by scripts/shape.py on every import, inside TYPE_CHECKING and functions included:
    # a circle moved out of sight is still a circle.
    cycles = SHAPE.import_cycles()
    assert cycles == [], cycles


def test_the_turn_runner_drives_and_nothing_more() -> None:
    # Its helpers are counted as its own: the writer, the entry and the steps hold the rest.
    assert FIGURES["turn_runner_lines"] <= 300
    assert FIGURES["turn_runner_methods"] <= 20


def _one_turn_block() -> str:
    """The diagram of docs/architecture.md's "One turn" section."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## One turn") :]
    start = section.index("```text") + len("```text")
    return section[start : section.index("```", start)]


def test_the_one_turn_diagram_names_every_runtime_module_a_turn_passes_through() -> None:
    # Real turns (plain, streamed with memory, an approval decided), traced by a profiler.
    found = SHAPE.turn_modules()["runtime"]
    block = _one_turn_block()
    missing = [name for name in found if name.removeprefix("keel/") not in block]
    assert not missing, f"docs/architecture.md's One turn block does not name {missing}"
    assert 0 < len(found) <= 12, found
