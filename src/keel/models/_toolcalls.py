"""Tool calls for models without native tool calling: a prompt format and a tolerant parser.

The format is the ``<tool_call>`` block that SmolLM2 and the Hermes/Qwen family were trained
on: the tools are described in the system prompt and the model is asked to answer with

```
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
```

Small models drift from any format, so [`parse_tool_calls`][] also reads what they actually
write: code fences, bare JSON objects, lists of calls, ``{"tool": ..., "args": ...}``, single
quotes, trailing commas, Python literals, prose around the call, ``name(key="value")``. What it
cannot read becomes a [`ToolCallParseError`][] in the result, never an exception, so the
runtime can send the model feedback and let it try again.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from keel.messages import ToolCall
from keel.models._lenient_json import LenientJSONError, find_json_end, loads

__all__ = [
    "ParsedToolCalls",
    "ToolCallParseError",
    "parse_tool_calls",
    "render_tool_call",
    "render_tools_prompt",
]

_NAME_KEYS = ("name", "tool", "tool_name", "function", "function_name", "action")
_ARGUMENT_KEYS = ("arguments", "args", "parameters", "params", "input", "action_input")
_TAG_BLOCK = re.compile(
    r"<\s*(tool_call|toolcall|function_call|tool)\s*>(.*?)(?:<\s*/\s*\1\s*>|$)",
    re.DOTALL | re.IGNORECASE,
)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_PY_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.]*)\s*\(")


class ToolCallParseError(BaseModel):
    """A piece of the reply that looks like a tool call but cannot be used as one."""

    model_config = ConfigDict(frozen=True)

    reason: str = Field(description="Why it could not be used, in words a model understands.")
    snippet: str = Field(description="The text in question (cut to 200 characters).")
    tool: str | None = Field(default=None, description="The tool it names, when one was read.")
    truncated: bool = Field(
        default=False, description="The call ends before its JSON closes (the reply was cut)."
    )

    def feedback(self) -> str:
        """A message to send back to the model so it can correct its call."""
        return (
            f"Your tool call could not be used: {self.reason}. Reply with exactly one block "
            '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call> '
            "using a tool from the list, with valid JSON arguments."
        )


class ParsedToolCalls(BaseModel):
    """What [`parse_tool_calls`][] read from a reply."""

    model_config = ConfigDict(frozen=True)

    calls: tuple[ToolCall, ...] = Field(default=(), description="The usable tool calls, in order.")
    errors: tuple[ToolCallParseError, ...] = Field(
        default=(), description="Call attempts that could not be used."
    )
    text: str = Field(default="", description="The reply with the tool-call parts removed.")

    @property
    def ok(self) -> bool:
        """True when nothing that looked like a call was left unusable."""
        return not self.errors


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else tool


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(_function(tool).get("name", "")) for tool in tools if _function(tool).get("name")]


def _type_text(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        return f"array of {_type_text(schema['items'])}"
    if isinstance(kind, list):
        return " | ".join(str(part) for part in kind)
    return str(kind)


def render_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """System-prompt text that describes ``tools`` (OpenAI format) and how to call them."""
    lines = ["You can call these tools:"]
    for tool in tools:
        function = _function(tool)
        parameters = function.get("parameters") or {}
        properties: Mapping[str, Any] = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        signature = ", ".join(
            f"{name}{'' if name in required else '?'}: "
            f"{_type_text(schema) if isinstance(schema, Mapping) else 'any'}"
            for name, schema in properties.items()
        )
        description = function.get("description") or ""
        lines.append(
            f"- {function['name']}({signature})" + (f": {description}" if description else "")
        )
        for name, schema in properties.items():
            if isinstance(schema, Mapping) and schema.get("description"):
                lines.append(f"    {name}: {schema['description']}")
    example_tool = _function(tools[0])
    example_properties = (example_tool.get("parameters") or {}).get("properties") or {}
    example_args = dict.fromkeys(list(example_properties)[:2], "...")
    example = json.dumps({"name": example_tool["name"], "arguments": example_args})
    lines += [
        "",
        "To call a tool, answer with only a tool call block, like this:",
        f"<tool_call>\n{example}\n</tool_call>",
        "Use double quotes and valid JSON. If no tool is needed, answer in plain text.",
    ]
    return "\n".join(lines)


def render_tool_call(call: ToolCall) -> str:
    """One call as the model is asked to write it (for assistant turns in the history)."""
    try:
        arguments: Any = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= 200 else text[:197] + "..."


class _Reading:
    """Accumulates calls and errors while the parser walks the reply."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallParseError] = []

    def error(
        self, reason: str, snippet: str, *, tool: str | None = None, cut: bool = False
    ) -> None:
        self.errors.append(
            ToolCallParseError(reason=reason, snippet=_snippet(snippet), tool=tool, truncated=cut)
        )

    def unknown(self, name: str, snippet: str) -> None:
        close = difflib.get_close_matches(name, self.names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        known = ", ".join(self.names) or "none"
        self.error(f"there is no tool named {name!r}{hint} (tools: {known})", snippet, tool=name)

    def add_value(self, value: Any, snippet: str, *, explicit: bool) -> bool:
        """Read calls from a decoded value. Returns whether it was taken as a call attempt."""
        if isinstance(value, list):
            if not value or not all(isinstance(item, Mapping) for item in value):
                if explicit:
                    self.error("a tool call must be a JSON object with name and arguments", snippet)
                return explicit
            taken = [self.add_value(item, snippet, explicit=explicit) for item in value]
            return any(taken)
        if not isinstance(value, Mapping):
            if explicit:
                self.error("a tool call must be a JSON object with name and arguments", snippet)
            return explicit
        name, arguments = self._name_and_arguments(value)
        if name is None:
            if explicit:
                self.error('the tool call has no "name"', snippet)
            return explicit
        if name not in self.names:
            self.unknown(name, snippet)
            return True
        if isinstance(arguments, str):
            try:
                arguments = loads(arguments) if arguments.strip() else {}
            except LenientJSONError as exc:
                self.error(
                    f"the arguments of {name!r} are not valid JSON ({exc})",
                    snippet,
                    tool=name,
                    cut=exc.unclosed,
                )
                return True
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            self.error(f"the arguments of {name!r} must be a JSON object", snippet, tool=name)
            return True
        self.calls.append(
            ToolCall(
                id=_new_id(), name=name, arguments=json.dumps(dict(arguments), ensure_ascii=False)
            )
        )
        return True

    def _name_and_arguments(self, value: Mapping[str, Any]) -> tuple[str | None, Any]:
        for key in _NAME_KEYS:
            candidate = value.get(key)
            if isinstance(candidate, Mapping) and isinstance(candidate.get("name"), str):
                # OpenAI's own shape: {"type": "function", "function": {"name", "arguments"}}
                return self._name_and_arguments(candidate)
            if isinstance(candidate, str) and candidate.strip():
                for arg_key in _ARGUMENT_KEYS:
                    if arg_key in value:
                        return candidate.strip(), value[arg_key]
                # Flat form: {"name": "get_weather", "city": "Paris"}.
                rest = {k: v for k, v in value.items() if k not in (key, "type", "id")}
                return candidate.strip(), rest
        if len(value) == 1:
            # Keyed by the tool: {"get_weather": {"city": "Paris"}}.
            ((only_key, only_value),) = value.items()
            if only_key in self.names and isinstance(only_value, Mapping | type(None)):
                return only_key, only_value
        return None, None


def _decode(text: str) -> tuple[Any, LenientJSONError | None]:
    try:
        return loads(text), None
    except LenientJSONError as exc:
        return None, exc


def _read_json_span(reading: _Reading, body: str, *, explicit: bool) -> list[tuple[int, int]]:
    """Read every JSON object or list in ``body``; return the spans taken as call attempts."""
    spans: list[tuple[int, int]] = []
    index = 0
    while index < len(body):
        start = min(
            (pos for pos in (body.find("{", index), body.find("[", index)) if pos >= 0),
            default=-1,
        )
        if start < 0:
            break
        end = find_json_end(body, start)
        if end is None:
            piece = body[start:]
            looks_like_call = explicit or any(
                f'"{key}"' in piece or f"'{key}'" in piece for key in _NAME_KEYS
            )
            if looks_like_call and body[start] == "{":
                value, error = _decode(piece)
                if error is not None:
                    reading.error(
                        f"the tool call is not valid JSON ({error})", piece, cut=error.unclosed
                    )
                    spans.append((start, len(body)))
                else:
                    reading.add_value(value, piece, explicit=explicit)
                    spans.append((start, len(body)))
                break
            index = start + 1
            continue
        piece = body[start:end]
        value, error = _decode(piece)
        if error is not None:
            mentions_call = explicit or any(
                f'"{key}"' in piece or f"'{key}'" in piece for key in _NAME_KEYS
            )
            if mentions_call:
                reading.error(f"the tool call is not valid JSON ({error})", piece)
                spans.append((start, end))
            index = end
            continue
        if reading.add_value(value, piece, explicit=explicit):
            spans.append((start, end))
        index = end
    return spans


def _python_call(reading: _Reading, text: str) -> list[tuple[int, int]]:
    """``get_weather(city="Paris")`` for a known tool name, read with Python's own parser."""
    spans: list[tuple[int, int]] = []
    for match in _PY_CALL.finditer(text):
        name = match.group(1)
        if name not in reading.names:
            continue
        depth = 0
        end = None
        for index in range(match.end() - 1, len(text)):
            if text[index] == "(":
                depth += 1
            elif text[index] == ")":
                depth -= 1
                if depth == 0:
                    end = index + 1
                    break
        if end is None:
            continue
        source = text[match.start() : end]
        try:
            node = ast.parse(source, mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                continue
            arguments = {
                keyword.arg: ast.literal_eval(keyword.value)
                for keyword in node.keywords
                if keyword.arg is not None
            }
        except (SyntaxError, ValueError):
            continue
        reading.calls.append(
            ToolCall(id=_new_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))
        )
        spans.append((match.start(), end))
    return spans


def _remove(text: str, spans: list[tuple[int, int]]) -> str:
    kept: list[str] = []
    position = 0
    for start, end in sorted(spans):
        kept.append(text[position:start])
        position = max(position, end)
    kept.append(text[position:])
    return re.sub(r"\n{3,}", "\n\n", "".join(kept)).strip()


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedToolCalls:
    """Read the tool calls in a model's reply; never raises on what the model wrote.

    Args:
        text: the reply as generated.
        tools: the tools offered, in OpenAI's ``tools`` format; calls to other names are errors.

    Returns:
        The usable calls (arguments re-serialized as strict JSON), the attempts that could not
        be used (each with a reason the model can act on) and the remaining prose.
    """
    reading = _Reading(_tool_names(tools))
    spans: list[tuple[int, int]] = []
    tagged = list(_TAG_BLOCK.finditer(text))
    if tagged:
        for match in tagged:
            body = match.group(2)
            fence = _FENCE.search(body)
            inner = fence.group(2) if fence else body
            before = len(reading.calls) + len(reading.errors)
            _read_json_span(reading, inner, explicit=True)
            nothing_read = len(reading.calls) + len(reading.errors) == before
            if nothing_read and not _python_call(reading, inner):
                reading.error("the tool call block holds no JSON object", match.group(0))
            spans.append(match.span())
        return _result(reading, text, spans)
    for fence in _FENCE.finditer(text):
        inner_spans = _read_json_span(reading, fence.group(2), explicit=False)
        if inner_spans:
            spans.append(fence.span())
    if not spans:
        spans = _read_json_span(reading, text, explicit=False)
    if not spans and not reading.calls:
        spans = _python_call(reading, text)
    return _result(reading, text, spans)


def _result(reading: _Reading, text: str, spans: list[tuple[int, int]]) -> ParsedToolCalls:
    return ParsedToolCalls(
        calls=tuple(reading.calls), errors=tuple(reading.errors), text=_remove(text, spans)
    )
