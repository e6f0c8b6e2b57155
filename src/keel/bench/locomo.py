"""LoCoMo retrieval benchmark: turn-level evidence recall of keel's default memory search.

For each conversation, every turn becomes one episodic memory (``"Speaker: text [caption]"``,
session id, turn number, the session's date as event time) in its own scope; each question of
categories 1-4 is searched with [`keel.memory.Memory.search`][] under the default
[`RetrievalConfig`][], exactly as the runtime calls it. Nothing from answers
or evidence is read at query time: evidence only scores the result afterwards.

Metrics: R@k (share of a question's evidence turns among the turns retrieved for the top k
hits, their neighbouring turns included; adjacent hits share one block), session-level R@10
(share of the sessions holding a question's evidence among the sessions of its top 10
retrieved turns), All@10, tokens of the retrieved turns (each turn counted once), search
latency with the query embedding.

Baselines in the same run, each without neighbour expansion: keyword-only (BM25), dense-only,
and keel itself without neighbours. Each is reported twice: at k (its own top 5 and top 10
hits), and ``at_keel_budget``: per question, its hits in rank order for as long as the turns
fit in the tokens keel's top 5 (top 10) took for that question, so that recall is compared at
the same tokens (like-for-like: the same ``tokens_at_10`` at most), not at the same k.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keel.bench._locomo_cv import (
    LEVER_GRIDS,
    MEASURED_GRIDS,
    PROCEDURE,
    Score,
    Setting,
    cross_validate,
    lever_alone,
    setting_of,
)
from keel.bench._stats import nearest_rank
from keel.bench.memory import memory_backends
from keel.errors import ConfigError
from keel.memory import Embedder, Memory, MemoryHit, MemoryStore, RetrievalConfig, Scope
from keel.memory._embedders import FloatArray
from keel.tokens import counter_for

__all__ = ["CATEGORY_NAMES", "load_locomo", "parse_session_date", "repair_evidence", "run_locomo"]

CATEGORY_NAMES = {1: "multi_hop", 2: "temporal", 3: "open_domain", 4: "single_hop"}

_SESSION = re.compile(r"^session_(\d+)$")


def parse_session_date(text: str) -> datetime | None:
    """``"1:56 pm on 8 May, 2023"`` -> a UTC datetime (None if unparseable)."""
    cleaned = " ".join(text.replace(",", " ").split())
    for pattern in ("%I:%M %p on %d %B %Y", "%I:%M %p on %d %b %Y", "%d %B %Y", "%B %d %Y"):
        try:
            return datetime.strptime(cleaned, pattern).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def repair_evidence(raw: Any, known: set[str]) -> tuple[list[str], int]:
    """Evidence ids that exist, after repairing malformed ones; and how many were dropped.

    Handles ``"D8:6; D9:17"`` (several ids in one string), ``"D:11:26"`` (a stray colon),
    spaces and lower case. Ids that still do not exist are dropped and counted.
    """
    entries = raw if isinstance(raw, list) else [raw]
    found: list[str] = []
    dropped = 0
    for entry in entries:
        for piece in re.split(r"[;,\s]+", str(entry).strip()):
            if not piece:
                continue
            candidate = piece.upper()
            match = re.fullmatch(r"D:?(\d+):+(\d+)", candidate)
            if match:
                candidate = f"D{int(match.group(1))}:{int(match.group(2))}"
            if candidate in known:
                if candidate not in found:
                    found.append(candidate)
            else:
                dropped += 1
    return found, dropped


def load_locomo(path: str | Path) -> list[dict[str, Any]]:
    """The conversations of a LoCoMo-format JSON file.

    Raises:
        ConfigError: the file is missing or not in LoCoMo format.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"LoCoMo data {path} is not UTF-8 (byte {exc.start})") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read LoCoMo data {path}: {exc}") from exc
    if not isinstance(data, list) or not all(
        isinstance(item, dict) and "conversation" in item and "qa" in item for item in data
    ):
        raise ConfigError(f"{path} is not a LoCoMo file (a list of {{conversation, qa}} items)")
    if not any(item["qa"] for item in data):
        raise ConfigError(f"LoCoMo data {path} holds no questions: nothing to score")
    return data


def _turn_text(turn: dict[str, Any]) -> str:
    text = f"{turn.get('speaker', '')}: {turn.get('text', '')}"
    caption = turn.get("blip_caption")
    return f"{text} [{caption}]" if caption else text


