"""``keel bench locomo --cv``: constants chosen on the training conversations only, scored on
the held-out one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from keel.bench._locomo_cv import Score, Setting, choose, cross_validate
from tests.bench._cli import bench_json

GRIDS = {
    "x": ({"x": 0.0}, {"x": 1.0}, {"x": 2.0}),
    "y": ({"y": 0.0}, {"y": 1.0}),
}
# R@10 of each conversation by x: "a" loves x=2, "b" and "c" x=1.
RECALL = {
    "a": {0.0: 0.50, 1.0: 0.55, 2.0: 0.95},
    "b": {0.0: 0.50, 1.0: 0.80, 2.0: 0.40},
    "c": {0.0: 0.50, 1.0: 0.70, 2.0: 0.45},
}


class _Table:
    """Scores from ``RECALL``; fails when asked about the ``forbidden`` conversation."""

    def __init__(self, forbidden: str | None = None) -> None:
        self.forbidden = forbidden

    def __call__(self, setting: Setting, conversations: Sequence[str]) -> Score:
        if self.forbidden is not None and self.forbidden in conversations:
            raise AssertionError(f"selection read the held-out conversation {self.forbidden}")
        values = dict(setting)
        # y=1 would add recall but goes over 1,000 tokens.
        recalls = [RECALL[name][values["x"]] + 0.01 * values["y"] for name in conversations]
        tokens = 900.0 + 200.0 * values["y"]
        return Score(sum(recalls) / len(recalls), 0.0, tokens, len(recalls))


def test_selection_reads_only_the_training_conversations() -> None:
    for held_out in RECALL:
        training = [name for name in RECALL if name != held_out]
        choose(_Table(forbidden=held_out), training, grids=GRIDS)


def test_each_fold_is_scored_with_what_the_others_chose() -> None:
    table = _Table()
    result = cross_validate(table, list(RECALL), grids=GRIDS, max_tokens=1000)
    by_fold = {fold["held_out"]: fold for fold in result["folds"]}
    # Without "a", b and c prefer x=1, so "a" is scored at x=1 (0.55), not at its own 0.95.
    assert by_fold["a"]["chosen"] == {"x": 1.0, "y": 0.0}
    assert by_fold["a"]["recall_at_10"] == 0.55
    # Without "b": a and c average 0.70 at x=2 against 0.625 at x=1.
    assert by_fold["b"]["chosen"]["x"] == 2.0
    assert by_fold["b"]["recall_at_10"] == 0.40
    # Without "c": a and b tie at x=1 and x=2 (0.675); the tie keeps the earlier value.
    assert by_fold["c"]["chosen"]["x"] == 1.0
    assert result["recall_at_10_mean"] == pytest.approx((0.55 + 0.40 + 0.70) / 3, abs=1e-4)
    assert result["recall_at_10_spread"] == pytest.approx(0.30, abs=1e-4)
    # y=1 goes over the token budget: never chosen.
    assert all(fold["chosen"]["y"] == 0.0 for fold in result["folds"])
    # What would ship is chosen on all three.
    assert result["chosen_on_all"] == {"x": 1.0, "y": 0.0}


def _conversation(sample: str, pet: str, hobby: str) -> dict[str, object]:
    """A made-up conversation in LoCoMo's format (not LoCoMo data)."""
    return {
        "sample_id": sample,
        "conversation": {
            "speaker_a": "Ann",
            "speaker_b": "Ben",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Ann", "dia_id": "D1:1", "text": f"I started {hobby} this week."},
                {"speaker": "Ben", "dia_id": "D1:2", "text": "Nice, how is it going?"},
            ],
            "session_2_date_time": "10:00 am on 2 June, 2023",
            "session_2": [
                {"speaker": "Ben", "dia_id": "D2:1", "text": f"I adopted a {pet} named Rex."},
                {"speaker": "Ann", "dia_id": "D2:2", "text": "What a lovely name!"},
            ],
        },
        "qa": [
            {"question": "What did Ann start?", "answer": hobby, "evidence": ["D1:1"],
             "category": 4},
            {"question": f"What is Ben's {pet} called?", "answer": "Rex", "evidence": ["D2:1"],
             "category": 1},
            {"question": "What did Ben adopt on 2 June, 2023?", "answer": pet,
             "evidence": ["D2:1"], "category": 2},
        ],
    }  # fmt: skip


def test_cv_from_the_command_line(tmp_path: Path) -> None:
    data = tmp_path / "three.json"
    items = [
        _conversation("c1", "dog", "pottery"),
        _conversation("c2", "cat", "chess"),
        _conversation("c3", "parrot", "rowing"),
    ]
    # c3 gets a long third session and a question no search finds: its recall is below
    # the other two, so a fold's held-out figure differs from its training one.
    chat = items[2]["conversation"]
    assert isinstance(chat, dict)
    chat["session_3_date_time"] = "9:00 am on 1 July, 2023"
    chat["session_3"] = [
        {"speaker": "Ann", "dia_id": f"D3:{i}", "text": f"Filler remark {i} about the weather."}
        for i in range(1, 41)
    ] + [{"speaker": "Ben", "dia_id": "D3:41", "text": "The blue team took the cup."}]
    questions = items[2]["qa"]
    assert isinstance(questions, list)
    questions.append(
        {"question": "Who won?", "answer": "blue", "evidence": ["D3:41"], "category": 4}
    )
    data.write_text(json.dumps(items), encoding="utf-8")
    report = bench_json("locomo", "--data", str(data), "--embedder", "hashing:64", "--cv")
    assert len(report["cv_folds"]) == 3
    assert report["cv_recall_at_10_spread"] == pytest.approx(
        max(report["cv_folds"]) - min(report["cv_folds"]), abs=1e-4
    )
    assert report["cv_recall_at_10_mean"] == pytest.approx(sum(report["cv_folds"]) / 3, abs=1e-4)
    folds = report["cv"]["all"]["folds"]
    assert report["cv_folds"] == [fold["recall_at_10"] for fold in folds]
    assert folds[2]["recall_at_10"] < folds[2]["train_recall_at_10"]
    assert [fold["held_out"] for fold in folds] == ["c1", "c2", "c3"]
    assert set(report["per_conversation"]) == {"c1", "c2", "c3"}
    assert report["recall_at_10"] > 0  # the plain figure is still there


def test_cv_needs_two_conversations(tmp_path: Path) -> None:
    data = tmp_path / "one.json"
    data.write_text(json.dumps([_conversation("c1", "dog", "pottery")]), encoding="utf-8")
    from keel.bench.locomo import run_locomo
    from keel.errors import ConfigError
    from keel.memory import HashingEmbedder

    with pytest.raises(ConfigError, match="two conversations"):
        run_locomo(data, embedder=HashingEmbedder(16), cv=True)
