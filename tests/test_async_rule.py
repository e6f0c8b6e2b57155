"""docs/architecture.md "One async policy", kept true: no module of ``src/keel`` starts a
thread, a thread pool or an event loop, or hands work to one (``asyncio.to_thread``,
``run_in_executor``, ``asyncio.run``...), except the ones listed here, each with its reason
(the same as the docs'). Blocking work goes through ``keel._bridge.run_blocking``, work that
may outlive its caller through ``keel._bridge.run_in_thread``, sync twins through
``keel._bridge.run_sync``. Read with Python's ``ast``: a call in a comment or a string is no
call, an annotation that names ``threading.Thread`` is none either."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "keel"

# Calls that start a thread, a pool or an event loop, or hand work to one, by the name they end
# with; ``run`` only as ``asyncio.run``.
OWNING = {
    "to_thread",
    "run_in_executor",
    "new_event_loop",
    "Runner",
    "Thread",
    "Timer",
    "ThreadPoolExecutor",
    "ProcessPoolExecutor",
}
ASYNCIO_RUN = "asyncio.run"

HARNESSES = {
    "bench": "benchmarks drive keel from outside, as a user's program does: their loops, "
    "threads and concurrent clients are the user's side of the measurement",
    "testing": "conformance suites and test servers race threads and loops against keel on "
    "purpose, as its users' programs would",
    "demo": "the demo's driver and worker are programs using keel (a process reading stdin, "
    "a parent reading its child's output), not keel itself",
}
"""Packages whose threads and loops are a harness around keel, not keel's own."""

ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("_bridge.py", "new_event_loop"): (1, "the bridge loop itself: sync twins run on it"),
    ("_bridge.py", "Thread"): (
        2,
        "the bridge loop's thread, and run_in_thread's daemon threads for work that may "
        "outlive its caller (a sync tool that hangs past its timeout, a model's generation): "
        "a bounded pool would fill up with hung calls",
    ),
    ("_bridge.py", "ThreadPoolExecutor"): (1, "the one blocking pool (keel-blocking-N)"),
    ("_bridge.py", "run_in_executor"): (1, "run_blocking hands work to that pool"),
    ("cli/_chat.py", "Runner"): (
        1,
        "keel chat runs its turns on an asyncio.Runner in the main thread, where Ctrl-C "
        "cancels a turn directly",
    ),
}
"""(module, call) -> (how many such calls, why). Keep docs/architecture.md in step."""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return "?"


def owning_calls(source: str) -> list[tuple[str, int]]:
    """The calls in ``source`` that start or use a thread, a pool or an event loop, by the
    name the rule knows them by, with their lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        dotted = _name(node.func)
        last = dotted.rsplit(".", 1)[-1]
        if dotted == ASYNCIO_RUN:
            found.append(("asyncio.run", node.lineno))
        elif last in OWNING:
            found.append((last, node.lineno))
    return sorted(found, key=lambda call: call[1])


def _calls_in_keel() -> tuple[Counter[tuple[str, str]], list[str]]:
    counts: Counter[tuple[str, str]] = Counter()
    where: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module.split("/", 1)[0] in HARNESSES:
            continue
        for call, line in owning_calls(path.read_text()):
            counts[(module, call)] += 1
            where.append(f"{module}:{line} {call}")
    return counts, where


def test_only_the_listed_modules_own_a_thread_or_a_loop_each_for_its_reason() -> None:
    counts, where = _calls_in_keel()
    unlisted = sorted(
        f"{module}: {call}" for (module, call) in counts if (module, call) not in ALLOWED
    )
    assert not unlisted, (
        "a thread, a pool or an event loop outside keel._bridge: use run_blocking, "
        f"run_in_thread or run_sync (or list it, with its reason): {unlisted}\n" + "\n".join(where)
    )
    changed = {
        key: (counts[key], expected)
        for key, (expected, _) in ALLOWED.items()
        if counts[key] != expected
    }
    assert not changed, f"the allow-list is out of date (found, listed): {changed}"
    assert all(why for _, why in ALLOWED.values())


def test_the_scan_sees_each_kind_of_call_and_ignores_names_that_are_no_calls() -> None:
    source = """
import asyncio, threading
from concurrent.futures import ThreadPoolExecutor
owners: dict[threading.Thread, int] = {}  # an annotation, no call
text = "asyncio.to_thread(f)"
async def f(loop):
    await asyncio.to_thread(print)
    await loop.run_in_executor(None, print)
    asyncio.run(f(loop))
    asyncio.new_event_loop()
    threading.Thread(target=print).start()
    ThreadPoolExecutor(2)
    asyncio.Runner()
    task.run()
"""
    assert [call for call, _ in owning_calls(source)] == [
        "to_thread",
        "run_in_executor",
        "asyncio.run",
        "new_event_loop",
        "Thread",
        "ThreadPoolExecutor",
        "Runner",
    ]


def test_every_harness_package_exists_and_says_why() -> None:
    for package, why in HARNESSES.items():
        assert (SRC / package / "__init__.py").exists() and why
