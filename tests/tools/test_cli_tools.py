"""``keel tools in-doubt`` and ``keel tools resolve``: the operator's side of exactly-once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from keel.settings import load_settings
from keel.stores import Backends
from keel.tools import idempotency_key

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _keel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )


def test_an_operator_lists_and_resolves_in_doubt_calls() -> None:
    backends = Backends.open(load_settings(), only=("journal",), redis_url="")
    journal = backends.journal
    key = idempotency_key("s1", 3, 0)
    journal.claim(
        key=key, session_id="s1", step=3, call_index=0, tool="book_flight", arguments="{}"
    )
    listed = _keel("tools", "in-doubt", "--json")
    assert listed.returncode == 0, listed.stderr
    payload = json.loads(listed.stdout.strip().splitlines()[-1])
    assert [entry["key"] for entry in payload["in_doubt"]] == [key]
    assert payload["in_doubt"][0]["tool"] == "book_flight"
    wrong = _keel("tools", "resolve", key, "--outcome", "maybe", "--content", "x")
    assert wrong.returncode == 2 and "succeeded" in wrong.stderr
    # Without --content too, the outcome is what is wrong first.
    wrong = _keel("tools", "resolve", key, "--outcome", "maybe")
    assert wrong.returncode == 2, wrong.stderr
    assert "--outcome" in wrong.stderr and "'maybe'" in wrong.stderr, wrong.stderr
    assert "--content" not in wrong.stderr, wrong.stderr
    done = _keel("tools", "resolve", key, "--outcome", "succeeded", "--content", "booked, ref 7")
    assert done.returncode == 0, done.stderr
    entry = journal.get(key)
    assert entry is not None and entry.status == "succeeded" and entry.content == "booked, ref 7"
    # An operator's repeat is harmless: it says how the call was settled, and changes nothing.
    again = _keel("tools", "resolve", key, "--outcome", "failed", "--content", "x")
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stdout.split())
    assert f"{key} is already settled as succeeded: [settled by an operator] booked, ref 7" in said
    assert "--outcome failed not recorded" in said, said
    entry = journal.get(key)
    assert entry is not None and entry.status == "succeeded" and entry.content == "booked, ref 7"
    assert "no tool calls in doubt" in _keel("tools", "in-doubt").stdout
    backends.close()


def test_resolving_a_call_its_late_result_settled_says_so_and_succeeds() -> None:
    backends = Backends.open(load_settings(), only=("journal",), redis_url="")
    journal = backends.journal
    key = idempotency_key("s1", 2, 0)
    journal.claim(key=key, session_id="s1", step=2, call_index=0, tool="refund", arguments="{}")
    # The operator looks it up; meanwhile the shop's answer comes in after all.
    journal.finish(key, ok=True, content="refunded 40 EUR", output="refunded 40 EUR (ref 9)")
    late = _keel("tools", "resolve", key, "--outcome", "succeeded", "--content", "done by hand")
    assert late.returncode == 0, late.stderr
    said = " ".join(late.stdout.split())
    assert f"{key} is already settled as succeeded: refunded 40 EUR (ref 9) (nothing changed)" in (
        said
    ), said
    entry = journal.get(key)
    assert entry is not None and entry.content == "refunded 40 EUR"  # the result stands
    backends.close()
