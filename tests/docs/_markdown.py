"""The fenced code blocks of the README and the documentation pages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_RUN = re.compile(r"<!--\s*not-run:(?P<reason>.*?)-->")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: where it is, its language, its code and why it is not run (if so)."""

    path: Path
    line: int
    language: str
    code: str
    not_run_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """The README and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[CodeBlock]:
    """Every fenced block of ``path``, in order. A ``<!-- not-run: REASON -->`` comment on the
    line before a fence (blank lines between allowed) marks that block as not run."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening.group("fence")
        end = index + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        blocks.append(
            CodeBlock(
                path=path,
                line=index + 1,
                language=opening.group("info").strip().split(" ")[0],
                code="\n".join(lines[index + 1 : end]) + "\n",
                not_run_reason=_reason_before(lines, index),
            )
        )
        index = end + 1
    return blocks


def _reason_before(lines: list[str], fence_index: int) -> str | None:
    previous = fence_index - 1
    while previous >= 0 and not lines[previous].strip():
        previous -= 1
    marker = _NOT_RUN.search(lines[previous]) if previous >= 0 else None
    return None if marker is None else marker.group("reason").strip()


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered lines of ``path`` outside fenced blocks."""
    inside: str | None = None
    kept: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        opening = _FENCE.match(line)
        if inside is None and opening is not None:
            inside = opening.group("fence")
        elif inside is not None and line.startswith(inside):
            inside = None
        elif inside is None:
            kept.append((number, line))
    return kept
