"""keel's context engine as a pydantic-ai history processor: the history each model request
sees fits an exact token budget with the answer's reserve kept free, older turns are folded
into a running summary, old tool output is pruned, and a tool call is never separated from
its return (pydantic-ai conversations break for good on an orphan; pydantic-ai#4728).

    from keel.integrations.pydantic_ai import KeelHistory
    history = KeelHistory("gpt-4o", budget=ContextBudget(working_budget=16_000))
    agent = Agent(model, capabilities=[history.capability()])

pydantic-ai keeps what a processor returns as the run's history, so the summary travels in it
(one system part, marked) and the next request's processing starts from there: the processor
holds no state of its own and any number of runs can share it.

Everything a request sends counts against the budget: the history's system parts, the agent's
``instructions`` (static and dynamic, as the request will state them, with a
``PromptedOutput``'s schema) and the tool definitions.
The capability reads the last two from the request it is about to make; the object used as a
bare history processor sees only the history (pydantic-ai gives a processor nothing else).

[`KeelMessageStore`][] keeps a conversation's message history between runs (pydantic-ai
leaves storing it to you) on keel's state store, PII masked before it is stored. With a PII
vault, each value is stored sealed in the vault and the history holds the user's stable
placeholder for it; ``load`` gives the user's values back, so the next run sees the history as
it was when it was saved, and nothing raw is stored:

```python
store = KeelMessageStore("conv-1", database="sqlite:///chat.db", user_id="u-42", vault=vault)
result = await agent.run("Send my receipt", message_history=await store.load())
await store.save(result.all_messages())
```
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

try:
    from pydantic_ai._output import StructuredTextOutputSchema
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequest,
        ModelRequestPart,
        ModelResponse,
        RetryPromptPart,
        SystemPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import ModelRequestContext, ModelRequestParameters
    from pydantic_ai.tools import RunContext, ToolDefinition
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    from keel.errors import BackendUnavailableError

    raise BackendUnavailableError("pydantic-ai is not installed (the 'pydantic-ai' extra)") from exc

from pydantic import BaseModel, Field

from keel._bridge import run_blocking
from keel.context import ContextBudget, ContextEngine, PruningPolicy, SummaryPolicy
from keel.integrations._privacy import PrivateHistory, map_texts
from keel.messages import Message, ToolCall
from keel.privacy import PIIMasker, PrivacyView, Vault
from keel.state import StateStore

__all__ = ["SUMMARY_MARK", "KeelHistory", "KeelMessageStore", "StoredMessages"]

SUMMARY_MARK = "[keel summary of the earlier conversation]\n"
"""How the summary's system part starts (how the processor finds it again next time)."""

_ORIGIN = "pydantic_ai"  # metadata key: (message index, part index or -1 for a response)

_TEXTS = frozenset({"content", "args", "instructions", "metadata"})
"""Where a stored message's text is (what a user, a model or a tool wrote), at any depth."""
_KEPT = frozenset(
    {"kind", "part_kind", "media_type", "data", "identifier", "tool_call_id", "tool_name"}
)
"""Identifiers and encodings below those, never masked (binary data stays as it is)."""
_RETURNED_BY_TOOLS = frozenset({"tool-return", "builtin-tool-return", "retry-prompt"})
"""The parts whose text a tool wrote (a retry prompt is a tool's ``ModelRetry`` or its
arguments' validation errors)."""


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(
            item if isinstance(item, str) else f"[{type(item).__name__}]" for item in content
        )
    return str(content)


