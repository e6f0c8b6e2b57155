"""PIIMasker: typed placeholders for PII and secrets, configurable per tenant."""

from __future__ import annotations

import contextlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import ConfigError
from keel.privacy._detectors import (
    DETECTORS,
    Detector,
    Finding,
    find_all,
    fold_map,
    fold_readings,
)

__all__ = [
    "DEFAULT_MASKER",
    "ENTITY_TYPES",
    "BatchNumbering",
    "MaskResult",
    "MaskingPolicy",
    "Numbering",
    "PIIMasker",
    "mask_pii",
    "maskable_json",
]

Numbering = Callable[[str, str], str]
"""``(entity, value) -> placeholder``: how a masker numbers what it finds (a user's vault);
``value`` as the detectors read it ([`Finding.value`][keel.privacy.Finding]: JSON escapes
decoded, invisible characters left out), so a value written two ways has one placeholder."""

BatchNumbering = Callable[[Sequence[tuple[str, str]]], list[str]]
"""``[(entity, value), ...] -> [placeholder, ...]``: a [`Numbering`][] of all of a text's
findings at once (a user's vault places them in one write)."""

ENTITY_TYPES: tuple[str, ...] = tuple(sorted({detector.entity for detector in DETECTORS}))
"""Every entity type the built-in detectors find."""


