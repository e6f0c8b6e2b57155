"""The stdio transport of keel's MCP client: the server's process, its pipes, and what it said.

The SDK's ``stdio_client`` keeps the process to itself, and hands a request to a writer task
of its own: a caller cannot tell whether its request reached the pipe, nor whether the process
is alive (only, later, that its reader saw the end of the pipe, which a helper process holding
the pipe open delays for ever). This transport is the SDK's, with three things it needs:

- the process ([`StdioProcess`][]): whether it has exited, by its exit status (read without
  reaping it, so asyncio's child watcher still gets it), and its exit code;
- its stderr, forwarded to this process's stderr as before, and its last lines kept (bounded)
  for the error or warning that says why the server is unavailable;
- a request written by the task that sends it, straight to the pipe: a write refused (the
  process exited) or failed (a broken pipe) raises [`NotSent`][] in that task, so the caller
  knows the server never got the request; [`Outgoing`][] records that a call's request was
  written.

Shutdown follows the SDK's (close stdin, wait, then stop the process group), and stops what is
left of the group once the server has exited (a helper holding its pipes).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import mcp_types
from anyio.streams.memory import MemoryObjectSendStream
from mcp.client.stdio import StdioServerParameters, get_default_environment
from mcp.shared.message import SessionMessage

from keel.errors import ToolDefinitionError

__all__ = ["NotSent", "Outgoing", "SendGate", "StdioProcess", "outgoing", "stdio_transport"]

STDERR_LINES = 10
"""How many of a server's last stderr lines are kept for the reason it is unavailable."""
STDERR_LINE_CHARS = 300
"""Longest stderr line kept (the rest is cut)."""

_EXIT_WAIT_S = 2.0
_POLL_S = 0.01
_STDERR_DRAIN_S = 0.5


class NotSent(ConnectionError):
    """The request was not written to the server's pipe (the process had exited, the pipe
    broke, or the caller gave up first): the server never got it."""


class SendGate(Protocol):
    """The caller's side of a call's sending (the executor's, for a journalled call)."""

    def may_send(self) -> bool:
        """Asked right before the request is written: False when the caller gave up (then it
        is not written); True marks it sent."""
        ...

    def not_sent(self) -> None:
        """The write failed after all: the request was not sent."""
        ...


@dataclass
class Outgoing:
    """A call's request as the transport sees it: ``written`` once its bytes are in the pipe;
    ``gate`` is asked right before the write."""

    written: bool = False
    gate: SendGate | None = None

    def may_send(self) -> bool:
        return self.gate is None or self.gate.may_send()


outgoing: contextvars.ContextVar[Outgoing | None] = contextvars.ContextVar(
    "keel_mcp_outgoing", default=None
)
"""Set by the task that makes a call: the request that task writes is the call's."""


