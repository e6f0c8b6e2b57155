"""Measure the shape of keel's source with Python's `ast`: the figures issue 34 sets targets for.

    python scripts/shape.py            # one JSON object
    python scripts/shape.py --list     # plus the offenders behind each figure
    python scripts/shape.py --root DIR # another checkout's src/keel (a base commit, say)

Counted over src/keel:
- agent_class_lines: lines of `Agent` plus every keel-defined base class it inherits from.
- files_over_1000: source files longer than 1,000 lines.
- functions_over_80: functions (and methods) longer than 80 lines, decorators excluded.
- classes_over_30_methods: classes defining more than 30 methods (inherited ones not counted).
- lazy_keel_imports: imports of keel modules inside functions outside keel/cli
  (`importlib.import_module` counted too); lazy_uncommented: those without a comment (on the
  line or one of the two above) saying why.
- upward_imports: imports from a package's module into `keel.stores` from memory/ or tracing/,
  or more generally from a lower layer into a higher one (see LAYERS).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "keel"

# A package may import only from packages listed after it (lower layers). Anything missing here is
# not checked. stores/ implements the interfaces memory/, state/ and tracing/ define, so those three
# must never import keel.stores (the stores import them).
LOWER_THAN_STORES = ("memory", "tracing", "state", "context", "privacy", "tools", "models")


def _modules(root: Path) -> list[tuple[Path, ast.Module, str]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        found.append((path, ast.parse(text), text))
    return found


def _span(node: ast.AST) -> int:
    return int(node.end_lineno or 0) - int(node.lineno) + 1  # type: ignore[attr-defined]


def _keel_module(node: ast.AST, path: Path) -> str | None:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return "keel(relative)"
        if node.module and (node.module == "keel" or node.module.startswith("keel.")):
            return node.module
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "keel" or alias.name.startswith("keel."):
                return alias.name
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).startswith("keel")
    ):
        return str(node.args[0].value)
    return None


def _commented(text: str, line: int) -> bool:
    lines = text.splitlines()
    return any("#" in lines[i] for i in range(max(0, line - 3), line))


def measure(show: bool = False, root: Path = ROOT) -> dict[str, object]:
    modules = _modules(root)
    classes: dict[str, tuple[ast.ClassDef, Path]] = {}
    long_files, long_functions, big_classes, lazy, upward = [], [], [], [], []
    uncommented: list[str] = []
    for path, tree, text in modules:
        rel = str(path.relative_to(root.parent))
        lines = text.count("\n") + 1
        if lines > 1000:
            long_files.append(f"{rel} {lines}")
        package = path.relative_to(root).parts[0] if len(path.relative_to(root).parts) > 1 else ""
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (node, path))
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > 30:
                    big_classes.append(f"{rel}:{node.name} {len(methods)}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _span(node) > 80:
                    long_functions.append(f"{rel}:{node.lineno} {node.name} {_span(node)}")
                if package != "cli":
                    for inner in ast.walk(node):
                        if inner is node:
                            continue
                        target = _keel_module(inner, path)
                        line = getattr(inner, "lineno", 0)
                        if target and f"{rel}:{line} {target}" not in lazy:  # nested: once
                            lazy.append(f"{rel}:{line} {target}")
                            if not _commented(text, line):
                                uncommented.append(f"{rel}:{line} {target}")
            if package in LOWER_THAN_STORES and isinstance(node, ast.Import | ast.ImportFrom):
                target = _keel_module(node, path) or ""
                if target.startswith("keel.stores"):
                    upward.append(f"{rel}:{node.lineno} {target}")
    agent_lines = 0
    pending = ["Agent"]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in classes:
            continue
        seen.add(name)
        node, _ = classes[name]
        agent_lines += _span(node)
        pending.extend(b.id for b in node.bases if isinstance(b, ast.Name))
    figures: dict[str, object] = {
        "agent_class_lines": agent_lines,
        "files_over_1000": len(long_files),
        "functions_over_80": len(long_functions),
        "classes_over_30_methods": len(big_classes),
        "lazy_keel_imports": len(lazy),
        "lazy_uncommented": len(uncommented),
        "upward_imports": len(upward),
    }
    if show:
        for label, rows in (
            ("files over 1000", long_files),
            ("functions over 80", long_functions),
            ("classes over 30 methods", big_classes),
            ("lazy keel imports", lazy),
            ("lazy keel imports without a comment", uncommented),
            ("upward imports", upward),
        ):
            print(f"## {label}: {len(rows)}")
            for row in rows:
                print("  " + row)
    return figures


if __name__ == "__main__":
    where = Path(sys.argv[sys.argv.index("--root") + 1]) if "--root" in sys.argv else ROOT
    print(json.dumps(measure(show="--list" in sys.argv, root=where)))
