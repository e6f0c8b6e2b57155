"""The README stays short: what keel is, the two commands, a first agent, the command table, one
row per benchmark under "Measured", and links onward that resolve."""

from __future__ import annotations

import re

from tests.docs._markdown import ROOT, prose_lines

README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")


def test_the_readme_is_under_150_lines_and_1500_words() -> None:
    assert len(TEXT.splitlines()) < 150
    assert len(TEXT.split()) < 1500


def test_no_prose_line_is_over_120_characters() -> None:
    long = [
        f"README.md:{number} ({len(line)} characters)"
        for number, line in prose_lines(README)
        if len(line) > 120 and not line.startswith("|")
    ]
    assert long == []


def _measured_rows() -> list[list[str]]:
    section = TEXT.split("\n## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_measured_is_one_row_per_benchmark_with_its_figure_date_and_command() -> None:
    rows = _measured_rows()
    assert len(rows) >= 10
    benchmarks = []
    for command, figure, date in rows:
        assert re.fullmatch(r"`keel (demo|bench \w+)[^`]*`", command), command
        assert re.search(r"\d", figure), f"{command} has no figure"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"{command}: {date!r} is not a date"
        benchmarks.append(command.split(" --")[0])
    assert len(benchmarks) == len(set(benchmarks)), "a benchmark has more than one row"
    # A table row is a figure, not a history: those go to docs/benchmarks.md.
    assert max(len(figure) for _, figure, _ in rows) <= 120


def test_every_benchmark_of_the_readme_has_its_history_in_the_docs() -> None:
    history = (ROOT / "docs/benchmarks.md").read_text(encoding="utf-8")
    for command, _, _ in _measured_rows():
        assert command.split(" --")[0].strip("`") in history, command


def test_the_readme_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)", TEXT)
    assert targets, "the README links nowhere onward"
    missing = [target for target in targets if "://" not in target and not (ROOT / target).exists()]
    assert missing == []
