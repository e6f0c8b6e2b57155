"""The service's HTTP connections: uvicorn's h11 protocol with a deadline for a request's
headers, and the uvicorn ``Config`` every ``keel serve`` process (and worker) runs with.

uvicorn bounds the idle time between two requests of a connection (``timeout_keep_alive``) but
not the time a request's headers take: a client that opens a connection and sends a header
line now and then holds a socket and its buffers for as long as it likes. Here a request's
headers must be in within ``header_timeout_s`` of the connection opening, or of the request's
first byte on a kept-alive connection; otherwise the connection is closed. (A body's deadline
is the gate's: it answers 408.)
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from keel.service._logging import LogFormat, logging_config

__all__ = ["HeaderDeadlineProtocol", "ServiceConfig"]


class ServiceConfig(uvicorn.Config):
    """uvicorn's ``Config`` with keel's transport: headers within ``header_timeout_s``
    (`HeaderDeadlineProtocol`), keel's logging (``log_format``: text or JSON lines)
    and keel's access line instead of uvicorn's; a [`DrainingServer`][]
    waits ``drain_timeout_s`` at most for the turns in flight."""

    def __init__(
        self,
        app: Any,
        *,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        drain_timeout_s: float = 60.0,
        log_format: LogFormat = "text",
        **options: Any,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.drain_timeout_s = drain_timeout_s
        options.setdefault("log_level", "warning")
        # Once drained, what is left is a request whose body is still coming in: the gate
        # answers it 408 within the body's deadline.
        options.setdefault("timeout_graceful_shutdown", math.ceil(body_timeout_s) + 1)
        super().__init__(
            app,
            http=HeaderDeadlineProtocol,
            access_log=False,
            log_config=logging_config(log_format),
            **options,
        )


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not in within
    the config's ``header_timeout_s``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout_s = float(getattr(config, "header_timeout_s", 10.0))
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            # Part of a request's headers (or of the next one's, on a kept-alive connection).
            if self._header_deadline is None:
                self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers were late")
            self.transport.close()
