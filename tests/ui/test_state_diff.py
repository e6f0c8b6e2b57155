"""The session page's diff of two checkpoints (issue 49): one row per changed field, long text
diffed by words, JSON kept in a string compared inside rather than as one escaped string."""

from __future__ import annotations

import json

from keel.ui._diff import FieldChange, field_diff


def _by_path(changes: list[FieldChange]) -> dict[str, FieldChange]:
    return {change.path: change for change in changes}


def test_each_changed_field_is_one_row_and_long_text_is_diffed_by_words() -> None:
    before = "The customer asked to fly from Lisbon to Lima on the first of January, one passenger."
    after = (
        "The customer asked to fly from Lisbon to Cusco on the first of February, one passenger."
    )
    older = {"runtime": {"summary": before, "step": 3}, "machine": {"state": "idle", "path": []}}
    newer = {
        "runtime": {"summary": after, "step": 3},
        "machine": {"state": "confirming", "path": ["idle"]},
    }
    changes = _by_path(field_diff(older, newer))
    assert set(changes) == {"runtime.summary", "machine.state", "machine.path[0]"}
    assert changes["machine.path[0]"].change == "added"
    assert (changes["machine.state"].before, changes["machine.state"].after) == (
        "idle",
        "confirming",
    )
    words = changes["runtime.summary"].words
    assert [w.text for w in words if w.op == "del"] == ["Lima", "January,"]
    assert [w.text for w in words if w.op == "add"] == ["Cusco", "February,"]
    assert "".join(w.text for w in words if w.op != "add") == before
    assert "".join(w.text for w in words if w.op != "del") == after


def test_json_held_in_a_string_is_compared_field_by_field() -> None:
    older = {"summary": json.dumps({"origin": "Lisbon", "dates": ["2027-01-01"]})}
    newer = {"summary": json.dumps({"origin": "Tokyo", "dates": ["2027-01-01"]})}
    changes = field_diff(older, newer)
    assert [(c.path, c.before, c.after) for c in changes] == [("summary.origin", "Lisbon", "Tokyo")]


def test_the_same_state_has_no_changes() -> None:
    state = {"messages": [{"role": "user", "content": "hi"}], "step": 1}
    assert field_diff(state, json.loads(json.dumps(state))) == []
