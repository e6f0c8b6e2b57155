"""A stdio proxy in front of the τ² retail MCP server, where ``keel bench tau2`` puts its
faults: the agent's MCP client starts this instead of the server, and it passes every line
through, except that after the server has applied the Nth write it can

* ``--kill-after-write N``: SIGKILL the agent's process (its parent) before the answer
  reaches it: a crash inside a write whose effect is done;
* ``--delay-write N --delay-s S``: hold the answer for S seconds: a write that outlives the
  agent's timeout (the server applied it; the agent cannot tell).

Run as ``python -m keel.bench.tau2._proxy [fault] -- SERVER COMMAND...``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from keel.bench.tau2._data import WRITE_TOOLS

__all__ = ["main"]


class _Writes:
    """The ids of the write calls in flight, and how many writes were answered."""

    def __init__(self) -> None:
        self.pending: set[Any] = set()
        self.answered = 0
        self.lock = threading.Lock()

    def sent(self, line: bytes) -> None:
        message = _json(line)
        params = message.get("params") or {}
        if message.get("method") == "tools/call" and params.get("name") in WRITE_TOOLS:
            with self.lock:
                self.pending.add(message.get("id"))

    def answer(self, line: bytes) -> int | None:
        """The write's number when ``line`` answers one, else None."""
        message = _json(line)
        with self.lock:
            if "method" in message or message.get("id") not in self.pending:
                return None
            self.pending.discard(message.get("id"))
            self.answered += 1
            return self.answered


def _json(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _pump_requests(source: IO[bytes], server: subprocess.Popen[bytes], writes: _Writes) -> None:
    assert server.stdin is not None
    for line in source:
        writes.sent(line)
        server.stdin.write(line)
        server.stdin.flush()
    server.stdin.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m keel.bench.tau2._proxy")
    parser.add_argument("--kill-after-write", type=int, default=0)
    parser.add_argument("--delay-write", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [part for part in args.command if part != "--"]
    agent = os.getppid()
    server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    writes = _Writes()
    threading.Thread(
        target=_pump_requests, args=(sys.stdin.buffer, server, writes), daemon=True
    ).start()
    assert server.stdout is not None
    out = sys.stdout.buffer
    for line in server.stdout:
        number = writes.answer(line)
        if number is not None and number == args.kill_after_write:
            os.kill(agent, signal.SIGKILL)
            break
        if number is not None and number == args.delay_write:
            time.sleep(args.delay_s)
        out.write(line)
        out.flush()
    server.terminate()
    server.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