class MaskingPolicy(BaseModel):
    """What to mask for one tenant (or for everyone, as the default policy)."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = Field(
        default=True,
        description="False turns masking off entirely (an explicit, auditable choice).",
    )
    entities: frozenset[str] = Field(
        default=frozenset(ENTITY_TYPES),
        description="Entity types to mask; the others are left as written.",
    )
    allow: frozenset[str] = Field(
        default=frozenset(),
        description="Exact values never masked (a support address the agent must quote).",
    )
    presidio: bool = Field(
        default=False,
        description="Also run Microsoft Presidio's analyzer (names, locations...); "
        "requires presidio-analyzer to be importable.",
    )


class MaskResult(BaseModel):
    """A masked text and what was replaced (the originals are never persisted by keel)."""

    model_config = ConfigDict(frozen=True)

    text: str = Field(description="The text with each finding replaced by its placeholder.")
    counts: dict[str, int] = Field(
        default_factory=dict, description="Number of findings per entity type."
    )
    placeholders: dict[str, str] = Field(
        default_factory=dict,
        description="Placeholder -> entity type, e.g. {'<EMAIL_1>': 'EMAIL'}.",
    )

    @property
    def masked(self) -> bool:
        """True when anything was replaced."""
        return bool(self.placeholders)


_CACHED_RESULTS = 2048
_CACHED_POLICIES = 16
_CACHED_TEXT_CHARS = 8192


class PIIMasker:
    """Replace PII and secrets with typed placeholders (``<EMAIL_1>``, ``<API_KEY_2>``).

    The same value gets the same placeholder within one text, so "write to <EMAIL_1>, cc
    <EMAIL_2>, then <EMAIL_1> again" stays intelligible. Policies are per tenant: ``policy``
    is the default and ``tenant_policies`` overrides it for named tenants.

    Example:
        >>> PIIMasker().mask_text("mail bob@example.com")
        'mail <EMAIL_1>'
    """

    def __init__(
        self,
        policy: MaskingPolicy | None = None,
        *,
        tenant_policies: Mapping[str, MaskingPolicy] | None = None,
        extra_detectors: Iterable[Detector] = (),
    ) -> None:
        self.policy = policy or MaskingPolicy()
        self.tenant_policies: dict[str, MaskingPolicy] = dict(tenant_policies or {})
        self._extra = tuple(extra_detectors)
        self._presidio: Any = None
        self._detectors: OrderedDict[int, _PolicyDetectors] = OrderedDict()
        """The detectors of each policy, by the policy's identity (see ``_results``)."""
        # Masking is a pure function of (policy, text); the same texts come back many times
        # (a message masked by the agent, then by the tracer, then its report), so recent
        # results are kept, per policy object: a frozen model's hash hashes every field on
        # each call, its identity does not (the policy is kept, so its id stays its own).
        # Bounded in entries and in the length of the texts kept.
        self._results: OrderedDict[int, tuple[MaskingPolicy, OrderedDict[str, MaskResult]]] = (
            OrderedDict()
        )
        for candidate in (self.policy, *self.tenant_policies.values()):
            if candidate.presidio:
                self._presidio = _load_presidio()
                break

    def policy_for(self, tenant_id: str | None) -> MaskingPolicy:
        """The policy that applies to ``tenant_id``."""
        if tenant_id is not None and tenant_id in self.tenant_policies:
            return self.tenant_policies[tenant_id]
        return self.policy

    def set_policy(self, tenant_id: str, policy: MaskingPolicy) -> None:
        """Give ``tenant_id`` its own policy."""
        if policy.presidio and self._presidio is None:
            self._presidio = _load_presidio()
        self.tenant_policies[tenant_id] = policy

    def findings(self, text: str, *, tenant_id: str | None = None) -> list[Finding]:
        """The spans the policy would mask, in text order."""
        policy = self.policy_for(tenant_id)
        if not policy.enabled or not text:
            return []
        kept = self._detectors.get(id(policy))
        if kept is None or kept.policy is not policy:
            detectors = [d for d in (*DETECTORS, *self._extra) if d.entity in policy.entities]
            detectors.extend(d for d in self._extra if d.entity not in policy.entities)
            if len(self._detectors) >= _CACHED_POLICIES:
                _drop_oldest(self._detectors)
            kept = self._detectors[id(policy)] = _PolicyDetectors(policy, detectors)
        found = [] if kept.clean_by_lines(text) else find_all(text, kept.detectors)
        if policy.presidio and self._presidio is not None:
            found = _merge(found, _presidio_findings(self._presidio, text))
        allow = policy.allow
        if not allow:
            return found
        return [f for f in found if f.text not in allow and f.value not in allow]

    def mask(
        self,
        text: str,
        *,
        tenant_id: str | None = None,
        remember: bool = True,
        numbering: Numbering | None = None,
        batch_numbering: BatchNumbering | None = None,
    ) -> MaskResult:
        """Mask ``text`` under the tenant's policy.

        ``remember=False`` leaves the result out of the masker's cache: for texts that will not
        come again (each longer prefix of a streamed reply), which would only push out the
        ones that do. ``numbering`` gives each ``(entity, value)`` its placeholder (a user's
        vault: the same placeholder in every text); without it placeholders are numbered per
        text. ``batch_numbering`` does the same for all of a text's findings in one call (a
        vault stores a text's new values in one write); it is used when both are given. With
        a numbering only texts with nothing to mask are cached (most of what a trace
        records): a text that holds a value is never kept."""
        numbered = _batched(numbering, batch_numbering)
        if not remember or len(text) > _CACHED_TEXT_CHARS:
            return self._mask(text, tenant_id, numbered)
        results = self._cached(tenant_id)
        result = results.get(text)
        if result is not None and (numbered is None or not result.masked):
            return result
        result = self._mask(text, tenant_id, numbered)
        if numbered is None or not result.masked:
            if len(results) >= _CACHED_RESULTS:
                _drop_oldest(results)
            results[text] = result
        return result

    def _cached(self, tenant_id: str | None) -> OrderedDict[str, MaskResult]:
        """The kept results of the tenant's policy (per policy object, see ``__init__``)."""
        policy = self.policy_for(tenant_id)
        kept = self._results.get(id(policy))
        if kept is None or kept[0] is not policy:
            if len(self._results) >= _CACHED_POLICIES:
                _drop_oldest(self._results)
            kept = self._results[id(policy)] = (policy, OrderedDict())
        return kept[1]

    def _mask(
        self, text: str, tenant_id: str | None, numbered: BatchNumbering | None = None
    ) -> MaskResult:
        found = self.findings(text, tenant_id=tenant_id)
        if not found:
            return MaskResult(text=text)
        numbering = _numbered(text, found, numbered)
        pieces: list[str] = []
        cursor = 0
        counts: dict[str, int] = {}
        for finding in found:
            pieces.append(text[cursor : finding.start])
            pieces.append(numbering[(finding.entity, finding.folded or finding.text)])
            cursor = finding.end
            counts[finding.entity] = counts.get(finding.entity, 0) + 1
        pieces.append(text[cursor:])
        return MaskResult(
            text="".join(pieces),
            counts=counts,
            placeholders={placeholder: entity for (entity, _), placeholder in numbering.items()},
        )

    def mask_spans(
        self, text: str, *, tenant_id: str | None = None
    ) -> list[tuple[int, int, str, str]]:
        """What `mask_text` replaces in ``text`` (numbered per text, no vault): each finding's
        ``(start, end, placeholder, value)``, in text order; ``value`` names the value as
        numbered (its entity and the value as the detectors read it). A
        [`StreamMasker`][] masks the text it has not released yet with them, in the context of
        the whole text."""
        found = self.findings(text, tenant_id=tenant_id)
        if not found:
            return []
        numbering = _numbered(text, found, None)
        spans: list[tuple[int, int, str, str]] = []
        for finding in found:
            key = (finding.entity, finding.folded or finding.text)
            spans.append((finding.start, finding.end, numbering[key], "\0".join(key)))
        return spans

    def streams_by_word(self, tenant_id: str | None = None) -> bool:
        """Whether a [`StreamMasker`][] may release this policy's masked text
        word by word (``by_word``): true when only the built-in detectors run, whose findings
        that span whitespace are made of digits, capitals and separators, or are held back
        while they may be unfinished (a street line, a date of birth in words; a name is
        masked word by word). Presidio (names, places) and custom detectors may span any
        words: their text is held back instead."""
        policy = self.policy_for(tenant_id)
        return not self._extra and not (policy.presidio and self._presidio is not None)

    def mask_text(
        self,
        text: str,
        *,
        tenant_id: str | None = None,
        remember: bool = True,
        numbering: Numbering | None = None,
        batch_numbering: BatchNumbering | None = None,
    ) -> str:
        """Just the masked text (``remember``, ``numbering``, ``batch_numbering``: as
        [`mask`][])."""
        if remember and len(text) <= _CACHED_TEXT_CHARS:
            # The common case, first and inline: a text met before (a trace's keys and
            # labels, a message masked again by the tracer), kept as ``mask`` keeps it.
            policy = (
                self.policy
                if tenant_id is None
                else self.tenant_policies.get(tenant_id, self.policy)
            )
            kept = self._results.get(id(policy))
            if kept is not None and kept[0] is policy:
                result = kept[1].get(text)
                if result is not None and (
                    not result.placeholders or (numbering is None and batch_numbering is None)
                ):
                    return result.text
        return self.mask(
            text,
            tenant_id=tenant_id,
            remember=remember,
            numbering=numbering,
            batch_numbering=batch_numbering,
        ).text

    def __call__(self, text: str, *, tenant_id: str | None = None) -> str:
        return self.mask_text(text, tenant_id=tenant_id)


