"""LangGraph's own checkpointer conformance suite (``langgraph-checkpoint-conformance``) run
against keel's checkpointer on a backend URL; the tests and ``keel bench integrations`` share
it. Needs the ``langgraph`` extra and the conformance package (the ``test`` extra)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from langgraph.checkpoint.conformance import checkpointer_test, validate

from keel.integrations.langgraph import KeelCheckpointSaver

__all__ = ["conformance_failures"]


def conformance_failures(url: str) -> dict[str, list[str]]:
    """Every capability of the suite run on a fresh ``KeelCheckpointSaver(url)`` each; the
    failures of each capability that did not pass (a capability not detected counts as not
    passed, with no failure named). Empty: the suite passes in full."""

    @checkpointer_test(name=f"keel on {url.split(':', 1)[0]}")
    async def factory() -> AsyncIterator[KeelCheckpointSaver]:
        saver = KeelCheckpointSaver(url)
        try:
            yield saver
        finally:
            saver.close()

    report = asyncio.run(validate(factory))
    return {
        capability: list(result.failures)
        for capability, result in report.results.items()
        if result.passed is not True
    }