class KeelHistory:
    """keel's context engine as a pydantic-ai history processor: pass
    ``capabilities=[history.capability()]`` to an ``Agent`` (or the object itself wherever
    pydantic-ai takes a history processor function).

    Args:
        model: the model whose tokenizer and window count (a spec such as ``"gpt-4o"``).
        budget: how the window is shared (default: the whole window, 12% answer reserve).
        pruning: how older tool output is cut.
        summary: when the oldest turns are folded into the running summary.
    """

    def __init__(
        self,
        model: str = "gpt-4o",
        *,
        budget: ContextBudget | None = None,
        pruning: PruningPolicy | None = None,
        summary: SummaryPolicy | None = None,
    ) -> None:
        self.engine = ContextEngine(model, budget=budget, pruning=pruning, summary=summary)

    def capability(self) -> AbstractCapability[Any]:
        """This processor as a pydantic-ai capability: each request's history fitted with
        the request's instructions and tool definitions counted."""
        return _FitsRequests(self)

    async def __call__(self, messages: list[ModelMessage]) -> list[ModelMessage]:
        return await self.fit(messages)

    async def fit(
        self,
        messages: list[ModelMessage],
        *,
        instructions: str = "",
        tools: Sequence[dict[str, Any]] = (),
    ) -> list[ModelMessage]:
        """``messages`` as the next request should send them, counted with the
        ``instructions`` and the ``tools`` (OpenAI format) the request states besides."""
        system, summary, history = _to_keel(messages)
        if not history:
            return messages
        conversation = self.engine.conversation(messages=history, summary=summary)
        if conversation.needs_summary:
            await conversation.asummarize()
        # Counted as one system block with the history's system parts (pydantic-ai sends
        # them itself: the compiled system message is only counted, never sent).
        counted = "\n\n".join(text for text in (system, instructions) if text)
        compiled = self.engine.compile(conversation, system=counted, tools=tools)
        return _to_pydantic_ai(messages, compiled.messages, conversation.summary)


@dataclass
class _FitsRequests(AbstractCapability[Any]):
    """pydantic-ai's ``ProcessHistory`` for a [`KeelHistory`][], with what the request
    sends besides its history counted."""

    history: KeelHistory

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        parameters = request_context.model_request_parameters
        instructions = [
            _instructions(parameters),
            _output_instructions(parameters, request_context.model.profile),
        ]
        messages = await self.history.fit(
            list(request_context.messages),
            instructions="\n\n".join(text for text in instructions if text),
            tools=_tool_schemas(parameters),
        )
        # As ProcessHistory: this request sends the fitted history, and the run keeps it.
        request_context.messages = messages.copy()
        ctx.messages[:] = messages
        return request_context

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds a KeelHistory: not part of an agent spec


def _instructions(parameters: ModelRequestParameters) -> str:
    """The instruction text the request states before its history: the agent's static and
    dynamic parts (a part pydantic-ai sends in the history instead is counted there)."""
    parts = parameters.instruction_parts or []
    # pydantic-ai 2.60 has no instruction visibility: every part is in the prefix.
    visibility = getattr(parameters, "instruction_visibility_of", None)
    return "\n\n".join(
        part.content
        for part in parts
        if part.content and (visibility is None or visibility(part) == "prefix")
    )


def _output_instructions(parameters: ModelRequestParameters, profile: Any) -> str:
    """What a ``PromptedOutput`` adds to the instructions: the output schema in the model's
    template (pydantic-ai renders it after the hooks have run, so it is rendered here)."""
    if parameters.output_mode != "prompted" or parameters.output_object is None:
        return ""
    if parameters.prompted_output_instructions:
        return parameters.prompted_output_instructions
    template = parameters.prompted_output_template or (
        profile.get("prompted_output_template")
        if isinstance(profile, dict)
        else getattr(profile, "prompted_output_template", None)
    )
    if not isinstance(template, str):
        return ""
    return StructuredTextOutputSchema.build_instructions(template, parameters.output_object)


def _tool_schemas(parameters: ModelRequestParameters) -> list[dict[str, Any]]:
    """The request's function and output tools as the OpenAI format states them."""
    definitions: list[ToolDefinition] = [*parameters.function_tools, *parameters.output_tools]
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.parameters_json_schema,
            },
        }
        for tool in definitions
    ]


