"""keel inside LangGraph (``keel[langgraph]``).

:class:`KeelCheckpointSaver` is a ``BaseCheckpointSaver`` on keel's state stores (SQLite,
PostgreSQL, Redis): each checkpoint stored as what changed since the one before, a stale
writer rejected, retention that keeps resume working, PII masked before it is stored.

```python
from langgraph.prebuilt import create_react_agent
from keel.integrations.langgraph import KeelCheckpointSaver

saver = KeelCheckpointSaver("sqlite:///keel.db")
agent = create_react_agent(model, tools, checkpointer=saver)
agent.invoke({"messages": [("user", "hi")]}, {"configurable": {"thread_id": "t1"}})
```
"""

from __future__ import annotations

from keel.integrations.langgraph._checkpointer import KeelCheckpointSaver, StaleWriterError

__all__ = ["KeelCheckpointSaver", "StaleWriterError"]
