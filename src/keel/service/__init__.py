"""keel as an HTTP service (``keel serve``): the agent behind FastAPI, one tenant per API key.

Serve your agent with ``keel serve --agent MODULE:ATTRIBUTE``, or inside your own FastAPI
application with [`mount`][keel.service.mount]. Needs the ``server`` extra (FastAPI, uvicorn):
``pip install "keel-runtime[server]"``.
"""

from __future__ import annotations

from keel.service._app import TurnRequest, create_app
from keel.service._drain import Drain, DrainingServer
from keel.service._keys import APIKey, APIKeys, CachedKeys
from keel.service._limits import RateLimiter
from keel.service._mount import mount
from keel.service._serve import WARM_CONNECTIONS, ServeOptions, ServiceAgents, build_service
from keel.service._source import AgentFactory

__all__ = [
    "WARM_CONNECTIONS",
    "APIKey",
    "APIKeys",
    "AgentFactory",
    "CachedKeys",
    "Drain",
    "DrainingServer",
    "RateLimiter",
    "ServeOptions",
    "ServiceAgents",
    "TurnRequest",
    "build_service",
    "create_app",
    "mount",
]
