"""Argument repair: only what cannot change the meaning, always recorded."""

from __future__ import annotations

import pytest

from keel.tools import ArgumentsNotJSONError, coerce_scalars, parse_arguments


@pytest.mark.parametrize(
    ("raw", "expected", "repair"),
    [
        ('```json\n{"a": 1}\n```', {"a": 1}, "code fence"),
        ('```\n{"a": 1}\n```', {"a": 1}, "code fence"),
        ("{'a': 'it''s'}", {"a": "its"}, "single-quoted"),
        ("{'a': 1, 'b': [1, 2,],}", {"a": 1, "b": [1, 2]}, "single-quoted"),
        ('{"a": 1, "b": [1, 2,],}', {"a": 1, "b": [1, 2]}, "trailing commas"),
        ('{"a": True, "b": None}', {"a": True, "b": None}, "Python literals"),
        ("{'a': true, 'b': null}", {"a": True, "b": None}, "JSON literals"),
        ('Sure, here you go: {"a": 1}. Done.', {"a": 1}, "surrounding text"),
        ('"{\\"a\\": 1}"', {"a": 1}, "encoded as a string"),
        ("", {}, "empty arguments"),
    ],
)
def test_safe_repairs_are_made_and_recorded(
    raw: str, expected: dict[str, object], repair: str
) -> None:
    result = parse_arguments(raw)
    assert result.value == expected
    assert any(repair in note for note in result.repairs), result.repairs


def test_valid_json_needs_no_repair() -> None:
    result = parse_arguments('{"a": "x, }", "b": "True"}')
    assert result.value == {"a": "x, }", "b": "True"}
    assert result.repairs == ()


def test_strings_inside_values_are_left_alone() -> None:
    result = parse_arguments('{"note": "None of these, True,]", "n": None}')
    assert result.value == {"note": "None of these, True,]", "n": None}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('{"a": 1', "cut off"),
        ("[1, 2]", "not a JSON array"),
        ("just words", "not valid JSON"),
        ('{"a": 1} {"b": 2}', "not valid JSON"),
        ("{'a': __import__('os')}", "not valid JSON"),
    ],
)
def test_unsafe_or_impossible_repairs_are_refused(raw: str, reason: str) -> None:
    with pytest.raises(ArgumentsNotJSONError, match=reason):
        parse_arguments(raw)


def test_numbers_in_strings_become_numbers_only_where_the_schema_says() -> None:
    schema = {
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            "code": {"type": "string"},
            "half": {"type": "integer"},
        }
    }
    value, repairs = coerce_scalars(
        {"n": "3", "x": "2.5", "flag": "true", "code": "007", "half": "3.5"}, schema
    )
    assert value == {"n": 3, "x": 2.5, "flag": True, "code": "007", "half": "3.5"}
    assert len(repairs) == 3
    assert "argument 'n': string '3' read as integer 3" in repairs
