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
- import_cycles: groups of modules that import each other, directly or around a circle; every
  import counts (module level, under TYPE_CHECKING, inside a function).
- turn_runner_lines / turn_runner_methods: the `TurnRunner` class, plus every module-level
  function that takes a `TurnRunner` (its helpers are its own).

    python scripts/shape.py --turn     # the modules a turn passes through (runs one; imports keel)

`--turn` runs turns on the scripted model (a tool call and an answer; then the same streamed with
memory on, then an approval held and decided) under a profiler and names every module of
`keel.runtime` whose code ran ("runtime"), and every module outside it that runtime code called
directly ("outside": the interfaces a reader follows out of the runtime).
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


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_targets(node: ast.AST, here: str, is_package: bool, known: set[str]) -> list[str]:
    """The keel modules one import statement reads (a package's submodule when it names one)."""
    found: list[str] = []
    if isinstance(node, ast.Import):
        found = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = here.split(".") if is_package else here.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.append(submodule if submodule in known else base)
    return [name for name in found if name in known]


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected groups (more than one module) of src/keel's import graph."""
    modules = {
        _module_name(path, root): (path, ast.parse(path.read_text()))
        for path in sorted(root.rglob("*.py"))
    }
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets.update(_import_targets(node, name, path.name == "__init__.py", known))
        targets.discard(name)
        # A package's own __init__ importing its submodules is how a package is built, and a
        # submodule importing a sibling through the package is the same edge: both count.
        graph[name] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(start: str) -> None:
        # Tarjan's algorithm, iterative (the graph is deep enough to hit the recursion limit).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter[0]
                    counter[0] += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return groups


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
    runner_lines, runner_methods = 0, 0
    runner_parts: list[str] = []
    for path, tree, _text in modules:
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "TurnRunner":
                runner_lines += _span(node)
                runner_methods += sum(
                    isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body
                )
                runner_parts.append(f"{path.relative_to(root.parent)}:{node.lineno} TurnRunner")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                annotations = [a.annotation for a in node.args.args + node.args.kwonlyargs]
                if any(a is not None and "TurnRunner" in ast.unparse(a) for a in annotations):
                    runner_lines += _span(node)
                    runner_methods += 1
                    runner_parts.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                    )
    cycles = import_cycles(root)
    figures: dict[str, object] = {
        "agent_class_lines": agent_lines,
        "files_over_1000": len(long_files),
        "functions_over_80": len(long_functions),
        "classes_over_30_methods": len(big_classes),
        "lazy_keel_imports": len(lazy),
        "lazy_uncommented": len(uncommented),
        "upward_imports": len(upward),
        "import_cycles": len(cycles),
        "turn_runner_lines": runner_lines,
        "turn_runner_methods": runner_methods,
    }
    if show:
        for label, rows in (
            ("files over 1000", long_files),
            ("functions over 80", long_functions),
            ("classes over 30 methods", big_classes),
            ("lazy keel imports", lazy),
            ("lazy keel imports without a comment", uncommented),
            ("upward imports", upward),
            ("import cycles", [" <-> ".join(group) for group in cycles]),
            ("TurnRunner and its helpers", runner_parts),
        ):
            print(f"## {label}: {len(rows)}")
            for row in rows:
                print("  " + row)
    return figures


def turn_modules() -> dict[str, list[str]]:
    """Run turns on the scripted model under a profiler; the modules they passed through."""
    import asyncio
    import json as _json
    import tempfile

    from keel import Agent, tool
    from keel.settings import load_settings
    from keel.testing import ScriptedModel

    @tool
    def lookup(query: str) -> str:
        """Look records up.

        Args:
            query: What to look up.
        """
        return "found " + query

    @tool(approval="operator")
    def refund(order: str) -> str:
        """Refund an order.

        Args:
            order: The order.
        """
        return "refunded " + order

    def policy(call):  # type: ignore[no-untyped-def]
        if call.messages[-1].role == "tool":
            return "The answer."
        name = "refund" if "refund" in call.last_user_text else "lookup"
        argument = "order" if name == "refund" else "query"
        return ScriptedModel.tool_call(name, _json.dumps({argument: "A1"}))

    runtime: set[str] = set()
    outside: set[str] = set()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        callee = frame.f_code.co_filename
        if "/keel/" not in callee:
            return
        name = "keel/" + callee.rsplit("/keel/", 1)[1]
        if name.startswith("keel/runtime/"):
            runtime.add(name)
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if "/keel/runtime/" in caller:
            outside.add(name)

    async def main(directory: str) -> None:
        settings = load_settings(data_dir=Path(directory), embedder="hashing:256")
        agent = Agent.open(
            None,
            settings=settings,
            model=ScriptedModel(policy),
            system_prompt="You answer from the records.",
            tools=[lookup, refund],
            memory=True,
        )
        try:
            await agent.handle("warm", "user", "hello")  # imports and first-use caches
            sys.setprofile(profile)
            await agent.handle("s", "user", "look it up")
            async for _event in agent.stream("look it up again", session="s", user="user"):
                pass
            reply = await agent.handle("s", "user", "refund it")
            for request in reply.approvals:
                await agent.decide("s", request.id, approve=True, by="operator")
        finally:
            sys.setprofile(None)
            await agent.aclose()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(main(directory))
    return {"runtime": sorted(runtime), "outside": sorted(outside)}


if __name__ == "__main__":
    if "--turn" in sys.argv:
        sys.path.insert(0, str(ROOT.parent))
        found = turn_modules()
        print("\n".join(f"{kind}: {name}" for kind, names in found.items() for name in names))
        print(
            json.dumps(
                {
                    "turn_runtime_modules": len(found["runtime"]),
                    "turn_outside_modules": len(found["outside"]),
                }
            )
        )
        sys.exit(0)
    where = Path(sys.argv[sys.argv.index("--root") + 1]) if "--root" in sys.argv else ROOT
    print(json.dumps(measure(show="--list" in sys.argv, root=where)))