def _numbered(
    text: str, found: list[Finding], numbered: BatchNumbering | None
) -> dict[tuple[str, str], str]:
    """Each finding's ``(entity, value)`` and its placeholder: by ``numbered``, else
    ``<ENTITY_n>`` in order of appearance, past the placeholders ``text`` already holds."""
    # Numbered by the value as the detectors read it: written escaped, with an invisible
    # character or in fullwidth digits, it is the same value, with one placeholder.
    keys = list(
        dict.fromkeys((finding.entity, finding.folded or finding.text) for finding in found)
    )
    if numbered is not None:
        return dict(zip(keys, numbered(keys), strict=True))
    # A text masked before and written again with a new value ("<EMAIL_1> and carol@..."):
    # numbered from 1, the new value would read as the one already masked.
    taken = set(_PLACEHOLDER.findall(text)) if "<" in text else set()
    per_type: dict[str, int] = {}
    numbering = {}
    for entity, value in keys:
        number = per_type.get(entity, 0) + 1
        while (entity, str(number)) in taken:
            number += 1
        per_type[entity] = number
        numbering[(entity, value)] = f"<{entity}_{number}>"
    return numbering


_PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)_([0-9]+)>")


def _drop_oldest(kept: OrderedDict[Any, Any]) -> None:
    """Drop ``kept``'s oldest entry, in one step whatever was dropped before (a plain dict's
    first entry is found by walking past the slots its earlier drops emptied: a full cache
    of 2,048 paid for about a thousand a drop). Threads share a masker: another may have
    emptied it first."""
    with contextlib.suppress(KeyError):
        kept.popitem(last=False)


