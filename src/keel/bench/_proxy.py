"""A TCP proxy that cuts connections, between keel and its servers, for ``keel bench serve
--chaos network`` and the tests: ``python -m keel.bench._proxy LISTEN_PORT TARGET [options]``.

``TARGET`` is ``HOST:PORT`` or ``unix:PATH`` (the embedded PostgreSQL listens on a Unix socket
only). Every connection to ``127.0.0.1:LISTEN_PORT`` is relayed byte for byte to the target,
until the proxy cuts it:

- on ``SIGUSR1``, each live connection is cut with probability ``--cut-share`` (seeded by
  ``--seed``): both sides are reset at once, whatever was in flight (a query, its answer, a
  ``COMMIT``) is lost on the way;
- with ``--cut-on TEXT``, the first ``--cut-count`` client chunks that hold ``TEXT`` (say
  ``COMMIT``) cut their connection: ``--cut-when before`` drops the chunk (the server never
  sees it: the transaction rolls back), ``after`` delivers it and drops the server's answer
  (the server committed; the client never hears so). With ``--disarmed``, only those after a
  ``SIGUSR2`` (each one arms ``--cut-count`` more).

Each cut is one line on stdout (``cut <connection> <why>``), flushed, so the bench counts them
from the proxy's own log. It stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import socket
import sys
from dataclasses import dataclass, field

__all__ = ["main"]

_CHUNK = 65536


@dataclass
class _Pair:
    """One relayed connection: the client's side and the server's."""

    number: int
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    answer_dropped: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        """Both sides reset (RST, not FIN): as a network that drops a connection."""
        for writer in (self.client, self.server):
            sock = writer.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class CuttingProxy:
    """The proxy's state: its live connections and what cuts them."""

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.rng = random.Random(options.seed)
        self.live: dict[int, _Pair] = {}
        self.numbers = iter(range(1 << 62))
        self.pattern = options.cut_on.encode() if options.cut_on else None
        self.pattern_cuts_left = 0 if options.disarmed else options.cut_count

    def arm(self) -> None:
        """SIGUSR2: the next ``--cut-count`` chunks holding ``--cut-on`` cut their connection."""
        self.pattern_cuts_left = self.options.cut_count
        self._say("armed")

    def _say(self, line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def cut(self, pair: _Pair, why: str) -> None:
        if self.live.pop(pair.number, None) is None:
            return
        pair.reset()
        self._say(f"cut {pair.number} {why}")

    def cut_at_random(self) -> None:
        """SIGUSR1: each live connection cut with probability ``--cut-share``."""
        chosen = [p for p in list(self.live.values()) if self.rng.random() < self.options.cut_share]
        for pair in chosen:
            self.cut(pair, "random")
        self._say(f"signal {len(chosen)} of {len(chosen) + len(self.live)}")

    async def _open_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        target: str = self.options.target
        if target.startswith("unix:"):
            return await asyncio.open_unix_connection(target.removeprefix("unix:"))
        host, _, port = target.rpartition(":")
        return await asyncio.open_connection(host, int(port))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await self._open_target()
        except OSError:
            writer.transport.abort()
            return
        pair = _Pair(next(self.numbers), writer, server_writer)
        self.live[pair.number] = pair
        upstream = asyncio.create_task(self._client_to_server(pair, reader))
        downstream = asyncio.create_task(self._server_to_client(pair, server_reader))
        pair.tasks = [upstream, downstream]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pair.tasks, return_when=asyncio.FIRST_COMPLETED)
        if self.live.pop(pair.number, None) is not None:
            for side in (writer, server_writer):
                side.close()
            for task in pair.tasks:
                task.cancel()

    async def _client_to_server(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(_CHUNK):
                if (
                    self.pattern is not None
                    and self.pattern_cuts_left > 0
                    and self.pattern in chunk
                ):
                    self.pattern_cuts_left -= 1
                    if self.options.cut_when == "before":
                        self.cut(pair, f"before {self.options.cut_on}")
                        return
                    pair.answer_dropped = True
                pair.server.write(chunk)
                await pair.server.drain()

    async def _server_to_client(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(_CHUNK):
                if pair.answer_dropped:
                    self.cut(pair, f"after {self.options.cut_on}")
                    return
                pair.client.write(chunk)
                await pair.client.drain()


async def _serve(options: argparse.Namespace) -> None:
    proxy = CuttingProxy(options)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, proxy.cut_at_random)
    loop.add_signal_handler(signal.SIGUSR2, proxy.arm)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", options.port)
    sys.stdout.write(f"listening {options.port}\n")
    sys.stdout.flush()
    async with server:
        await stop.wait()
    for pair in list(proxy.live.values()):
        pair.reset()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m keel.bench._proxy")
    parser.add_argument("port", type=int, help="Port to listen on (127.0.0.1).")
    parser.add_argument("target", help="HOST:PORT or unix:PATH to relay to.")
    parser.add_argument("--seed", type=int, default=7, help="Seed of the random cuts.")
    parser.add_argument("--cut-share", type=float, default=0.5, help="Share cut per SIGUSR1.")
    parser.add_argument("--cut-on", default="", help="Cut the connection of a chunk holding it.")
    parser.add_argument("--cut-when", choices=("before", "after"), default="before")
    parser.add_argument("--cut-count", type=int, default=1, help="How many --cut-on cuts.")
    parser.add_argument(
        "--disarmed", action="store_true", help="--cut-on cuts only after a SIGUSR2."
    )
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