class StdioProcess:
    """A stdio MCP server's process, seen from keel."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.pid = process.pid
        self.end_of_output = False
        self.exited_by_itself = False
        self._stderr: deque[str] = deque(maxlen=STDERR_LINES)

    def exited(self) -> bool:
        """Whether the process has exited (its pipes may still be held open by a helper)."""
        if self.process.returncode is not None:
            return True
        if not hasattr(os, "waitid"):  # pragma: no cover - every POSIX keel runs on has it
            return False
        try:
            # WNOWAIT: seen, not reaped (asyncio's child watcher reaps it and sets returncode).
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped already: its return code is on its way to the loop

    def gone(self) -> bool:
        """Whether the server can no longer answer: it exited, or closed its output."""
        return self.end_of_output or self.exited()

    @property
    def exit_code(self) -> int | None:
        """Its exit code (negative: the signal that killed it), once known, if it exited by
        itself (not as keel stopped it)."""
        return self.process.returncode if self.exited_by_itself else None

    def stderr_tail(self) -> list[str]:
        """Its last stderr lines (at most `STDERR_LINES`, each cut to `STDERR_LINE_CHARS`),
        as it wrote them: mask them before they go anywhere."""
        return list(self._stderr)

    def _heard(self, line: bytes) -> None:
        text = line[:STDERR_LINE_CHARS].decode("utf-8", "replace").rstrip()
        if text:
            self._stderr.append(text)


class _PipeWriter:
    """The session's write stream: each message written to the server's stdin by the task that
    sends it (a lock keeps lines whole)."""

    def __init__(self, server: StdioProcess, encoding: str) -> None:
        self._server = server
        self._encoding = encoding
        self._lock = anyio.Lock()
        self._closed = False

    async def send(self, item: SessionMessage, /) -> None:
        message = item.message
        call = outgoing.get() if isinstance(message, mcp_types.JSONRPCRequest) else None
        data = (message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode(
            self._encoding
        )
        stdin = self._server.process.stdin
        assert stdin is not None  # spawned with pipes
        async with self._lock:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._server.exited():
                if call is not None:
                    raise NotSent("the server's process had exited")
                raise anyio.BrokenResourceError
            if call is not None and not call.may_send():
                raise NotSent("the call was given up before it was sent")
            try:
                # The bytes are handed to the pipe whole, or the write raises: a failed write
                # never ends the line, so the server cannot have read the request.
                await stdin.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                if call is not None:
                    raise NotSent(f"writing to the server failed ({type(exc).__name__})") from exc
                raise anyio.BrokenResourceError from exc
            if call is not None:
                call.written = True

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> _PipeWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@contextlib.asynccontextmanager
async def stdio_transport(
    name: str,
    parameters: StdioServerParameters,
    on_spawn: Callable[[StdioProcess], None],
) -> AsyncIterator[tuple[Any, Any]]:
    """Start the server and yield the session's (read, write) streams; ``on_spawn`` gets its
    process first.

    Raises:
        ToolDefinitionError: the command could not be started (not found, not executable).
    """
    try:
        process = await anyio.open_process(
            [parameters.command, *parameters.args],
            env=get_default_environment() | (parameters.env or {}),
            cwd=parameters.cwd,
            start_new_session=True,  # its own process group: stopped whole
        )
    except OSError as exc:
        raise ToolDefinitionError(
            f"MCP server {name!r} could not be started ({type(exc).__name__}: {exc})"
        ) from exc
    server = StdioProcess(process)
    on_spawn(server)
    read_send, read_receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    writer = _PipeWriter(server, parameters.encoding)
    stderr_done = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_read_stdout, server, read_send)
        tasks.start_soon(_read_stderr, server, stderr_done)
        try:
            yield read_receive, writer
        finally:
            with anyio.CancelScope(shield=True):
                await writer.aclose()
                read_receive.close()
                await _stop(server)
                with anyio.move_on_after(_STDERR_DRAIN_S):
                    await stderr_done.wait()  # the last lines, for the reason it stopped
                for pipe in (process.stdout, process.stderr):
                    if pipe is not None:
                        with contextlib.suppress(Exception):
                            await pipe.aclose()
            tasks.cancel_scope.cancel()


async def _read_stdout(
    server: StdioProcess, read_send: MemoryObjectSendStream[SessionMessage | Exception]
) -> None:
    stdout = server.process.stdout
    assert stdout is not None
    buffer = b""
    ended = False
    try:
        async for chunk in stdout:
            lines = (buffer + chunk).split(b"\n")
            buffer = lines.pop()
            for line in lines:
                if line.strip():
                    await read_send.send(_parsed(line))
        ended = True
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # the session is gone, or keel's own shutdown closed the pipe
    except OSError:
        ended = True
    finally:
        # Known before the session sees the stream end (and fails a request for it).
        server.end_of_output = ended
        read_send.close()


async def _read_stderr(server: StdioProcess, done: anyio.Event) -> None:
    stderr = server.process.stderr
    assert stderr is not None
    buffer = b""
    try:
        async for chunk in stderr:
            _forward(chunk)
            lines = (buffer + chunk).split(b"\n")
            buffer = lines.pop()[: STDERR_LINE_CHARS * 4]  # an endless line stays bounded
            for line in lines:
                server._heard(line)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass
    finally:
        if buffer:
            server._heard(buffer)
        done.set()


def _forward(chunk: bytes) -> None:
    # What the server writes on stderr still reaches this process's stderr, as it did when the
    # server inherited it.
    with contextlib.suppress(Exception):
        sys.stderr.write(chunk.decode("utf-8", "replace"))
        sys.stderr.flush()


def _parsed(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc  # the session surfaces it, as the SDK's transport does


async def _stop(server: StdioProcess) -> None:
    """Close its stdin, give it time to exit, then stop its process group (SIGTERM, then
    SIGKILL); once it has exited, what is left of its group (a helper holding its pipes)."""
    # Its output ended or it exited before keel stopped it: its exit code is its own (the
    # output ends as the process exits, a moment before its exit status is there).
    server.exited_by_itself = server.gone()
    stdin = server.process.stdin
    if stdin is not None:
        with contextlib.suppress(Exception):
            await stdin.aclose()
    for signal_number in (None, signal.SIGTERM, signal.SIGKILL):
        if signal_number is not None:
            _signal_group(server.pid, signal_number)
        if await _exited_within(server, _EXIT_WAIT_S):
            break
    _signal_group(server.pid, signal.SIGKILL)


async def _exited_within(server: StdioProcess, seconds: float) -> bool:
    # By the return code the child watcher sets (not process.wait(), which on asyncio also
    # waits for the pipes to close: a helper holding them would make it hang).
    with anyio.move_on_after(seconds):
        while server.process.returncode is None:
            await asyncio.sleep(_POLL_S)
        return True
    return False


def _signal_group(pid: int, signal_number: int) -> None:
    # The group's id is the server's pid (start_new_session); the kernel never reuses a pid
    # while a group of that id has members, so this reaches only the server's own processes.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal_number)