_LINES_FROM = 512
"""The shortest text whose lines the masker looks up one by one (`_PolicyDetectors`)."""
_CLEAN_LINES = 8192
"""The most lines a policy's detectors keep as found clean (the oldest goes first)."""
_LONGEST_KEPT_LINE = 2048
"""A longer line is scanned whenever it comes back, never kept: the lines kept stay bounded in
characters (16M at most a policy), whatever a tool's output holds."""
_READ_AGAIN = re.compile(r"\\\\|\\u005[cC]")
"""An escaped backslash: once decoded, a backslash is left that may start an escape the
detectors read in a second pass, and whether they make one depends on the whole text (`fold`:
an escaped quote or a ``\\uXXXX`` in another line). A line holding one is not judged alone."""


class _PolicyDetectors:
    """One policy's detectors, and the lines they were found to hold nothing in.

    A long text of many lines is often lines met before: a prompt's memories block (records
    recalled turn after turn, under their labels) or running summary, masked again each time
    a line of it changes. The text holds nothing to mask when each line holds nothing for the
    line-bound detectors (see `Detector`: what one finds in a text it finds in its lines) and
    the others find nothing in the text whole; else it is scanned whole, as it always is, so
    what is masked and how is the same either way. The lines are kept per policy object: a
    line is never taken as clean under a policy other than the one that found it so."""

    __slots__ = ("clean_lines", "continues", "detectors", "line_bound", "policy", "whole")

    def __init__(self, policy: MaskingPolicy, detectors: list[Detector]) -> None:
        self.policy = policy
        self.detectors = detectors
        self.line_bound = [d for d in detectors if d.line_bound or d.continues is not None]
        self.continues = [d.continues for d in detectors if d.continues and not d.line_bound]
        self.whole = [d for d in detectors if not d.line_bound and d.continues is None]
        # An OrderedDict: its popitem(last=False) is one call under the GIL, so threads masking
        # with one masker never see the dict change between finding the oldest line and
        # dropping it (a plain dict's next(iter(...)) then pop can raise mid-way).
        self.clean_lines: OrderedDict[str, None] = OrderedDict()

    def clean_by_lines(self, text: str) -> bool:
        """Whether ``text`` is known to hold nothing to mask from its lines (False: it may
        hold something, or is too short to look its lines up).

        The lines not met before are scanned as one text (a subset of the text's lines: a
        line-bound detector finds in the text no more than in it); a line that a match may
        continue past (``Detector.continues``) sends the text to be scanned whole; a custom
        detector scans it whole. Found clean, the new lines are kept, unless a detector may
        have dropped a finding of one line for what another holds (an id label: a line is kept
        only if it holds nothing on its own). A kept line is clean, and continues nothing."""
        if len(text) < _LINES_FROM or "\n" not in text or not self.line_bound:
            return False
        clean = self.clean_lines
        new = [line for line in dict.fromkeys(text.split("\n")) if line not in clean]
        unseen = "\n".join(new)
        if "\\" in unseen and _READ_AGAIN.search(unseen) is not None:
            return False
        # The detectors read the folded text (fullwidth letters in "bearer", a BEGIN line with a
        # no-break space, an id label after one are theirs): so do the line rules.
        # Both readings of a text whose escapes read two ways (`fold_readings`).
        readings = [folded for folded, _ in fold_readings(unseen)]
        if new and any(pattern.search(folded) for folded in readings for pattern in self.continues):
            return False
        if new and find_all(unseen, self.line_bound):
            return False
        if self.whole and find_all(text, self.whole):
            return False
        if new and not any(
            detector.drops_for(folded) for folded in readings for detector in self.line_bound
        ):
            for line in new:
                if len(line) > _LONGEST_KEPT_LINE:
                    continue
                while len(clean) >= _CLEAN_LINES:
                    try:
                        clean.popitem(last=False)
                    except KeyError:  # another thread emptied it first
                        break
                clean[line] = None
        return True


