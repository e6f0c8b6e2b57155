"""Graceful drain: on SIGTERM the turns in flight finish, new ones get 503, then the server
stops.

uvicorn alone stops listening at once and gives in-flight requests a grace period. A worker
that is about to go away should instead keep answering, refusing new turns with 503 and
``Retry-After`` (a load balancer or client sends them to another worker), until the turns it
holds are done; a second signal stops it at once.

With ``--workers N`` uvicorn's supervisor sends each worker SIGTERM and keeps the listening
socket open until they are gone; a worker that stopped accepting at once (uvicorn's own
shutdown) would leave new connections waiting in the socket's backlog until the supervisor
exits and drops them. `DrainingMultiprocess` makes every worker a
[`DrainingServer`][], so a multi-worker server drains exactly as a single process does.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from keel.service._process import freeze_startup_heap

__all__ = ["Drain", "DrainingMultiprocess", "DrainingServer", "worker_drain"]


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


_worker_drain: list[Drain] = []


def worker_drain() -> Drain:
    """This worker process's drain, shared by its server (`DrainingMultiprocess`) and
    its app (``keel.service._factory.create``): one per process."""
    if not _worker_drain:
        _worker_drain.append(Drain())
    return _worker_drain[0]


def _server_base() -> Any:
    import uvicorn

    return uvicorn.Server


class DrainingServer(_server_base()):  # type: ignore[misc]
    """A uvicorn server whose first SIGTERM (or SIGINT) drains, and whose second stops. As it
    starts it freezes the start-up heap (`freeze_startup_heap`).

    Args:
        config: uvicorn's ``Config``.
        drain: the app's [`Drain`][] (``create_app(drain=...)``).
        drain_timeout_s: the longest the turns in flight are waited for (default: the
            config's ``drain_timeout_s``, else 60 s).
        on_started: called once the app's start-up is done and the socket accepts: a
            request sent from then on is answered.
    """

    def __init__(
        self,
        config: Any,
        drain: Drain,
        *,
        drain_timeout_s: float | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.on_started = on_started
        self._exit_after_drain: tuple[int, FrameType | None, float] | None = None
        self.drain_timeout_s = (
            drain_timeout_s
            if drain_timeout_s is not None
            else float(getattr(config, "drain_timeout_s", 60.0))
        )

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Before it listens (``started``), with the app built: what the app's own start-up
        # adds (its connections) is little.
        freeze_startup_heap()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True
        # The server's own loop ends the drain (``on_tick``, every 0.1 s), not a thread.
        self._exit_after_drain = (sig, frame, time.monotonic() + self.drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        pending = self._exit_after_drain
        if pending is not None:
            sig, frame, deadline = pending
            if self.drain.in_flight <= 0 or time.monotonic() >= deadline:
                self._exit_after_drain = None
                super().handle_exit(sig, frame)
        should_exit: bool = await super().on_tick(counter)
        return should_exit


def _multiprocess_bases() -> tuple[Any, Any]:
    from uvicorn.supervisors import multiprocess

    return multiprocess.Process, multiprocess.Multiprocess


class _DrainingProcess(_multiprocess_bases()[0]):  # type: ignore[misc]
    """A worker of uvicorn's supervisor whose server drains (it is built in the worker)."""

    @property
    def server(self) -> Any:
        server: Any = self.__dict__.get("_server")
        if server is None:
            server = self._server = DrainingServer(self.config, worker_drain())
        return server

    def target(self, sockets: list[socket.socket] | None = None) -> None:
        # Built before uvicorn starts the health-check thread: were both threads to build it
        # lazily at once, the pings could read a server that never starts, and the
        # supervisor would wait for a ready worker for ever.
        _ = self.server
        super().target(sockets)


class DrainingMultiprocess(_multiprocess_bases()[1]):  # type: ignore[misc]
    """uvicorn's multi-process supervisor whose workers are [`DrainingServer`][] s: on
    SIGTERM each keeps serving, refusing new requests with 503, until its turns are done.
    The app the workers load must use `worker_drain` as its drain.

    Args:
        config: uvicorn's ``Config``.
        sockets: the listening sockets the workers share.
        on_ready: called once every first worker has finished its start-up (agent,
            embedder, connections) and accepts: a request sent from then on is answered.
    """

    def __init__(
        self,
        config: Any,
        sockets: list[socket.socket],
        *,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config, sockets)
        self.on_ready = on_ready
        self.failed_exit_code: int | None = None
        """The exit code of a first worker that stopped before it was ready (else None)."""

    def init_processes(self) -> None:
        # Ctrl-C reaches every process of the terminal's group: a worker still importing keel
        # printed a KeyboardInterrupt traceback each. The workers start with it ignored (an
        # ignored signal stays ignored in a spawned process) until their server takes its
        # signals as it starts; the supervisor stops them on its own Ctrl-C.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            super().init_processes()
        finally:
            signal.signal(signal.SIGINT, previous)
        # Until the first worker's start-up ends the socket does not even accept: a client
        # told "listening" before then is refused. Wait for every worker, so that a request
        # is never queued behind one still loading its embedder.
        waiting = list(self.processes)
        while waiting and not self.should_exit.is_set():
            for process in list(waiting):
                if not process.process.is_alive():
                    process.join()
                    # A SIGTERM sent to the whole group (systemd's default) stops the workers
                    # as it stops this process: a stop, not a worker that failed.
                    self.handle_signals()
                    if not self.should_exit.is_set():
                        self.failed_exit_code = process.exitcode
                    # run() then stops the other workers and returns.
                    self.should_exit.set()
                    return
                if process.is_ready(timeout=1):
                    waiting.remove(process)
            self.handle_signals()  # SIGTERM while starting: stop, never say ready
            if waiting:
                self.should_exit.wait(0.05)
        if not waiting and not self.should_exit.is_set() and self.on_ready is not None:
            self.on_ready()

    def run(self) -> None:
        from uvicorn.supervisors import multiprocess

        # The supervisor makes (and remakes) its workers through this module's name, in this
        # process only: a `keel serve --workers N` parent does nothing else.
        original = multiprocess.Process
        multiprocess.Process = _DrainingProcess  # type: ignore[misc]
        try:
            super().run()
        finally:
            multiprocess.Process = original  # type: ignore[misc]