class _Tally:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.latencies: list[float] = []
        self.conversations: list[str] = []

    def add_scores(
        self, category: int, top5: _Scored, top10: _Scored, conversation: str = ""
    ) -> None:
        self.conversations.append(conversation)
        self.rows.append(
            {
                "category": category,
                "r5": top5.recall,
                "r10": top10.recall,
                "s10": top10.session_recall,
                "all10": top10.complete,
                "tokens": top10.tokens,
            }
        )

    def summary(self, rows: list[dict[str, float]] | None = None) -> dict[str, Any]:
        rows = self.rows if rows is None else rows
        if not rows:
            return {"questions": 0}
        return {
            "questions": len(rows),
            "recall_at_5": round(statistics.fmean(r["r5"] for r in rows), 4),
            "recall_at_10": round(statistics.fmean(r["r10"] for r in rows), 4),
            "session_recall_at_10": round(statistics.fmean(r["s10"] for r in rows), 4),
            "all_at_10": round(statistics.fmean(r["all10"] for r in rows), 4),
            "tokens_at_10": round(statistics.fmean(r["tokens"] for r in rows), 1),
        }

    def full(self) -> dict[str, Any]:
        result = self.summary()
        result["search_ms_p50"] = round(nearest_rank(self.latencies, 0.5), 2)
        result["search_ms_p95"] = round(nearest_rank(self.latencies, 0.95), 2)
        result["by_category"] = {
            CATEGORY_NAMES.get(cat, str(cat)): self.summary(
                [r for r in self.rows if r["category"] == cat]
            )
            for cat in sorted({int(r["category"]) for r in self.rows})
        }
        return result


def _systems(default_cfg: RetrievalConfig) -> dict[str, RetrievalConfig]:
    """keel's retrieval and the baselines it is compared with, as retrieval configurations."""
    systems: dict[str, RetrievalConfig] = {
        "keel": default_cfg,
        "bm25": default_cfg.model_copy(
            update={"vector_weight": 0.0, "neighbours": 0, "recency_weight": 0.0}
        ),
        "dense": default_cfg.model_copy(
            update={
                "keyword_weight": 0.0,
                "neighbours": 0,
                "recency_weight": 0.0,
                "min_similarity": -1.0,
            }
        ),
    }
    systems["keel_without_neighbours"] = default_cfg.model_copy(update={"neighbours": 0})
    return systems


