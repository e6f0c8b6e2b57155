"""JSON a model wrote almost, but not quite, right: tool arguments (and structured outputs)
repaired where that is safe, and a validation error said one line per field, the way the
model is told what to fix. Below the tools and the guards, which both read what a model
wrote: the executor and the loop detector its tool arguments, the response check its
structured output.

Only repairs that cannot change what the model meant are made: code fences stripped, a single
object pulled out of surrounding prose, trailing commas dropped, single quotes and Python
literals (``True``/``None``) read as the Python literal they are, and strings that hold a number
where the schema asks for a number. Every repair is recorded. Anything else (a cut-off object,
two objects, an array) is an error the model is asked to fix.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

__all__ = [
    "ArgumentsNotJSONError",
    "RepairedArguments",
    "coerce_scalars",
    "format_validation_error",
    "parse_arguments",
]

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_JSON_TO_PY = {"true": "True", "false": "False", "null": "None"}
_PY_TO_JSON = {"True": "true", "False": "false", "None": "null"}


class ArgumentsNotJSONError(ValueError):
    """The arguments are not a JSON object and no safe repair makes them one."""


@dataclass(frozen=True)
class RepairedArguments:
    """Arguments decoded to a dict, with the repairs it took (empty when the JSON was valid)."""

    value: dict[str, Any]
    repairs: tuple[str, ...] = ()


def parse_arguments(raw: str) -> RepairedArguments:
    """Decode ``raw`` into a JSON object, repairing it where that is safe.

    Raises:
        ArgumentsNotJSONError: with a one-line reason the model can act on.
    """
    text = raw.strip()
    if not text:
        return RepairedArguments({}, ("empty arguments read as {}",))
    repairs: list[str] = []
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
        repairs.append("removed a markdown code fence")
    value, how = _decode(text)
    if how is None and not text.startswith("{"):
        extracted = _single_object(text)
        if extracted is not None:
            value, how = _decode(extracted)
            if how is not None:
                repairs.append("took the JSON object out of the surrounding text")
    if how is None:
        raise ArgumentsNotJSONError(_reason(text))
    repairs.extend(how)
    if isinstance(value, str):
        # A JSON object encoded twice ("{\"a\": 1}") is still exactly one object.
        inner, inner_how = _decode(value.strip())
        if inner_how is not None and isinstance(inner, dict):
            value = inner
            repairs.append("decoded a JSON object that was encoded as a string")
            repairs.extend(inner_how)
    if not isinstance(value, dict):
        raise ArgumentsNotJSONError(
            f"arguments must be a JSON object with one key per parameter, "
            f"not a JSON {_json_kind(value)}"
        )
    return RepairedArguments(value, tuple(repairs))


def _decode(text: str) -> tuple[Any, list[str] | None]:
    """(value, repairs) or (None, None). Tries strict JSON first, then the safe repairs."""
    try:
        return json.loads(text), []
    except (json.JSONDecodeError, RecursionError):
        pass
    repairs: list[str] = []
    candidate = text
    without_commas = _drop_trailing_commas(candidate)
    if without_commas != candidate:
        candidate = without_commas
        repairs.append("removed trailing commas")
        try:
            return json.loads(candidate), repairs
        except (json.JSONDecodeError, RecursionError):
            pass
    pythonic = _map_bare_words(candidate, _PY_TO_JSON)
    if pythonic != candidate:
        try:
            return json.loads(pythonic), [*repairs, "read Python literals True/False/None as JSON"]
        except (json.JSONDecodeError, RecursionError):
            pass
    # Single quotes: the text is a Python literal. literal_eval evaluates literals only.
    for source, note in (
        (text, "read single-quoted (Python-style) arguments"),
        (
            _map_bare_words(text, _JSON_TO_PY),
            "read single-quoted (Python-style) arguments with JSON literals",
        ),
    ):
        try:
            value = ast.literal_eval(source)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, dict) and _jsonable(value):
            return value, [note]
    return None, None


def _characters(text: str, start: int = 0) -> Iterator[tuple[int, str, bool]]:
    """Each character of ``text`` from ``start``, and whether it belongs to a string literal
    (its quotes included), so that repairs never touch what the model wrote inside one."""
    quote: str | None = None
    escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if quote is not None:
            yield index, char, True
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
            yield index, char, True
        else:
            yield index, char, False


def _scan(text: str, visit: Callable[[int, str], str | None]) -> str:
    """Rebuild ``text``, letting ``visit`` replace characters outside string literals."""
    out: list[str] = []
    for index, char, in_string in _characters(text):
        replacement = None if in_string else visit(index, char)
        out.append(char if replacement is None else replacement)
    return "".join(out)


def _drop_trailing_commas(text: str) -> str:
    def visit(index: int, char: str) -> str | None:
        if char == ",":
            rest = text[index + 1 :].lstrip()
            if rest[:1] in ("}", "]"):
                return ""
        return None

    return _scan(text, visit)


def _map_bare_words(text: str, mapping: dict[str, str]) -> str:
    """Replace whole bare words (outside strings) according to ``mapping``."""
    skip_until = -1
    out_words: dict[int, tuple[int, str]] = {}

    def visit(index: int, char: str) -> str | None:
        nonlocal skip_until
        if index < skip_until:
            return ""
        if index in out_words:
            end, word = out_words[index]
            skip_until = end
            return word
        return None

    for match in re.finditer(r"\b(" + "|".join(mapping) + r")\b", text):
        out_words[match.start()] = (match.end(), mapping[match.group(1)])
    return _scan(text, visit)


def _single_object(text: str) -> str | None:
    """The one balanced ``{...}`` in ``text``, or None if there is none or more than one."""
    start = text.find("{")
    if start < 0:
        return None
    depth = 0
    end = -1
    for index, char, in_string in _characters(text, start):
        if in_string:
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                end = index
                break
    if end < 0 or "{" in text[end + 1 :]:
        return None
    return text[start : end + 1]


def _reason(text: str) -> str:
    opened = text.count("{") + text.count("[")
    closed = text.count("}") + text.count("]")
    if opened > closed:
        return "arguments are not valid JSON: the object is cut off (unclosed '{' or '[')"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"arguments are not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    return "arguments are not a JSON object"


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__


def _jsonable(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_jsonable(item) for item in value)
    return value is None or isinstance(value, str | int | float | bool)


def coerce_scalars(
    value: dict[str, Any], schema: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Turn strings that spell a number or boolean into one where the schema asks for it.

    Only top-level properties whose schema type is exactly ``integer``, ``number`` or
    ``boolean`` (or that type or null) are touched, and only when the string converts exactly
    (``"3"`` -> 3, never ``"3.5"`` -> 3).
    """
    properties = schema.get("properties", {})
    result = dict(value)
    repairs: list[str] = []
    for name, item in value.items():
        if not isinstance(item, str) or name not in properties:
            continue
        wanted = _scalar_type(properties[name])
        converted: Any = None
        text = item.strip()
        if wanted == "integer" and re.fullmatch(r"[-+]?\d+", text):
            converted = int(text)
        elif wanted == "number" and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
            number = float(text)
            converted = int(number) if number.is_integer() and "." not in text else number
        elif wanted == "boolean" and text.lower() in ("true", "false"):
            converted = text.lower() == "true"
        if converted is not None:
            result[name] = converted
            repairs.append(f"argument {name!r}: string {item!r} read as {wanted} {converted!r}")
    return result, tuple(repairs)


def _scalar_type(prop: Any) -> str | None:
    if not isinstance(prop, dict):
        return None
    kind = prop.get("type")
    if kind in ("integer", "number", "boolean"):
        return str(kind)
    options = [o for o in prop.get("anyOf", []) if isinstance(o, dict) and o.get("type") != "null"]
    if len(options) == 1:
        return _scalar_type(options[0])
    return None


def format_validation_error(error: ValidationError) -> list[str]:
    """One line per invalid field: ``Field 'passengers': Input should be a valid integer``."""
    lines: list[str] = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item.get("loc", ())) or "arguments"
        message = str(item.get("msg", "invalid"))
        for suffix in (
            ", unable to parse string as an integer",
            ", unable to parse string as a number",
            ", unable to interpret input",
        ):
            message = message.removesuffix(suffix)
        lines.append(f"Field '{location}': {message}")
    return lines
