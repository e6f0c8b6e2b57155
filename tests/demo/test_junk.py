"""The memory audit of ``keel demo``: each kind of junk is found, real turns are not junk."""

from __future__ import annotations

from pathlib import Path

from keel.context._engine import MEMORIES_HEADING, RULES_HEADING
from keel.demo._flights import RULES, SYSTEM_PROMPT
from keel.demo._junk import (
    PromptedText,
    PromptRecorder,
    StoredMemory,
    audit_memories,
    read_prompted,
)

RESUME = (
    "You are resuming the 'flight_booking' workflow.\n"
    "Current step: gathering_dates - asking for dates\n"
    "Already known (do not ask for these again): origin = Lisbon; destination = Lima.\n"
    "What to do now: Which dates would you like to travel?"
)
RETRIEVED = "User: From Lisbon.\nAssistant: Where would you like to fly to?"
PROMPTED = [
    PromptedText(kind="system", text=SYSTEM_PROMPT),
    *(PromptedText(kind="rules", text=rule) for rule in RULES),
    PromptedText(kind="resume", text=RESUME),
    PromptedText(
        kind="memory", text=f"[episodic · 2026-12-01 · user_claim] {RETRIEVED}", record_ids=("t1",)
    ),
]


def _turn(record_id: str, text: str, *, kind: str = "episodic", type: str = "turn") -> StoredMemory:
    return StoredMemory(id=record_id, kind=kind, type=type, text=text)


GENUINE = [
    _turn("t1", RETRIEVED),  # the retrieved record itself is not a copy of itself
    _turn("t2", "User: To Lima.\nAssistant: Which dates would you like to travel?"),
    _turn("r1", "Task: book a flight\nTool calls that worked:\n- book_flight({})", type="run"),
    _turn("s1", "Facts:\n- User: From Lisbon.\n- Where would you like to fly to?", type="summary"),
]


def test_genuine_memories_are_not_junk() -> None:
    audit = audit_memories(GENUINE, PROMPTED)
    assert audit.junk == 0 and audit.examples == []
    assert audit.stored == 4 and audit.retrieved == 1
    assert audit.by_type == {"run": 1, "summary": 1, "turn": 2}


def test_each_kind_of_junk_is_counted() -> None:
    junk = [
        _turn("j1", f"User: hi\nAssistant: {SYSTEM_PROMPT}"),
        _turn("j2", "Never invent flights, prices or booking references: use the tools."),
        _turn("j3", f"{RULES_HEADING}\n- whatever"),
        _turn("j4", "Note: Confirm the itinerary before booking."),
        _turn(
            "j5", "Already known (do not ask for these again): origin = Lisbon; destination = Lima."
        ),
        _turn("j6", f"User: where?\nAssistant: you said {RETRIEVED}"),  # the text, unlabelled
        _turn("j7", "[episodic · 2026-12-01 · user_claim] anything at all"),  # a label
        _turn("j8", f"{MEMORIES_HEADING}\n- something"),
        _turn("j9", "user likes: window seats", kind="semantic", type="fact"),
        _turn("j10", "User:  To Lima.\nAssistant: Which dates would you like to travel?"),
    ]
    audit = audit_memories([*GENUINE, *junk], PROMPTED)
    assert audit.system_prompt == 2
    assert audit.rules == 2
    assert audit.resume_prompt == 1
    assert audit.retrieved_memories == 3
    assert audit.profiles == 1
    assert audit.duplicates == 1  # j10 is t2 with one more space: an add that was not idempotent
    assert audit.junk == len(junk) and len(audit.examples) == 5


def test_a_record_restating_most_of_an_earlier_retrieved_one_is_counted() -> None:
    lines = [
        "- User: From Lisbon to Lima.",
        "- Your booking reference is PNR7662FC.",
        "- The itinerary is in your inbox.",
        "- Window seat requested for the flight.",
        "- Vegetarian meal requested.",
        "- Aisle seat requested on the way back.",
    ]
    summary = "\n".join(["Facts:", *lines[:3]])
    retrieved = [PromptedText(kind="memory", text=f"[episodic] {summary}", record_ids=("s1",))]
    first = _turn("s1", summary, type="summary")
    # Lines in another order (no whole copy): 3 of 5 lines are the retrieved summary's.
    restated = _turn("s2", "\n".join(["Facts:", lines[2], *lines[3:5], *lines[:2]]))
    fresh = _turn("s3", "\n".join(["Facts:", *lines[1:]]))  # 2 of 5 lines
    audit = audit_memories([first, restated, fresh], retrieved)
    assert (audit.restated_memories, audit.retrieved_memories, audit.junk) == (1, 0, 1)
    assert audit.examples == ["turn s2: restated_memories"]
    # Only what was stored after the retrieved record restates it.
    assert audit_memories([restated, first], retrieved).restated_memories == 0


def test_a_retrieved_record_that_is_gone_is_matched_by_its_block() -> None:
    copy = _turn("j1", f"Assistant: as before, {RETRIEVED}")
    assert audit_memories([copy], PROMPTED).retrieved_memories == 1


def test_the_recorder_keeps_each_text_once_and_survives_a_cut_line(tmp_path: Path) -> None:
    class Engine:
        def compile(self, history: object, **options: object) -> str:
            return "prompt"

    class Machine:
        def resume_prompt(self, position: object) -> str:
            return RESUME

    class Agent:
        engine = Engine()
        machine = Machine()

    agent = Agent()
    recorder = PromptRecorder(tmp_path / "prompted.jsonl")
    recorder.install(agent)
    from keel.context import ContextMemory

    memory = ContextMemory(text=f"[episodic · 2026-12-01 · user_claim] {RETRIEVED}", id="t1,t2")
    for _ in range(2):
        rules = [*RULES, agent.machine.resume_prompt(None)]
        assert agent.engine.compile([], system=SYSTEM_PROMPT, rules=rules, memories=[memory]) == (
            "prompt"
        )
    recorder.close()
    with (tmp_path / "prompted.jsonl").open("a") as file:
        file.write('{"kind": "memo')  # a SIGKILL mid line
    items = read_prompted(tmp_path / "prompted.jsonl")
    assert [(i.kind, i.record_ids) for i in items] == [
        ("system", ()),
        ("rules", ()),
        ("rules", ()),
        ("resume", ()),
        ("memory", ("t1", "t2")),
    ]