class _LocomoRun:
    """One run over the conversations: each one ingested, then its questions asked of every
    system; the tallies and counts the report is made of."""

    def __init__(
        self,
        systems: dict[str, RetrievalConfig],
        counter: Any,
        questions_total: int,
        progress: Callable[[str, int, int], None] | None,
    ) -> None:
        self.counter = counter
        self.questions_total = questions_total
        self.progress = progress
        self.tallies = {name: _Tally() for name in systems}
        self.budgeted = {name: _Tally() for name in systems if name != "keel"}
        self.dropped_evidence = 0
        self.skipped_questions = 0
        self.turns_total = 0
        self.ingest_seconds = 0.0
        self.asked = 0
        self.questions: dict[str, list[_Question]] = {}
        self.scopes: dict[str, Scope] = {}

    def conversation(self, memories: dict[str, Memory], number: int, item: dict[str, Any]) -> None:
        name = str(item.get("sample_id", number))
        scope = Scope(tenant_id="locomo", user_id=name)
        by_dia = self._ingest(memories["keel"], scope, item["conversation"])
        dia_of = {record_id: dia for dia, record_id in by_dia.items()}
        known = set(by_dia)
        self.scopes[name] = scope
        asked = self.questions.setdefault(name, [])
        for qa in item["qa"]:
            category = qa.get("category")
            if category not in CATEGORY_NAMES:
                continue
            self.asked += 1
            evidence, dropped = repair_evidence(qa.get("evidence", []), known)
            self.dropped_evidence += dropped
            if not evidence:
                self.skipped_questions += 1
                continue
            question = _Question(str(qa["question"]), int(category), tuple(evidence), dia_of)
            asked.append(question)
            self._ask(memories, scope, question, name)
            if self.progress is not None:
                self.progress("questions", self.asked, self.questions_total)

    def _ingest(self, writer: Memory, scope: Scope, conversation: dict[str, Any]) -> dict[str, str]:
        """Every turn of every session as an episodic record (timed); record ids by turn id."""
        sessions = sorted(
            (int(m.group(1)), key)
            for key in conversation
            if (m := _SESSION.match(key)) and isinstance(conversation[key], list)
        )
        by_dia: dict[str, str] = {}
        started = time.perf_counter()
        for index, key in sessions:
            when = parse_session_date(str(conversation.get(f"{key}_date_time", "")))
            for position, turn in enumerate(conversation[key]):
                record = writer.add(
                    _turn_text(turn),
                    scope=scope,
                    kind="episodic",
                    type="turn",
                    session_id=f"session_{index}",
                    turn=position,
                    event_time=when,
                    metadata={"dia_id": turn.get("dia_id", "")},
                )
                by_dia[str(turn.get("dia_id", ""))] = record.id
                self.turns_total += 1
        writer.process_outbox()
        self.ingest_seconds += time.perf_counter() - started
        return by_dia

    def _ask(
        self,
        memories: dict[str, Memory],
        scope: Scope,
        asked: _Question,
        conversation: str,
    ) -> None:
        counter = self.counter
        question, category, dia_of = asked.text, asked.category, asked.dia_of
        evidence = list(asked.evidence)
        budget5 = budget10 = 0
        for name, memory in memories.items():
            started = time.perf_counter()
            hits = memory.search(question, scope=scope, k=10)
            self.tallies[name].latencies.append((time.perf_counter() - started) * 1000)
            # With neighbours, adjacent hits merge into one block, so the top 5 hits
            # are asked for, not read off the first 5 blocks.
            top5 = (
                hits[:5]
                if memory.config.neighbours == 0
                else memory.search(question, scope=scope, k=5)
            )
            scored5 = _score(top5, evidence, dia_of, counter)
            scored10 = _score(hits[:10], evidence, dia_of, counter)
            self.tallies[name].add_scores(category, scored5, scored10, conversation)
            if name == "keel":
                budget5, budget10 = scored5.tokens, scored10.tokens
                continue
            # The same system given keel's tokens for this question instead of k hits.
            deep = memory.search(question, scope=scope, k=_BUDGET_DEPTH)
            self.budgeted[name].add_scores(
                category,
                _score(_within(deep, budget5, counter), evidence, dia_of, counter),
                _score(_within(deep, budget10, counter), evidence, dia_of, counter),
            )

    def report(self) -> dict[str, Any]:
        report = self.tallies["keel"].full()
        report["baselines"] = {name: self.tallies[name].full() for name in self.budgeted}
        report["at_keel_budget"] = {name: tally.full() for name, tally in self.budgeted.items()}
        for row in report["at_keel_budget"].values():
            # Latency belongs to the search, reported with the baselines at k.
            row.pop("search_ms_p50", None)
            row.pop("search_ms_p95", None)
        keel = self.tallies["keel"]
        report["per_conversation"] = {
            name: round(
                statistics.fmean(
                    row["r10"]
                    for row, owner in zip(keel.rows, keel.conversations, strict=True)
                    if owner == name
                ),
                4,
            )
            for name in self.questions
            if name in keel.conversations  # a conversation without questions has no recall
        }
        report["dropped_evidence_ids"] = self.dropped_evidence
        report["questions_without_evidence"] = self.skipped_questions
        return report


def run_locomo(
    path: str | Path,
    *,
    embedder: Embedder,
    token_model: str = "gpt-4o",
    config: RetrievalConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    store: Callable[[], MemoryStore] | None = None,
    cv: bool = False,
    max_tokens: float = 1000.0,
) -> dict[str, Any]:
    """Run the benchmark on a LoCoMo-format file; returns the JSON-able report.

    ``store`` makes the (empty) store to fill; by default memory's store on a fresh SQLite
    database, opened as keel opens it
    ([`memory_backends`][keel.bench.memory.memory_backends]). ``cv`` adds
    leave-one-conversation-out cross-validation of the retrieval levers
    (``cv_recall_at_10_mean``, ``cv_recall_at_10_spread``, ``cv_folds`` and ``cv``; see
    [`keel.bench._locomo_cv`][]), their constants chosen within ``max_tokens``.
    """
    conversations = load_locomo(path)
    asked = [c for c in conversations if any(q.get("category") in CATEGORY_NAMES for q in c["qa"])]
    if cv and len(asked) < 2:
        raise ConfigError("--cv needs at least two conversations with questions (one to hold out)")
    counter = counter_for(token_model, allow_estimate=True)
    default_cfg = config or RetrievalConfig()
    systems = _systems(default_cfg)
    questions_total = sum(
        1 for c in conversations for q in c["qa"] if q.get("category") in CATEGORY_NAMES
    )
    run = _LocomoRun(systems, counter, questions_total, progress)
    with (
        tempfile.TemporaryDirectory(prefix="keel-locomo-") as tmp,
        memory_backends(f"sqlite:///{Path(tmp) / 'locomo.db'}", embedder) as backends,
    ):
        opened = backends.memory
        assert opened is not None
        memory_store = opened.store if store is None else store()
        memories = {
            name: Memory(memory_store, embedder=embedder, config=cfg, token_model=token_model)
            for name, cfg in systems.items()
        }
        for number, item in enumerate(conversations):
            run.conversation(memories, number, item)
        cross = (
            _cross_validation(run, memory_store, embedder, default_cfg, token_model, max_tokens)
            if cv
            else None
        )
        if store is not None:
            memory_store.close()  # the default store closes with its backends
    report = run.report()
    report["conversations"] = len(conversations)
    report["turns"] = run.turns_total
    report["ingest_seconds"] = round(run.ingest_seconds, 1)
    report["embedding_model"] = embedder.name
    report["store"] = type(memory_store).__name__
    report["config"] = default_cfg.model_dump()
    report["data"] = str(path)
    if cross is not None:
        report["cv"] = cross
        report["cv_recall_at_10_mean"] = cross["all"]["recall_at_10_mean"]
        report["cv_recall_at_10_spread"] = cross["all"]["recall_at_10_spread"]
        report["cv_folds"] = [fold["recall_at_10"] for fold in cross["all"]["folds"]]
    return report


