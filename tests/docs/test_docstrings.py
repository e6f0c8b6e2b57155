"""keel's docstrings are written for mkdocstrings (Markdown): the API reference renders them as
they are, so Sphinx's reST markup (``:class:`Agent```, a paragraph ending in ``::`` before an
indented block) would show raw. Cross-references are ``[`Agent`][keel.runtime.Agent]`` (or
``[`Agent`][]`` where the name resolves in scope), literal blocks are fenced code. Read from the
source (AST), so every module counts, rendered in the reference or not."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "keel"
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`")
# A reST literal block: a line ending in "::" followed by a blank line and an indented block.
_LITERAL_BLOCK = re.compile(r"::[ \t]*\n[ \t]*\n[ \t]+\S")


def _documentation(tree: ast.Module) -> Iterator[ast.Constant]:
    """Docstrings, attribute docstrings (a string right after an assignment) and Pydantic
    field descriptions: every string the reference renders."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for index, statement in enumerate(body):
                if not (
                    isinstance(statement, ast.Expr)
                    and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)
                ):
                    continue
                if index == 0 or isinstance(body[index - 1], ast.Assign | ast.AnnAssign):
                    yield statement.value
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else None
            name = function.id if isinstance(function, ast.Name) else name
            if name == "Field":
                for keyword in node.keywords:
                    if keyword.arg == "description" and isinstance(keyword.value, ast.Constant):
                        yield keyword.value


def _sphinx_markup() -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        for string in _documentation(ast.parse(path.read_text(encoding="utf-8"))):
            text = str(string.value)
            for pattern in (_ROLE, _LITERAL_BLOCK):
                for match in pattern.finditer(text):
                    line = string.lineno + text.count("\n", 0, match.start())
                    found.append(f"{path.relative_to(SOURCE.parent)}:{line}: {match.group()!r}")
    return found


def test_the_scan_reads_docstrings_and_field_descriptions() -> None:
    """The scan itself: it sees each kind of documentation string it is meant to see."""
    tree = ast.parse(
        '"""Module :class:`A`."""\n'
        "X = 1\n"
        '"""Attribute :data:`X`."""\n'
        "class M:\n"
        '    """Class."""\n'
        '    f: int = Field(description="Field :meth:`m`.")\n'
        "    def m(self):\n"
        '        """Method::\n\n            code\n        """\n'
    )
    texts = [str(string.value) for string in _documentation(tree)]
    assert len(texts) == 5
    assert sum(bool(_ROLE.search(text)) for text in texts) == 3
    assert sum(bool(_LITERAL_BLOCK.search(text)) for text in texts) == 1


def test_no_docstring_holds_sphinx_markup() -> None:
    assert _sphinx_markup() == []
