from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from keel.state._delta import diff, encode_full, encode_json, replay

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
_states = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), _json)


@given(_states, _states)
@settings(max_examples=200, deadline=None)
def test_diff_then_apply_round_trips(old: dict[str, Any], new: dict[str, Any]) -> None:
    delta = diff(old, new)
    assert replay([encode_full(old), json.dumps(delta)]) == new
    assert replay([encode_full(new)]) == new


def test_appended_lists_store_only_the_tail() -> None:
    old = {"messages": [{"content": "m1"}, {"content": "m2"}], "step": 2, "note": "x"}
    new = {"messages": [*old["messages"], {"content": "m3"}], "step": 3, "note": "x"}
    assert diff(old, new) == {"set": {"step": 3}, "extend": {"messages": [{"content": "m3"}]}}
    edited = {"messages": [{"content": "m1!"}, {"content": "m2"}], "step": 2, "note": "x"}
    assert diff(old, edited) == {"set": {"messages": edited["messages"]}}
    assert diff(old, {"step": 2}) == {"unset": ["messages", "note"]}
    assert diff(old, old) == {}


def test_objects_store_only_the_keys_that_changed() -> None:
    summary = "a long running summary " * 500
    old = {"runtime": {"summary": summary, "turns": 1, "open_turn": "t1"}, "step": 1}
    new = {"runtime": {"summary": summary, "turns": 2}, "step": 1}
    delta = diff(old, new)
    assert delta == {"patch": {"runtime": {"set": {"turns": 2}, "unset": ["open_turn"]}}}
    assert replay([encode_full(old), json.dumps(delta)]) == new


def test_a_payload_reads_back_as_the_value_json_would_have_written() -> None:
    """Payloads are written by pydantic-core: the JSON value ``json`` writes, whatever the
    text (numbers ``json`` spells its own way, non-finite floats, text left unescaped)."""
    value = {
        "floats": [1e16, 1e-7, -0.0, 0.1, float("inf"), float("-inf")],
        "text": 'é中\u2028\x00"\\ <EMAIL_1>',
        "nested": {"list": [None, True, 2**70], "empty": {}},
        1: "an int key",
    }
    written = encode_json(value)
    assert "\\u00e9" not in written and "é中" in written  # unescaped, as ensure_ascii=False
    assert json.loads(written) == json.loads(json.dumps(value, ensure_ascii=False))
    nan = json.loads(encode_json({"x": float("nan")}))["x"]
    assert math.isnan(nan)
