"""Whether a server store answered lately: a store known to be down fails at once.

A database that stopped, restarted or lost its connections would otherwise hold every call
for its pool's whole timeout (30 s by default) while the pool retries in the background: a
turn's request hangs instead of answering 503. So a store remembers the last failure that
said the server went away (a refused connection, a connection cut or shut down); from then
on calls fail at once with [`BackendUnavailableError`][keel.errors.BackendUnavailableError],
except one every ``retry_every_s``, which tries the server with one new connection (not the
pool). When that answers, the store drops the pool's connections that died with the server
and serves again: no restart of the worker.
"""

from __future__ import annotations

import threading
import time

from keel.errors import BackendUnavailableError

__all__ = ["Availability"]


class Availability:
    """One server's recent health, shared by the calls of every thread and event loop.

    Args:
        store: the store's name in errors and ``/ready`` (``"postgresql"``).
        where: the server's location in messages (host, port, database; no credentials).
        retry_every_s: while down, how often one call tries the server again.
    """

    def __init__(self, store: str, where: str, *, retry_every_s: float = 0.5) -> None:
        self.store = store
        self.where = where
        self.retry_every_s = retry_every_s
        self.down_since: float | None = None
        self.reason = ""
        self.refused = 0
        """Tries of a new connection that failed since the server went away."""
        self._next_try = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """Whether the last word from the server was a failure that said it went away."""
        return self.down_since is not None

    def must_try(self) -> bool:
        """Whether this call must try the server before it goes on: False while the server is
        up; True for the one call of each ``retry_every_s`` while it is down (it reports
        [`answered`][] or [`failed`][] then).

        Raises:
            BackendUnavailableError: the server is down and another call tried it lately.
        """
        with self._lock:
            if self.down_since is None:
                return False
            now = time.monotonic()
            if now >= self._next_try:
                self._next_try = now + self.retry_every_s
                return True
        raise self.unavailable()

    def failed(self, reason: str, *, tried: bool = False) -> None:
        """The server went away, or still is: calls fail at once until it answers again.

        ``tried``: this was the call that tried the server again, and it failed (the next try
        is ``retry_every_s`` away). Otherwise a call on a connection the pool held failed:
        the next call tries a new connection at once, since a server that restarted while
        the pool held its connections is up already."""
        with self._lock:
            now = time.monotonic()
            if tried:
                self._next_try = now + self.retry_every_s
                self.refused += 1
            elif self.down_since is None:
                self._next_try = now
            if self.down_since is None:
                self.down_since = now
            self.reason = reason

    def answered(self) -> int:
        """The server answered: calls go to it again. How many tries had failed before (none:
        a connection was cut, the server itself never went away)."""
        with self._lock:
            refused, self.refused = self.refused, 0
            self.down_since = None
            self.reason = ""
            return refused

    def unavailable(self) -> BackendUnavailableError:
        """The error a call gets while the server is down."""
        since = 0.0 if self.down_since is None else time.monotonic() - self.down_since
        return BackendUnavailableError(
            f"{self.store} at {self.where} is unavailable (down for {since:.1f} s: "
            f"{self.reason}); tried again every {self.retry_every_s:g} s",
            store=self.store,
            retry_after_s=max(1.0, self.retry_every_s),
        )
