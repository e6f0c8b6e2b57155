"""The model step's inputs for one turn: each step's prompt compiled from the session's
conversation, and its generation options sized to the room that prompt left."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from keel.context import CompiledPrompt, ContextEngine, ContextMemory, Conversation
from keel.guards import output_json_schema
from keel.messages import Message
from keel.models import ModelOptions
from keel.runtime._steps import StepRecord

__all__ = ["TurnPrompt"]


class TurnPrompt:
    """Compiles a turn's prompts and sizes its model calls.

    Args:
        engine: the context engine (budget, window, summary).
        system_prompt: identity and guardrails.
        rules: the agent's operating rules.
        output_type: the turn's answer type (its schema becomes a rule and an option).
        options: the turn's generation options (the caller's ``max_tokens`` caps the answer).
        max_output_tokens: the model's output limit.
        tools: the schemas of the turn's tools.
    """

    def __init__(
        self,
        engine: ContextEngine,
        *,
        system_prompt: str,
        rules: Sequence[str],
        output_type: type[Any] | None,
        options: ModelOptions,
        max_output_tokens: int,
        tools: list[dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.system_prompt = system_prompt
        self.rules = list(rules)
        if output_type is not None:
            schema = json.dumps(output_json_schema(output_type), ensure_ascii=False)
            self.rules.append(
                "When you give your final answer, reply with only one JSON object that follows "
                f"this JSON schema: {schema}"
            )
        self.options = options
        if output_type is not None and options.json_schema is None:
            # Providers that can enforce a schema do (structured outputs, a grammar).
            self.options = options.model_copy(
                update={"json_schema": output_json_schema(output_type)}
            )
        self.max_output_tokens = max_output_tokens
        self.tools = tools
        self.memories: list[ContextMemory] = []
        self.last: CompiledPrompt | None = None
        self.headroom = 0
        """Tokens the last prompt left free beyond the reserve (see `_headroom`)."""
        self.max_tokens = 0
        """The largest prompt compiled."""
        self._shrink_next = False

    def compile(self, conversation: Conversation, rules: Sequence[str]) -> list[Message]:
        """The next model call's prompt: ``conversation`` within the budget, the agent's rules
        and then ``rules`` (the workflow's), the memories, the tools."""
        self.headroom = self._headroom()
        prompt = self.engine.compile(
            conversation,
            system=self.system_prompt,
            rules=[*self.rules, *rules],
            memories=self.memories,
            tools=self.tools,
            extra_headroom=self.headroom,
        )
        self._shrink_next = False
        self.last = prompt
        self.max_tokens = max(self.max_tokens, prompt.tokens)
        return list(prompt.messages)

    def sized(self, options: ModelOptions) -> ModelOptions:
        """``options`` with what the next model call may generate (DESIGN.md, "The answer's
        limit"): the room its compiled prompt left in the window, at most the model's output
        limit, never less than the reserve (room no prompt takes); the caller's
        ``max_tokens``, when given, caps it."""
        budget = self.engine.budget
        prompt = self.last
        used = (prompt.tokens if prompt is not None else budget.limit) + self.headroom
        room = min(budget.effective_window - used, self.max_output_tokens)
        room = max(room, budget.reserve, 1)
        asked = self.options.max_tokens
        return options.model_copy(
            update={"max_tokens": room if asked is None else min(asked, room)}
        )

    def note(self, record: StepRecord) -> None:
        """A step ended: the provider saying the prompt was too long shrinks the next one."""
        if record.error_type == "ContextLengthExceededError":
            self._shrink_next = True

    def _headroom(self) -> int:
        """Tokens to leave free beyond the answer reserve in the next prompt: none, unless the
        provider just said the prompt was too long. Our count and theirs then disagree (a
        template or tokenizer we could only estimate): the retry gets a third less room."""
        if not self._shrink_next:
            return 0
        limit = self.engine.budget.limit
        return limit - max(1024, int(limit * 2 / 3))