@dataclass(frozen=True)
class _Question:
    """One question of a conversation, with what scores it."""

    text: str
    category: int
    evidence: tuple[str, ...]
    dia_of: dict[str, str]


class _QueryCache(Embedder):
    """An embedder that embeds each distinct query once: the grid asks every question once
    per setting, and the setting never changes the query's vector."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.dimension = inner.dimension
        self._queries: dict[str, FloatArray] = {}

    def embed(self, texts: Any) -> FloatArray:
        return self.inner.embed(texts)

    def embed_one(self, text: str) -> FloatArray:
        if text not in self._queries:
            self._queries[text] = self.inner.embed_one(text)
        return self._queries[text]


class _GridScorer:
    """Scores retrieval settings on conversations already ingested, each (setting,
    conversation) searched once and remembered."""

    def __init__(
        self,
        run: _LocomoRun,
        store: MemoryStore,
        embedder: Embedder,
        base: RetrievalConfig,
        token_model: str,
    ) -> None:
        self.run = run
        self.store = store
        self.embedder = _QueryCache(embedder)
        self.base = base
        self.token_model = token_model
        self.memories: dict[Setting, Memory] = {}
        self.rows: dict[tuple[Setting, str], list[tuple[float, float, float]]] = {}

    def _memory(self, setting: Setting) -> Memory:
        if setting not in self.memories:
            config = RetrievalConfig.model_validate({**self.base.model_dump(), **dict(setting)})
            self.memories[setting] = Memory(
                self.store, embedder=self.embedder, config=config, token_model=self.token_model
            )
        return self.memories[setting]

    def _rows(self, setting: Setting, conversation: str) -> list[tuple[float, float, float]]:
        key = (setting, conversation)
        if key not in self.rows:
            memory = self._memory(setting)
            scope = self.run.scopes[conversation]
            rows: list[tuple[float, float, float]] = []
            for question in self.run.questions[conversation]:
                hits = memory.search(question.text, scope=scope, k=10)
                scored = _score(
                    hits[:10], list(question.evidence), question.dia_of, self.run.counter
                )
                rows.append((scored.recall, scored.session_recall, float(scored.tokens)))
            self.rows[key] = rows
        return self.rows[key]

    def __call__(self, setting: Setting, conversations: Any) -> Score:
        rows = [row for name in conversations for row in self._rows(setting, name)]
        if not rows:
            return Score(0.0, 0.0, 0.0, 0)
        return Score(
            recall_at_10=statistics.fmean(r[0] for r in rows),
            session_recall_at_10=statistics.fmean(r[1] for r in rows),
            tokens_at_10=statistics.fmean(r[2] for r in rows),
            questions=len(rows),
        )

    def cost(self, setting: Setting, off: Setting, every: int = 4) -> dict[str, float]:
        """Search time of ``setting`` against every lever off, timed in pairs on every
        ``every``-th question (alternating which goes first, so load on the machine falls on
        both alike); the query's vector is cached, so this is the ranking's own cost."""
        on_ms: list[float] = []
        off_ms: list[float] = []
        pairs = [
            (name, question)
            for name, questions in self.run.questions.items()
            for question in questions[::every]
        ]
        for index, (name, question) in enumerate(pairs):
            order = [(setting, on_ms), (off, off_ms)]
            for chosen, times in order if index % 2 == 0 else order[::-1]:
                memory = self._memory(chosen)
                started = time.perf_counter()
                memory.search(question.text, scope=self.run.scopes[name], k=10)
                times.append((time.perf_counter() - started) * 1000)
        return {
            "search_ms_p50": round(nearest_rank(on_ms, 0.5), 2),
            "search_ms_p95": round(nearest_rank(on_ms, 0.95), 2),
            "search_ms_p50_off": round(nearest_rank(off_ms, 0.5), 2),
            "search_ms_p95_off": round(nearest_rank(off_ms, 0.95), 2),
        }


def _cross_validation(
    run: _LocomoRun,
    store: MemoryStore,
    embedder: Embedder,
    base: RetrievalConfig,
    token_model: str,
    max_tokens: float,
) -> dict[str, Any]:
    """Each lever alone, then all of them, cross-validated over the conversations."""
    scorer = _GridScorer(run, store, embedder, base, token_model)
    # A conversation without questions would be a fold of recall 0, not a fold left out.
    names = [name for name, asked in run.questions.items() if asked]
    every = {**LEVER_GRIDS, **MEASURED_GRIDS}
    off = setting_of({k: v for grid in every.values() for k, v in grid[0].items()})
    report: dict[str, Any] = {"procedure": PROCEDURE, "max_tokens": max_tokens}
    levers: dict[str, Any] = {}
    for lever in every:
        result = cross_validate(
            scorer, names, grids=lever_alone(lever, every), max_tokens=max_tokens
        )
        result["cost"] = scorer.cost(setting_of(result["chosen_on_all"]), off)
        levers[lever] = result
    report["levers"] = levers
    # The kept levers together; the measured-only ones stay off.
    kept = {**LEVER_GRIDS, **{name: grid[:1] for name, grid in MEASURED_GRIDS.items()}}
    report["all"] = cross_validate(scorer, names, grids=kept, max_tokens=max_tokens)
    report["all"]["cost"] = scorer.cost(setting_of(report["all"]["chosen_on_all"]), off)
    report["off"] = {
        name: {
            "recall_at_10": round(scored.recall_at_10, 4),
            "session_recall_at_10": round(scored.session_recall_at_10, 4),
            "tokens_at_10": round(scored.tokens_at_10, 1),
        }
        for name in names
        if (scored := scorer(off, [name]))
    }
    report["grids"] = {name: list(grid) for name, grid in LEVER_GRIDS.items()}
    report["measured_only"] = {name: list(grid) for name, grid in MEASURED_GRIDS.items()}
    report["settings_searched"] = len(scorer.memories)
    return report


_BUDGET_DEPTH = 50
"""Hits a baseline may use within keel's budget (keel's top 10 with neighbours is at most 30
turns; the budget always binds before this)."""


@dataclass(frozen=True)
class _Scored:
    recall: float
    """Share of the question's evidence turns among the retrieved turns."""
    session_recall: float
    """Share of the sessions holding its evidence among the sessions of the retrieved turns."""
    complete: float
    tokens: int


