"""The service's routers, one per resource; [`create_app`][] includes them."""

from keel.service.routes import (
    approvals,
    chat,
    memory,
    models,
    ops,
    privacy,
    runs,
    sessions,
    tools,
    turns,
)

__all__ = [
    "approvals",
    "chat",
    "memory",
    "models",
    "ops",
    "privacy",
    "runs",
    "sessions",
    "tools",
    "turns",
]
