"""The context engine: prompts that always fit, stay flat over long sessions, keep what matters.

``ContextEngine`` compiles a prompt for a model within an exact token budget: the system prompt
first, retrieved memories and the running summary next, a window of recent turns (whole tool
call + result units, older tool output pruned), and the operating rules right before the newest
user message. A ``Conversation`` holds the history incrementally and folds its oldest turns into
a running summary (``ExtractiveSummarizer`` offline, or ``ModelSummarizer``), handing what it
evicts to long-term memory through a ``MemorySink``. Every compiled prompt carries a
``BudgetReport`` for the trace.

Example:

```python
engine = ContextEngine("gpt-4o", budget=ContextBudget(working_budget=16_000))
conversation = engine.conversation("session-1")
conversation.add(Message.user("Book me a flight to Lyon on Friday."))
prompt = engine.compile(conversation, system="You are a travel agent.", rules=["Be brief."])
prompt.messages, prompt.text, prompt.report.model_dump_json()
await conversation.asummarize()   # between turns, off the hot path
```
"""

from __future__ import annotations

from keel.context._budget import ContextBudget, PruningPolicy, ResolvedBudget, SummaryPolicy
from keel.context._conversation import Conversation, SummaryOutcome, Turn
from keel.context._engine import CompiledPrompt, ContextEngine, render_prompt
from keel.context._memory import ContextMemory, MemorySink
from keel.context._notes import RUNTIME_NOTE, is_runtime_note, runtime_note
from keel.context._report import (
    BudgetReport,
    DegradationStep,
    DroppedItem,
    PrunedOutput,
    SectionTokens,
)
from keel.context._summarize import (
    ExtractiveSummarizer,
    ModelSummarizer,
    Summarizer,
    SummaryRequest,
    summarizer_for,
)

__all__ = [
    "RUNTIME_NOTE",
    "BudgetReport",
    "CompiledPrompt",
    "ContextBudget",
    "ContextEngine",
    "ContextMemory",
    "Conversation",
    "DegradationStep",
    "DroppedItem",
    "ExtractiveSummarizer",
    "MemorySink",
    "ModelSummarizer",
    "PrunedOutput",
    "PruningPolicy",
    "ResolvedBudget",
    "SectionTokens",
    "Summarizer",
    "SummaryOutcome",
    "SummaryPolicy",
    "SummaryRequest",
    "Turn",
    "is_runtime_note",
    "render_prompt",
    "runtime_note",
    "summarizer_for",
]