def _to_keel(messages: Sequence[ModelMessage]) -> tuple[str, str, list[Message]]:
    """The system text, the summary carried in the history, and the rest as keel messages,
    each tagged with where it came from."""
    system: list[str] = []
    summary = ""
    history: list[Message] = []
    for index, message in enumerate(messages):
        if isinstance(message, ModelResponse):
            text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
            calls = [
                ToolCall(id=p.tool_call_id, name=p.tool_name, arguments=p.args_as_json_str())
                for p in message.parts
                if isinstance(p, ToolCallPart)
            ]
            history.append(
                Message.assistant(text, tool_calls=calls, metadata={_ORIGIN: (index, -1)})
            )
            continue
        for position, part in enumerate(message.parts):
            origin = {_ORIGIN: (index, position)}
            if isinstance(part, SystemPromptPart):
                if part.content.startswith(SUMMARY_MARK):
                    summary = part.content[len(SUMMARY_MARK) :]
                else:
                    system.append(part.content)
            elif isinstance(part, UserPromptPart):
                history.append(Message.user(_text_of(part.content), metadata=origin))
            elif isinstance(part, ToolReturnPart):
                history.append(
                    Message.tool(
                        part.tool_call_id,
                        part.model_response_str(),
                        name=part.tool_name,
                        metadata=origin,
                    )
                )
            elif isinstance(part, RetryPromptPart):
                content = part.model_response()
                if part.tool_name is not None:
                    tool = Message.tool(
                        part.tool_call_id, content, name=part.tool_name, metadata=origin
                    )
                    history.append(tool)
                else:
                    history.append(Message.user(content, metadata=origin))
    return "\n\n".join(system), summary, history


def _to_pydantic_ai(
    original: Sequence[ModelMessage], compiled: Sequence[Message], summary: str
) -> list[ModelMessage]:
    """The original messages and parts the compiled prompt kept, in order; a pruned tool
    return carries the pruned text; the system parts stay first, the summary after them."""
    kept_parts: dict[int, dict[int, Message]] = {}
    for sent in compiled:
        origin = sent.metadata.get(_ORIGIN)
        if origin is not None:
            kept_parts.setdefault(origin[0], {})[origin[1]] = sent
    rebuilt: list[ModelMessage] = []
    for index, message in enumerate(original):
        kept = kept_parts.get(index)
        if isinstance(message, ModelResponse):
            if kept is not None:
                rebuilt.append(message)
            continue
        parts: list[ModelRequestPart] = []
        for position, part in enumerate(message.parts):
            if isinstance(part, SystemPromptPart):
                if not part.content.startswith(SUMMARY_MARK):
                    parts.append(part)
                continue
            compiled_part = None if kept is None else kept.get(position)
            if compiled_part is None:
                continue
            if type(part) is ToolReturnPart and compiled_part.metadata.get("keel_cut"):
                # The model sees the pruned text; special returns (tool search) stay whole.
                plain: Any = part
                parts.append(replace(plain, content=compiled_part.content))
            else:
                parts.append(part)
        if parts:
            rebuilt.append(replace(message, parts=parts))
    if summary.strip():
        block = SystemPromptPart(content=SUMMARY_MARK + summary)
        first = rebuilt[0] if rebuilt else None
        if isinstance(first, ModelRequest):
            systems = [p for p in first.parts if isinstance(p, SystemPromptPart)]
            others = [p for p in first.parts if not isinstance(p, SystemPromptPart)]
            rebuilt[0] = replace(first, parts=[*systems, block, *others])
        else:
            rebuilt.insert(0, ModelRequest(parts=[block]))
    return rebuilt


class StoredMessages(BaseModel):
    """What a [`KeelMessageStore`][] stores for a conversation: each message as masked
    JSON (an unchanged message is the same text again, so a save stores what changed)."""

    messages: list[str] = Field(default_factory=list)
    owner: str = ""
    """The user whose vault numbered the placeholders in ``messages`` ("": stored without
    one)."""


