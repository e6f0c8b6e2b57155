"""Instructions a turn runs, one count per turn, under callgrind (load-independent).

The workload of ``keel bench turns``' keel session, memory off (``--memory``: on, as the
bench's memory-on leg runs it, its outbox embedding on its own thread, every thread counted):
one session on SQLite, the scripted model calling the bench's sync ``lookup`` tool once and
answering (two model calls, one tool call a turn). ``--warm`` turns run uncounted, then each
of ``--count`` turns is counted on its own (callgrind's client requests, through a small C
helper this script compiles with ``gcc`` against valgrind's headers), so the median turn is
seen apart from the rare turns that write a snapshot or run SQLite's WAL checkpoint::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \\
        --callgrind-out-file=/tmp/turns.cg python scripts/turn_instructions.py --count 100
    python scripts/turn_instructions.py --summarize /tmp/turns.cg

A memory-on session recalls nothing while its whole session is in the prompt's window (recall
leaves out what the window shows) and ten hits late: count ``--memory --warm 200`` and
``--memory --warm 900`` for turns 201-300 and 901-1000. ``--whole`` dumps the counted turns
once, for ``callgrind_annotate`` by function (the median is then not seen).

Run outside valgrind, the requests do nothing: the script then prints the turns' wall-clock
p50 and CPU time, as a quick check.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from keel.bench._react import ANSWER, question, tool_output
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

_HELPER = """
#include <valgrind/callgrind.h>
void turn_start(void) {
    CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT;
}
void turn_dump(void) { CALLGRIND_DUMP_STATS; }
void turns_end(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _helper(directory: Path) -> ctypes.CDLL:
    source, library = directory / "turns.c", directory / "libturns.so"
    source.write_text(_HELPER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    return tool_output(query)


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return ANSWER
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-24:]}))


def bench_agent(directory: Path, *, memory: bool = False) -> Agent:
    """The ``keel bench turns`` agent on a database in ``directory`` (also the workload of
    ``turn_pages.py`` and ``turn_switches.py``): the scripted model calls ``lookup`` once a
    turn, then answers."""
    return Agent.open(
        None,
        settings=load_settings(data_dir=directory / "keel", embedder="hashing:256"),
        model=ScriptedModel(_policy, keep_calls=0),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=memory,
    )


def _run(warm: int, count: int, *, memory: bool = False, whole: bool = False) -> None:
    with tempfile.TemporaryDirectory() as directory:
        counter = _helper(Path(directory))
        agent = bench_agent(Path(directory), memory=memory)

        async def drive() -> tuple[list[float], float]:
            times: list[float] = []
            try:
                for turn in range(warm):
                    await agent.handle("bench", "user", question(turn))
                counter.turn_start()
                cpu = time.process_time()
                for turn in range(warm, warm + count):
                    started = time.perf_counter()
                    reply = await agent.handle("bench", "user", question(turn))
                    times.append((time.perf_counter() - started) * 1000)
                    if not whole:
                        counter.turn_dump()
                    if reply.text != ANSWER:
                        raise RuntimeError(f"turn {turn}: {reply.status} {reply.error}")
                if whole:
                    counter.turn_dump()
                counter.turns_end()
                return times, (time.process_time() - cpu) * 1000 / count
            finally:
                await agent.aclose()

        times, cpu_ms = asyncio.run(drive())
    print(f"p50 {statistics.median(times):.3f} ms, CPU {cpu_ms:.3f} ms a turn")


def _summarize(prefix: str) -> None:
    counts = []
    out = Path(prefix)
    for path in out.parent.glob(f"{out.name}.*"):
        for line in path.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                counts.append(int(line.split()[1]))
                break
    # The last dump (at the end of the counting) holds nothing: the turns' own dumps only.
    counts = sorted(count for count in counts if count > 0)
    if not counts:
        raise SystemExit(f"no callgrind dumps at {prefix}.*")
    p90 = counts[len(counts) * 9 // 10]
    print(
        f"{len(counts)} turns: median {statistics.median(counts) / 1e6:.3f}M, "
        f"mean {statistics.mean(counts) / 1e6:.3f}M, p90 {p90 / 1e6:.3f}M, "
        f"max {counts[-1] / 1e6:.3f}M instructions"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=120)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--memory", action="store_true", help="memory on, as the bench runs it")
    parser.add_argument("--whole", action="store_true", help="one dump for the counted turns")
    parser.add_argument("--summarize", metavar="OUT_FILE", help="read the dumps of a run")
    options = parser.parse_args()
    if options.summarize:
        _summarize(options.summarize)
    else:
        _run(options.warm, options.count, memory=options.memory, whole=options.whole)


if __name__ == "__main__":
    main()
