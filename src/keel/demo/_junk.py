"""Junk in long-term memory: stored records that restate what keel itself put in the prompt.

An audit of Mem0 (mem0#4573) found 97.8% of 10,134 stored memories were junk: the system prompt
restated, recalled memories re-extracted, invented profiles. keel writes memories in three places,
never from the prompt: each finished turn (the user's message and the reply, verbatim), each
successful workflow run (task and tool calls) and the session's running summary (one record per
session, replaced each time the summary is committed again). This module checks that over a whole
demo run. `PromptRecorder` (in the worker) notes what the prompt compiler was given: the
system prompt, the operating rules, the resume prompts and the retrieved memories.
`audit_memories` then reads every stored record against them and counts records that

- restate the system prompt: contain it, or one of its sentences;
- restate the operating rules: contain one of their sentences, or the rules heading;
- restate a resume prompt: contain one of its lines;
- store a retrieved memory again: contain a memory label (``[episodic · 2025-01-01 · verified]``),
  the memories heading, or the whole text of another record that was retrieved into a prompt;
- restate a retrieved memory: a record stored after one that was retrieved into a prompt, most of
  whose lines are lines of it (a running summary stored again with each new line added);
- invent a profile: semantic facts (the demo never states one, so any would be invented);
- duplicate another record: the same kind, type and text, spaces aside (identical adds are
  idempotent, so a turn repeated word for word must stay one record).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from keel.context._engine import MEMORIES_HEADING, RULES_HEADING, SUMMARY_HEADING

__all__ = [
    "PROMPTED_FILE",
    "MemoryAudit",
    "PromptRecorder",
    "PromptedText",
    "StoredMemory",
    "audit_memories",
    "read_prompted",
]

PROMPTED_FILE = "prompted.jsonl"
"""Where, in the demo's workdir, `PromptRecorder` writes what the prompt compiler was
given (the worker records it, the parent's memory audit reads it)."""

PromptedKind = Literal["system", "rules", "resume", "memory"]

MIN_FRAGMENT = 20
"""Characters (after normalizing) a sentence, line or retrieved text needs to count as a
restatement when found inside a record: shorter ones ("Yes.") occur in real conversation."""

_LABEL = re.compile(r"\[(?:episodic|semantic|procedural) · \d{4}-\d{2}-\d{2} · [a-z_]+\]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


class PromptedText(BaseModel):
    """One text the prompt compiler was given during the run."""

    kind: PromptedKind = Field(description="system prompt, a rule, a resume prompt or a memory.")
    text: str = Field(description="The text as given (a memory with its label).")
    record_ids: tuple[str, ...] = Field(default=(), description="A memory's records.")


class StoredMemory(BaseModel):
    """One stored memory record, as the audit reads it."""

    id: str
    kind: str
    type: str
    text: str


class MemoryAudit(BaseModel):
    """What long-term memory holds after the run, and how much of it is junk."""

    stored: int = Field(description="Records in the memory store.")
    by_type: dict[str, int] = Field(description="Records per type (turn, run, summary, ...).")
    retrieved: int = Field(description="Distinct records retrieved into a prompt during the run.")
    junk: int = Field(description="Records that are junk for at least one reason below.")
    system_prompt: int = Field(description="Records restating the system prompt.")
    rules: int = Field(description="Records restating the operating rules.")
    resume_prompt: int = Field(description="Records restating a resume prompt.")
    retrieved_memories: int = Field(
        description="Records holding a retrieved memory again (its label or its whole text)."
    )
    restated_memories: int = Field(
        default=0,
        description="Records stored after a retrieved record, most of whose lines are its lines.",
    )
    profiles: int = Field(description="Semantic (profile) facts, which the demo never states.")
    duplicates: int = Field(
        default=0, description="Records with the kind, type and text of an earlier record."
    )
    examples: list[str] = Field(
        default_factory=list, description="Up to five junk records: type, id and reason."
    )


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def _pieces(texts: Iterable[str], pattern: re.Pattern[str]) -> set[str]:
    """Each text, whole and cut by ``pattern``, normalized; the pieces long enough to count."""
    found: set[str] = set()
    for text in texts:
        for piece in (text, *pattern.split(text)):
            normal = _norm(piece.lstrip("- "))
            if len(normal) >= MIN_FRAGMENT:
                found.add(normal)
    return found


def _lines(text: str) -> set[str]:
    """The lines of ``text`` long enough to count, normalized (list dashes cut)."""
    return {
        normal
        for normal in (_norm(line.strip().lstrip("- ")) for line in text.splitlines())
        if len(normal) >= MIN_FRAGMENT
    }


def _contains_any(text: str, pieces: Iterable[str]) -> bool:
    return any(piece in text for piece in pieces)


def audit_memories(
    records: Sequence[StoredMemory], prompted: Iterable[PromptedText]
) -> MemoryAudit:
    """Count the junk among ``records`` (in the order they were stored) given what the prompts
    held (see the module)."""
    by_kind: dict[str, list[PromptedText]] = {"system": [], "rules": [], "resume": [], "memory": []}
    for item in prompted:
        by_kind[item.kind].append(item)
    system = _pieces((p.text for p in by_kind["system"]), _SENTENCE_END)
    rules = _pieces((p.text for p in by_kind["rules"]), _SENTENCE_END) | {_norm(RULES_HEADING)}
    resume = _pieces((p.text for p in by_kind["resume"]), re.compile(r"\n+"))
    texts = {record.id: _norm(record.text) for record in records}
    retrieved_ids = {rid for item in by_kind["memory"] for rid in item.record_ids}
    # The text of each retrieved record (or of the block, label cut, if it is gone since).
    retrieved: dict[str, str] = {rid: texts[rid] for rid in retrieved_ids if rid in texts}
    for item in by_kind["memory"]:
        if len(item.record_ids) == 1 and item.record_ids[0] not in texts:
            retrieved[item.record_ids[0]] = _norm(_LABEL.sub("", item.text))
    retrieved = {rid: text for rid, text in retrieved.items() if len(text) >= MIN_FRAGMENT}
    headings = (_norm(MEMORIES_HEADING), _norm(SUMMARY_HEADING))
    order = {record.id: index for index, record in enumerate(records)}
    retrieved_lines = {
        record.id: _lines(record.text) for record in records if record.id in retrieved_ids
    }
    counts = dict.fromkeys(
        ("system_prompt", "rules", "resume_prompt", "retrieved_memories", "restated_memories"), 0
    )
    profiles = 0
    duplicates = 0
    junk = 0
    examples: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for record in records:
        text = texts[record.id]
        reasons = []
        if _contains_any(text, system):
            reasons.append("system_prompt")
        if _contains_any(text, rules):
            reasons.append("rules")
        if _contains_any(text, resume):
            reasons.append("resume_prompt")
        if (
            _LABEL.search(record.text)
            or any(heading in text for heading in headings)
            or any(rid != record.id and other in text for rid, other in retrieved.items())
        ):
            reasons.append("retrieved_memories")
        lines = _lines(record.text)
        if len(lines) >= 2 and any(
            order[rid] < order[record.id] and 2 * len(lines & earlier) > len(lines)
            for rid, earlier in retrieved_lines.items()
        ):
            reasons.append("restated_memories")
        for reason in reasons:
            counts[reason] += 1
        if record.kind == "semantic":
            profiles += 1
            reasons.append("profile")
        identity = (record.kind, record.type, " ".join(record.text.split()))
        if identity in seen:
            duplicates += 1
            reasons.append("duplicate")
        seen.add(identity)
        if reasons:
            junk += 1
            if len(examples) < 5:
                examples.append(f"{record.type} {record.id}: {', '.join(reasons)}")
    by_type: dict[str, int] = {}
    for record in records:
        by_type[record.type] = by_type.get(record.type, 0) + 1
    return MemoryAudit(
        stored=len(records),
        by_type=dict(sorted(by_type.items())),
        retrieved=len(retrieved_ids),
        junk=junk,
        profiles=profiles,
        duplicates=duplicates,
        examples=examples,
        **counts,
    )


class PromptRecorder:
    """Notes, in a JSON-lines file, each distinct text given to an agent's prompt compiler.

    ``install(agent)`` wraps the agent's ``engine.compile`` (system prompt, rules, memories as
    they reach the prompt) and its workflow's ``resume_prompt`` (to tell resume prompts from the
    other rules). Each line is written and flushed at once: a SIGKILLed worker loses nothing
    already compiled, and a worker started after it appends to the same file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: set[tuple[str, str]] = set()
        self._resume: set[str] = set()
        self._lock = threading.Lock()
        self._file = path.open("a", encoding="utf-8")

    def install(self, agent: Any) -> None:
        engine = agent.engine
        compile_prompt: Callable[..., Any] = engine.compile

        def compile_recorded(history: Any, **options: Any) -> Any:
            self._compiled(options)
            return compile_prompt(history, **options)

        engine.compile = compile_recorded
        machine = agent.machine
        if machine is not None:
            resume_prompt: Callable[..., str] = machine.resume_prompt

            def resume_recorded(position: Any) -> str:
                text = resume_prompt(position)
                with self._lock:
                    self._resume.add(text)
                return text

            machine.resume_prompt = resume_recorded

    def _compiled(self, options: dict[str, Any]) -> None:
        system = options.get("system") or ""
        if system.strip():
            self._note(PromptedText(kind="system", text=system))
        rules = options.get("rules") or ()
        for rule in [rules] if isinstance(rules, str) else rules:
            if rule.strip():
                kind: PromptedKind = "resume" if rule in self._resume else "rules"
                self._note(PromptedText(kind=kind, text=rule))
        for memory in options.get("memories") or ():
            text = memory if isinstance(memory, str) else memory.text
            ids = () if isinstance(memory, str) or not memory.id else tuple(memory.id.split(","))
            self._note(PromptedText(kind="memory", text=text, record_ids=ids))

    def _note(self, item: PromptedText) -> None:
        key = (item.kind, item.text)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            self._file.write(item.model_dump_json() + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_prompted(path: Path) -> list[PromptedText]:
    """What `PromptRecorder` wrote (a line cut short by a SIGKILL is skipped)."""
    if not path.exists():
        return []
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            items.append(PromptedText.model_validate(json.loads(line)))
        except ValueError:
            continue
    return items
