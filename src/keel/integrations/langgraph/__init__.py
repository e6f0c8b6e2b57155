"""keel inside LangGraph (``keel-runtime[langgraph]``).

[`KeelCheckpointSaver`][] is a ``BaseCheckpointSaver`` on keel's state stores (SQLite,
PostgreSQL, Redis): each checkpoint stored as what changed since the one before, a stale
writer rejected, retention that keeps resume working, PII masked before it is stored (with a
PII vault, the user's stable placeholders stored and the user's values given back on reads).
[`KeelStore`][] is a ``BaseStore`` on keel memory: namespaces matched label by label,
hybrid keyword + vector search behind ``search(query=...)``, TTL, PII masked, every item
scoped to one tenant and user.

```python
from langgraph.prebuilt import create_react_agent
from keel.integrations.langgraph import KeelCheckpointSaver, KeelStore
from keel.settings import load_settings
from keel.stores import Backends

saver = KeelCheckpointSaver("sqlite:///keel.db")
backends = Backends.open(load_settings())  # keel's stores; close it when done
store = KeelStore(backends.memory, tenant="acme")
agent = create_react_agent(model, tools, checkpointer=saver, store=store)
agent.invoke({"messages": [("user", "hi")]}, {"configurable": {"thread_id": "t1"}})
```
"""

from __future__ import annotations

from keel.integrations.langgraph._checkpointer import (
    KeelCheckpointSaver,
    StaleWriterError,
    ThreadState,
)
from keel.integrations.langgraph._store import KeelStore

__all__ = ["KeelCheckpointSaver", "KeelStore", "StaleWriterError", "ThreadState"]
