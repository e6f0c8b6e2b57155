"""The Agent across processes: two workers on one session, and a worker SIGKILLed at every
point of a turn, then resumed. Effects are counted from the outside world (the file the
booking tool appends to), turns from the committed state."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from tests.runtime.agent_worker import KILL_POINTS

_ROOT = Path(__file__).resolve().parents[2]


def _command(tmp_path: Path, texts: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.runtime.agent_worker",
        "--db",
        str(tmp_path / "keel.db"),
        "--effects",
        str(tmp_path / "effects.txt"),
        "--texts",
        json.dumps(texts),
        *extra,
    ]


def _worker(
    tmp_path: Path, texts: list[str], *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(tmp_path, texts, *extra),
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _replies(output: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def _effects(tmp_path: Path) -> Counter[str]:
    path = tmp_path / "effects.txt"
    if not path.exists():
        return Counter()
    return Counter(path.read_text().split())


def _state(tmp_path: Path, session: str = "s1") -> AgentState:
    database = SQLiteDatabase(tmp_path / "keel.db")
    try:
        checkpoint = StateStore(SQLStateBackend(database), AgentState).get(f"default/{session}")
        assert checkpoint is not None
        return checkpoint.state
    finally:
        database.close()


def _in_doubt(tmp_path: Path) -> int:
    database = SQLiteDatabase(tmp_path / "keel.db")
    try:
        return len(SQLToolJournal(database).in_doubt())
    finally:
        database.close()


def test_two_processes_on_one_session_book_each_request_exactly_once(tmp_path: Path) -> None:
    texts = {name: [f"book {name}{n}" for n in range(8)] for name in ("A", "B")}
    workers = [
        subprocess.Popen(
            _command(tmp_path, batch, "--lease-ttl", "5"),
            cwd=_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for batch in texts.values()
    ]
    outputs = [worker.communicate(timeout=240) for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr
    replies = [reply for stdout, _ in outputs for reply in _replies(stdout)]
    assert len(replies) == 16
    assert all(reply["status"] == "completed" for reply in replies)
    effects = _effects(tmp_path)
    expected = {text.removeprefix("book ") for batch in texts.values() for text in batch}
    assert set(effects) == expected and set(effects.values()) == {1}, effects
    state = _state(tmp_path)
    users = Counter(m.content for m in state.messages if m.role == "user")
    assert set(users) == {text for batch in texts.values() for text in batch}
    assert set(users.values()) == {1}, "every message was saved exactly once"
    answers = [m for m in state.messages if m.role == "assistant" and not m.tool_calls]
    assert len(answers) == 16
    assert state.runtime.open_turn is None


def test_killed_mid_stream_then_resumed_nothing_is_lost_or_repeated(tmp_path: Path) -> None:
    texts = [f"book K{n}" for n in range(1, 4)]
    # Killed while the second turn's answer streams: its booking ran, its reply was half shown.
    killed = _worker(tmp_path, texts, "--stream", "--kill-at", "mid_stream:120")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(_replies(killed.stdout)) == 1, "the kill was not in the second turn"
    state = _state(tmp_path)
    assert state.runtime.open_turn is not None, "the streamed turn was not left open"
    received = {m.content for m in state.messages if m.role == "user"}
    resent = [text for text in texts if text not in received]
    resumed = _worker(tmp_path, resent, "--stream", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    replies = _replies(resumed.stdout)
    assert replies[0].get("resumed") and replies[0]["status"] == "completed"
    effects = _effects(tmp_path)
    assert effects == {"K1": 1, "K2": 1, "K3": 1}, f"an effect repeated or was lost: {effects}"
    state = _state(tmp_path)
    assert Counter(m.content for m in state.messages if m.role == "user") == Counter(texts)
    assert state.runtime.open_turn is None and state.runtime.turns == len(texts)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_anywhere_in_a_turn_then_resumed_nothing_is_lost_or_repeated(
    tmp_path: Path, point: str
) -> None:
    summary = point == "during_summary"
    # A small window and more turns, so old turns are folded into the summary.
    texts = [f"book K{n}" for n in range(1, 9 if summary else 4)]
    budget = "1200" if summary else "8000"
    nth = "1" if summary else "2"
    killed = _worker(tmp_path, texts, "--kill-at", f"{point}:{nth}", "--budget", budget)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # The client resends what the session never received, and resumes what it did (a turn
    # the crash left open, or one committed whose reply was lost with the process).
    received = {m.content for m in _state(tmp_path).messages if m.role == "user"}
    resent = [text for text in texts if text not in received]
    resumed = _worker(tmp_path, resent, "--budget", budget, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    final = [reply for reply in _replies(resumed.stdout) if "text" in reply]
    assert [reply["text"] for reply in final] == resent

    effects = _effects(tmp_path)
    assert all(count == 1 for count in effects.values()), f"an effect repeated: {effects}"
    in_doubt = _in_doubt(tmp_path)
    missing = {text.removeprefix("book ") for text in texts} - set(effects)
    if point in ("tool_before_effect", "tool_after_effect"):
        # Killed inside the tool, after its intent was journalled: keel cannot know whether
        # the booking went through, so the call is in doubt and never runs again.
        assert in_doubt == 1
        assert missing == ({"K2"} if point == "tool_before_effect" else set())
        said = [str(reply["reply"]) for reply in _replies(resumed.stdout)]
        assert any("cannot tell whether it went through" in text for text in said), said
    else:
        assert in_doubt == 0
        assert not missing, f"never booked: {missing}"

    state = _state(tmp_path)
    users = Counter(m.content for m in state.messages if m.role == "user")
    assert users == Counter(texts), "0 lost turns, 0 repeated questions"
    assert state.runtime.open_turn is None
    assert state.runtime.turns == len(texts)
    if summary:
        assert state.runtime.summary and state.runtime.messages_summarized > 0
