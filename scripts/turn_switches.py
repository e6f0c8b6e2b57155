"""Thread switches and event-loop waits a memory-off turn makes (less load-dependent than time).

The workload of ``keel bench turns --no-memory`` (as ``scripts/turn_instructions.py``).
``--warm`` turns run uncounted, then over ``--count`` turns: each thread's
``voluntary_ctxt_switches`` (the thread went to sleep, to be woken later) and
``nonvoluntary_ctxt_switches`` from ``/proc/self/task/*/status`` (Linux), and the event loop's
waits in its selector (a ``select`` given a timeout)::

    PYTHONPATH=src python scripts/turn_switches.py --warm 50 --count 300
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import tempfile
from pathlib import Path
from typing import Any

from turn_instructions import bench_agent

from keel.bench._react import question


def _switches() -> tuple[int, int]:
    voluntary = involuntary = 0
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except FileNotFoundError:  # a thread that just ended
            continue
        for line in lines:
            if line.startswith("voluntary_ctxt_switches"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--count", type=int, default=300)
    options = parser.parse_args()
    waits = [0]
    select = selectors.DefaultSelector.select

    def counted(self: Any, timeout: float | None = None) -> Any:
        if timeout is None or timeout > 0:
            waits[0] += 1
        return select(self, timeout)

    selectors.DefaultSelector.select = counted  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory() as directory:
        agent = bench_agent(Path(directory))

        async def drive() -> None:
            try:
                for turn in range(options.warm):
                    await agent.handle("bench", "user", question(turn))
                (voluntary, involuntary), waited = _switches(), waits[0]
                for turn in range(options.warm, options.warm + options.count):
                    await agent.handle("bench", "user", question(turn))
                after, count = _switches(), options.count
                print(
                    f"{count} turns: voluntary switches {(after[0] - voluntary) / count:.2f} a "
                    f"turn, involuntary {(after[1] - involuntary) / count:.2f}, the loop's "
                    f"waits {(waits[0] - waited) / count:.2f}"
                )
            finally:
                await agent.aclose()

        asyncio.run(drive())


if __name__ == "__main__":
    main()