class KeelMessageStore(PrivateHistory[StoredMessages]):
    """A pydantic-ai conversation's message history on keel's state store (SQLite,
    PostgreSQL or Redis): ``load`` before a run, ``save`` its ``all_messages()`` after.

    Args:
        conversation_id: the conversation's id.
        database: where state lives (``sqlite:///PATH``, ``postgresql://...``,
            ``redis://...``); or pass ``state``.
        state: a state store of [`StoredMessages`][] (several conversations can share one).
        masker: masks PII before anything is stored (None: keel's default policy).
        tenant: whose policy masks, and whose vault holds the values.
        user_id: whose values the conversation holds (None: the conversation id names the
            user).
        vault: the PII vault: values are stored there sealed, the history holds the user's
            stable placeholders, and ``load`` gives the user their values back. Not given, and
            ``database`` a SQL URL: the vault ``Backends.open`` opens on that database
            (``KEEL_PII_KEY`` / ``KEEL_PII_KEY_FILE``; neither set, on SQLite keel's own key
            file in the config directory). Without a vault (``KEEL_PII_VAULT=off``, a
            PostgreSQL database given no key, Redis), ``load`` gives placeholders.

    Each ``save`` is compare-and-set on the version the last ``load`` read: a save over a
    history someone else saved since raises ``ConflictError`` and stores nothing.

    Raises:
        VaultKeyError: the PII key is malformed or not the vault's, or a PostgreSQL database
            holds a vault and no key is given.
    """

    def __init__(
        self,
        conversation_id: str,
        *,
        database: str | None = None,
        state: StateStore[StoredMessages] | None = None,
        masker: PIIMasker | None = None,
        tenant: str = "default",
        user_id: str | None = None,
        vault: Vault | None = None,
    ) -> None:
        super().__init__(
            StoredMessages,
            conversation_id,
            database=database,
            state=state,
            masker=masker,
            tenant=tenant,
            user_id=user_id,
            vault=vault,
        )
        self.conversation_id = conversation_id
        self._version: int | None = None
        """The version the last ``load`` read (None: the conversation was not stored)."""
        self._owner: str | None = None
        """Whose values the history ``load`` read holds (None: not stored)."""

    async def load(self) -> list[ModelMessage]:
        """The stored history, the user's values in it (empty for a new conversation)."""
        found = await self.state.aget(self.conversation_id)
        self._version = None if found is None else found.version
        self._owner = None if found is None else found.state.owner
        if found is None:
            return []
        return await run_blocking(self._decoded, found.state)

    def _decoded(self, stored: StoredMessages) -> list[ModelMessage]:
        view = self._reading_view(stored.owner)
        dumped = [json.loads(text) for text in stored.messages]
        if view.reveals:
            dumped = [map_texts(m, view.reveal, texts=_TEXTS, kept=_KEPT) for m in dumped]
        return ModelMessagesTypeAdapter.validate_python(dumped)

    async def stored(self) -> list[dict[str, Any]]:
        """The history as stored (masked: placeholders, never values), as JSON objects."""
        found = await self.state.aget(self.conversation_id)
        return [] if found is None else [json.loads(text) for text in found.state.messages]

    async def save(self, messages: Sequence[ModelMessage]) -> None:
        """Store ``messages`` (masked) as the conversation's history, in one compare-and-set
        write on the version ``load`` read.

        Raises:
            ConflictError: the history was saved by someone else since (or never loaded
                while it exists).
        """
        texts = await run_blocking(self._encoded, list(messages))
        if self._version is None:
            fresh = StoredMessages(messages=texts, owner=self.new_owner)
            created = await self.state.acreate(self.conversation_id, fresh)
            self._version, self._owner = created.version, fresh.owner
            return
        updated = await self.state.aupdate(
            self.conversation_id, {"messages": texts}, expected_version=self._version
        )
        self._version = updated.version

    def _encoded(self, messages: list[ModelMessage]) -> list[str]:
        view = self._writing_view(self._owner)
        dumped = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
        return [json.dumps(_masked_message(m, view), ensure_ascii=False) for m in dumped]

    async def clear(self) -> None:
        """Forget the conversation."""
        await self.state.adelete(self.conversation_id)
        self._version = self._owner = None


def _masked_message(message: dict[str, Any], view: PrivacyView) -> dict[str, Any]:
    """A dumped message as stored: masked, and what a tool returned in its parts defanged
    first ([`mask_tool_output`][keel.privacy.PrivacyView.mask_tool_output])."""

    def masked_part(part: Any) -> Any:
        returned = isinstance(part, dict) and part.get("part_kind") in _RETURNED_BY_TOOLS
        mask = view.mask_tool_output if returned else view.mask
        return map_texts(part, mask, texts=_TEXTS, kept=_KEPT)

    return {
        name: (
            [masked_part(part) for part in value]
            if name == "parts" and isinstance(value, list)
            else map_texts({name: value}, view.mask, texts=_TEXTS, kept=_KEPT)[name]
        )
        for name, value in message.items()
    }
