"""How a pattern becomes findings: `Finding`, `Detector`, and `LabelledDetector` (a pattern
tried only where one of its label's words stands)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Detector", "EntityType", "Finding", "LabelledDetector", "lower_case"]

_LAST_LOWERED: tuple[str, str] = ("", "")


def lower_case(text: str) -> str:
    """``text.lower()``, kept for the last text: the labelled detectors each read the lower
    case of the one text the masker hands them in turn."""
    global _LAST_LOWERED
    last = _LAST_LOWERED  # one read: another thread may replace the pair, never half of it
    if last[0] is text:
        return last[1]
    lowered = text.lower()
    _LAST_LOWERED = (text, lowered)
    return lowered


EntityType = str
"""An entity type name, also the placeholder's prefix (``EMAIL`` -> ``<EMAIL_1>``)."""


@dataclass(frozen=True)
class Finding:
    """One detected span of sensitive text.

    ``text`` is the span as written; ``value`` the value as the detectors read it (`fold`:
    JSON escapes decoded, invisible characters left out, fullwidth digits as ASCII): the same
    value written two ways has one ``value``, which the masker numbers and a vault keeps.
    ``folded`` holds it where it differs from ``text`` (else it is empty: a finding is made
    for every match of every detector, and most read as written)."""

    entity: EntityType
    start: int
    end: int
    text: str
    folded: str = field(default="", compare=False)

    @property
    def value(self) -> str:
        """The value as the detectors read it."""
        return self.folded or self.text


@dataclass(frozen=True)
class Detector:
    """A named pattern plus an optional validator of each match.

    ``gate``: a pattern that every match of ``pattern`` contains, cheaper to look for (it
    starts with a literal, or fails at once where ``pattern`` tries a long alternation): a
    text without it holds no match, and ``pattern`` is not run on it. Only a gate that every
    match contains keeps the findings what they were (tests/privacy/test_detector_gates.py).

    ``line_bound``: a text holds a finding of it only if one of its lines, read alone, holds
    one, and what it finds in a line it finds in the text: no match holds a line break, no
    look-around reads one as anything but a line's end, and whether a match is kept reads
    nothing of the other lines (except to drop it, or, once a line holds a finding, to find
    the same value again in another: a name given once). The masker then knows a text holds
    nothing for it when none of its lines does (``PIIMasker`` keeps the lines it found
    clean). False, the default, for a custom detector: it is run on every text whole.

    ``continues``: for a detector whose match may run on past a line break, what the line it
    breaks from holds (a match that holds no line break is found in its line as in the text):
    in a text with no line that holds it, the detector is line-bound."""

    entity: EntityType
    pattern: re.Pattern[str]
    validate: Callable[[str], bool] | None = None
    priority: int = 0
    group: int = 0
    gate: re.Pattern[str] | None = None
    line_bound: bool = False
    continues: re.Pattern[str] | None = None

    def drops_for(self, text: str) -> bool:
        """Whether a match in one of ``text``'s lines may be dropped for what another line
        holds (a line-bound detector's only way to find less in a text than in its lines)."""
        return False

    def find(self, text: str) -> list[Finding]:
        """Every validated match in ``text``."""
        if self.gate is not None and self.gate.search(text) is None:
            return []
        found: list[Finding] = []
        for match in self.pattern.finditer(text):
            value = match.group(self.group)
            if not value:
                continue
            if self.validate is not None and not self.validate(value):
                continue
            found.append(
                Finding(self.entity, match.start(self.group), match.end(self.group), value)
            )
        return found


@dataclass(frozen=True)
class LabelledDetector(Detector):
    """A detector whose every match holds one of ``words`` (lower case), ``after`` right
    after it, and starts at most ``reach`` characters before it, at an ASCII letter that no
    ASCII letter precedes (its pattern starts with a look-behind that says so). The text's
    lower-case copy is searched for the words (``str.find``) and the pattern tried only where
    one stands: a case-insensitive alternation tried at every character of a long text costs
    milliseconds.
    It finds what ``pattern.finditer`` finds (tests/privacy/test_detector_gates.py)."""

    words: tuple[str, ...] = ()
    after: re.Pattern[str] = re.compile("")
    reach: int = 0
    needs: tuple[str, ...] = ()
    """Strings of which every match holds one (in lower case): a text with none is passed
    over before its words are looked for (none: the words alone are looked for)."""

    def find(self, text: str) -> list[Finding]:
        lowered = lower_case(text)
        if self.needs and not any(needed in lowered for needed in self.needs):
            return []
        if len(lowered) != len(text):  # a letter whose lower case is longer: read it all
            return Detector.find(self, text)
        starts: set[int] = set()
        for word in self.words:
            at = lowered.find(word)
            while at != -1:
                if self.after.match(lowered, at + len(word)):
                    # A label starts at a letter no letter precedes (every pattern's
                    # look-behind says so): only those starts are tried.
                    starts.update(
                        start
                        for start in range(max(0, at - self.reach), at + 1)
                        if "a" <= lowered[start] <= "z"
                        and (start == 0 or not "a" <= lowered[start - 1] <= "z")
                    )
                at = lowered.find(word, at + 1)
        found: list[Finding] = []
        matched_to = 0  # as finditer: the next match starts after the one before
        for start in sorted(starts):
            match = self.pattern.match(text, start) if start >= matched_to else None
            if match is None:
                continue
            matched_to = match.end()
            value = match.group(self.group)
            if value and (self.validate is None or self.validate(value)):
                found.append(
                    Finding(self.entity, match.start(self.group), match.end(self.group), value)
                )
        return found