def _session_of(dia_id: str) -> str:
    """The session of a LoCoMo turn id (``D3:12`` -> ``D3``)."""
    return dia_id.partition(":")[0]


def _within(hits: list[MemoryHit], budget: int, counter: Any) -> list[MemoryHit]:
    """The leading hits whose turns (each counted once) fit in ``budget`` tokens."""
    kept: list[MemoryHit] = []
    seen: set[str] = set()
    used = 0
    for hit in hits:
        fresh = [record for record in hit.records if record.id not in seen]
        cost = sum(counter.count_text(record.text) for record in fresh)
        if used + cost > budget:
            break
        kept.append(hit)
        seen.update(record.id for record in fresh)
        used += cost
    return kept


def _score(
    hits: list[MemoryHit], evidence: list[str], dia_of: dict[str, str], counter: Any
) -> _Scored:
    retrieved: dict[str, str] = {}
    for hit in hits:
        for record in hit.records:
            retrieved.setdefault(record.id, record.text)
    found_dia = {dia_of.get(record_id, "") for record_id in retrieved}
    found = sum(1 for dia in evidence if dia in found_dia)
    sessions = {_session_of(dia) for dia in evidence}
    found_sessions = {_session_of(dia) for dia in found_dia if dia}
    tokens = sum(counter.count_text(text) for text in retrieved.values())
    return _Scored(
        recall=found / len(evidence),
        session_recall=len(sessions & found_sessions) / len(sessions),
        complete=float(found == len(evidence)),
        tokens=tokens,
    )