DEFAULT_MASKER = PIIMasker()
"""The default privacy policy (every built-in PII and secret type, for every tenant): the one
masker keel builds itself. An agent, a service or ``Backends.open`` that is given no masker of
its own hands this one to its state, journal, traces and memory."""


def mask_pii(text: str) -> str:
    """Mask every built-in PII and secret type in ``text`` with the default policy."""
    return DEFAULT_MASKER.mask_text(text)


def maskable_json(value: Any, *, sort_keys: bool = True) -> str:
    """``value`` as JSON to be masked (a call's arguments for its journal or an approval, a
    tool's result): characters as written, never ``\\u`` escapes, which would hide an address
    with an accent (``j\\u00f6rg@...``) or a card in fullwidth digits from every detector and
    store it as it is. Keys sorted by default: identical calls stay identical once masked.
    A lone surrogate (half of an emoji's escape pair in a model's JSON) stays escaped: UTF-8
    cannot encode it, and no store could keep the text."""
    written = json.dumps(value, sort_keys=sort_keys, ensure_ascii=False, default=str)
    if written.isascii():
        return written
    return _LONE_SURROGATE.sub(lambda found: f"\\u{ord(found[0]):04x}", written)


# In JSON's text a surrogate can only stand inside a string, where its escape means the same.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _batched(
    numbering: Numbering | None, batch_numbering: BatchNumbering | None
) -> BatchNumbering | None:
    """The numbering of a text's findings as one call (None: per text)."""
    if batch_numbering is not None or numbering is None:
        return batch_numbering
    number = numbering
    return lambda keys: [number(entity, value) for entity, value in keys]


def _load_presidio() -> Any:
    try:
        from presidio_analyzer import AnalyzerEngine  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ConfigError(
            "MaskingPolicy(presidio=True) needs presidio-analyzer (pip install presidio-analyzer "
            "and a spaCy English model); keel's built-in detectors work without it"
        ) from exc
    return AnalyzerEngine()


def _presidio_findings(engine: Any, text: str) -> list[Finding]:
    """Presidio's findings in ``text``, read as the built-in detectors read it (`fold_map`: JSON
    escapes decoded, invisible characters left out), each span moved back to ``text``'s
    positions: a name in a tool's ``ensure_ascii`` JSON (``J\\u00f6rg M\\u00fcller``) or with a
    zero-width space inside is found, a span never ends inside an escape, and the value is
    the one the built-in findings of the same text are numbered by."""
    folded, positions = fold_map(text)
    found: list[Finding] = []
    for result in engine.analyze(text=folded, language="en"):
        start, end = int(result.start), int(result.end)
        if float(result.score) < 0.5 or not 0 <= start < end <= len(folded):
            continue
        value = folded[start:end]
        if positions is not None:
            start, end = positions.span(start, end)
        written = text[start:end]
        found.append(
            Finding(str(result.entity_type), start, end, written, "" if value == written else value)
        )
    return found


def _merge(primary: list[Finding], secondary: list[Finding]) -> list[Finding]:
    merged = list(primary)
    for finding in secondary:
        if not any(finding.start < f.end and f.start < finding.end for f in merged):
            merged.append(finding)
    merged.sort(key=lambda finding: finding.start)
    return merged
