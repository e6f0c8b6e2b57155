"""Graceful drain: on SIGTERM the turns in flight finish, new ones get 503, then the server
stops.

uvicorn alone stops listening at once and gives in-flight requests a grace period. A worker
that is about to go away should instead keep answering, refusing new turns with 503 and
``Retry-After`` (a load balancer or client sends them to another worker), until the turns it
holds are done; a second signal stops it at once.
"""

from __future__ import annotations

import socket
import threading
import time
from types import FrameType
from typing import Any

from keel.service._process import freeze_startup_heap

__all__ = ["Drain", "DrainingServer"]


class Drain:
    """What the app and the server share: whether draining started, and the turns in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1


def _server_base() -> Any:
    import uvicorn

    return uvicorn.Server


class DrainingServer(_server_base()):  # type: ignore[misc]
    """A uvicorn server whose first SIGTERM (or SIGINT) drains, and whose second stops. As it
    starts it freezes the start-up heap (:func:`freeze_startup_heap`).

    Args:
        config: uvicorn's ``Config``.
        drain: the app's :class:`Drain` (``create_app(drain=...)``).
        drain_timeout_s: the longest the turns in flight are waited for.
    """

    def __init__(self, config: Any, drain: Drain, *, drain_timeout_s: float = 60.0) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Before it listens (``started``), with the app built: what the app's own start-up
        # adds (its connections) is little.
        freeze_startup_heap()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True
        threading.Thread(
            target=self._exit_when_drained, args=(sig, frame), name="keel-drain", daemon=True
        ).start()

    def _exit_when_drained(self, sig: int, frame: FrameType | None) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.drain.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        super().handle_exit(sig, frame)
