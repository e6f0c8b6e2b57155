"""What a server process does once, when it has started and before it takes traffic."""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect, then move every object alive now (modules, classes, the app, its stores) out
    of the cyclic garbage collector's sight for good.

    A worker's start-up leaves about 100k long-lived objects; each full collection would walk
    them all again, 30-90 ms here, and a turn waiting on it pays that. They live as long as the
    process, so only the objects made after start-up are worth scanning. Call it in a process
    that is a server, never in one that embeds an app among other work (tests): frozen objects
    that later become cyclic garbage are never freed.
    """
    gc.collect()
    gc.freeze()
