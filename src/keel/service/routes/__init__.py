"""The service's routers, one per resource; :func:`~keel.service.create_app` includes them."""

from keel.service.routes import chat, memory, ops, runs, sessions, tools, turns

__all__ = ["chat", "memory", "ops", "runs", "sessions", "tools", "turns"]
