"""An optional model judge: which candidates are relevant, decided in ONE batched call."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from keel.errors import MalformedResponseError
from keel.messages import Message
from keel.models import ChatModel, ModelOptions

__all__ = ["ModelJudge"]

_PROMPT = (
    "You filter memories for an assistant. Given a query and numbered memories, answer with a "
    'JSON object {"relevant": [numbers]} listing the memories that help answer the query. '
    "List none if none help. Answer with the JSON object only."
)


class ModelJudge:
    """Asks a chat model once per retrieval which of the candidates are relevant.

    One call covers every candidate (never one call per candidate). An unusable answer keeps
    all candidates: a broken judge must not erase memory.

    Args:
        model: a capable chat model.
        max_chars: characters of each candidate shown to the judge.
    """

    def __init__(self, model: ChatModel, *, max_chars: int = 400) -> None:
        self.model = model
        self.max_chars = max_chars

    def _messages(self, query: str, texts: Sequence[str]) -> list[Message]:
        lines = [f"Query: {query}", "", "Memories:"]
        lines.extend(f"{i + 1}. {text[: self.max_chars]}" for i, text in enumerate(texts))
        return [Message.system(_PROMPT), Message.user("\n".join(lines))]

    async def ajudge(self, query: str, texts: Sequence[str]) -> list[int]:
        """Indexes (0-based) of the relevant texts, in the given order."""
        if not texts:
            return []
        completion = await self.model.acomplete(
            self._messages(query, texts), options=ModelOptions(json_mode=True, temperature=0.0)
        )
        try:
            return _parse(completion.message.content, len(texts))
        except MalformedResponseError:
            return list(range(len(texts)))


def _parse(content: str, count: int) -> list[int]:
    match = re.search(r"\{.*\}|\[.*\]", content, re.DOTALL)
    if match is None:
        raise MalformedResponseError("judge answer holds no JSON", raw=content)
    try:
        value = json.loads(match.group(0))
    except json.JSONDecodeError as exc:
        raise MalformedResponseError("judge answer is not valid JSON", raw=content) from exc
    numbers = value.get("relevant") if isinstance(value, dict) else value
    if not isinstance(numbers, list):
        raise MalformedResponseError("judge answer has no 'relevant' list", raw=content)
    chosen = sorted({int(n) - 1 for n in numbers if isinstance(n, int | float) and 1 <= n <= count})
    return chosen
