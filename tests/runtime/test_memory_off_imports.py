"""An agent with memory off never imports numpy: memory's vectors, embedders and stores load
with the first memory that is used. numpy starts OpenBLAS's threads when it is imported, and
takes a tenth of a second to import, for nothing a memory-off agent does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_TURN = """
import asyncio, sys
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel

agent = Agent.open(
    settings=load_settings(data_dir=sys.argv[1], embedder="hashing:64"),
    model=ScriptedModel(["Noted."]),
    system_prompt="You help.",
    memory=sys.argv[2] == "on",
)


async def turn() -> None:
    try:
        reply = await agent.handle("s1", "u1", "hello")
        assert reply.status == "completed", reply.error
    finally:
        await agent.aclose()


asyncio.run(turn())
print("numpy" in sys.modules)
"""


def _imports_numpy(data_dir: Path, memory: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", _TURN, str(data_dir), memory],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1] == "True"


def test_a_turn_with_memory_off_never_imports_numpy(tmp_path: Path) -> None:
    assert _imports_numpy(tmp_path / "off", "off") is False


def test_a_turn_with_memory_on_still_loads_it(tmp_path: Path) -> None:
    # The lazy names resolve: memory's store and embedder are built and used.
    assert _imports_numpy(tmp_path / "on", "on") is True


def test_memory_lists_and_resolves_its_lazy_names() -> None:
    import keel.memory
    from keel.memory._memory import Memory

    assert set(keel.memory.__all__) <= set(dir(keel.memory))
    assert keel.memory.Memory is Memory
    for name in keel.memory.__all__:
        assert getattr(keel.memory, name) is not None, name
