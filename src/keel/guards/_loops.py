"""Loop detection: repeated calls, oscillation, repeated errors, no progress.

The detector sees each proposed call *before* it runs and each result after. The first
detection in a run is a warning (the call is not run and the model is told to change approach);
the second stops the run with [`LoopDetectedError`][] carrying the evidence.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from keel._model_json import ArgumentsNotJSONError, parse_arguments
from keel.errors import LoopDetectedError
from keel.guards._config import GuardConfig

__all__ = ["LoopDetector", "LoopKind", "LoopSignal", "normalize_arguments"]

LoopKind = Literal["repeated_call", "oscillation", "repeated_error", "no_progress"]
"""Which pattern was seen."""


@dataclass(frozen=True)
class LoopSignal:
    """One detection: what pattern, the evidence, and whether the run must stop now."""

    kind: LoopKind
    evidence: tuple[str, ...]
    stop: bool

    def advice(self) -> str:
        """The system message the model gets on a first detection."""
        reasons = {
            "repeated_call": "you made the same tool call again with the same arguments",
            "oscillation": "you are alternating between the same calls without progress",
            "repeated_error": "you keep getting the same error",
            "no_progress": "the last steps did not change anything",
        }
        return (
            f"Loop detected: {reasons[self.kind]} ({'; '.join(self.evidence)}). "
            "Do not repeat it. Change approach: use the results you already have, try a "
            "different tool or different arguments, or answer the user now and say what "
            "is missing."
        )

    def error(self) -> LoopDetectedError:
        """The typed error that stops the run."""
        return LoopDetectedError(
            f"run stopped: {self.kind.replace('_', ' ')}", evidence=list(self.evidence)
        )


def normalize_arguments(raw: str | dict[str, Any]) -> str:
    """A canonical form of arguments, so that trivially different spellings compare equal.

    Keys sorted, strings trimmed and case-folded, nulls dropped; unparseable text trimmed.
    """
    if isinstance(raw, str):
        try:
            value: Any = parse_arguments(raw).value
        except ArgumentsNotJSONError:
            return " ".join(raw.split()).casefold()
    else:
        value = raw
    return json.dumps(_normalize(value), sort_keys=True, ensure_ascii=False)


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalize(item) for item in value]
    if isinstance(value, str):
        return " ".join(value.split()).casefold()
    return value


@dataclass
class LoopDetector:
    """Watches one run's tool calls, results and state fingerprints.

    Args:
        config: window, thresholds and which patterns to look for.
    """

    config: GuardConfig = field(default_factory=GuardConfig)
    detections: list[LoopSignal] = field(default_factory=list)
    _calls: deque[tuple[str, str]] = field(init=False)
    _errors: deque[str] = field(init=False)
    _fingerprints: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._calls = deque(maxlen=self.config.loop_window)
        self._errors = deque(maxlen=self.config.loop_window)

    def check_call(self, tool: str, arguments: str | dict[str, Any]) -> LoopSignal | None:
        """Look at a proposed call before it runs; a signal means: do not run it."""
        call = (tool, normalize_arguments(arguments))
        self._calls.append(call)
        window = list(self._calls)  # the newest loop_window calls, this one included
        repeats = sum(1 for seen in window if seen == call)
        if repeats > self.config.loop_max_repeats:
            return self._detect(
                "repeated_call",
                (
                    f"{tool}({_short(call[1])}) called {repeats} times in the last "
                    f"{len(window)} calls (allowed {self.config.loop_max_repeats})",
                ),
            )
        if self.config.detect_oscillation and len(window) >= 4:
            a, b, c, d = window[-4:]
            if a == c and b == d and a != b:
                return self._detect(
                    "oscillation",
                    (
                        f"alternating {a[0]}({_short(a[1])}) and {b[0]}({_short(b[1])}) "
                        "twice in a row",
                    ),
                )
        return None

    def check_error(self, tool: str, error: str | None) -> LoopSignal | None:
        """Look at a call's outcome; the same error too often in the window is a loop."""
        if error is None:
            self._errors.append("")
            return None
        normalized = f"{tool}: {' '.join(error.split()).casefold()}"
        self._errors.append(normalized)
        count = sum(1 for seen in self._errors if seen == normalized)
        if count >= self.config.max_same_error:
            return self._detect(
                "repeated_error",
                (f"{tool} failed {count} times with the same error: {_short(error, 120)}",),
            )
        return None

    def check_progress(self, fingerprint: str) -> LoopSignal | None:
        """Look at the state after a step; no change for too many steps is a loop."""
        self._fingerprints.append(fingerprint)
        needed = self.config.max_steps_without_progress
        recent = self._fingerprints[-needed:]
        if len(recent) == needed and len(set(recent)) == 1:
            return self._detect(
                "no_progress",
                (f"state unchanged for {needed} steps (fingerprint {_short(fingerprint, 40)})",),
            )
        return None

    def _detect(self, kind: LoopKind, evidence: tuple[str, ...]) -> LoopSignal:
        earlier = [f"earlier: {e}" for signal in self.detections for e in signal.evidence]
        signal = LoopSignal(
            kind=kind,
            evidence=evidence if not self.detections else (*evidence, *earlier),
            stop=bool(self.detections),
        )
        # The window is kept: repeating the pattern after the warning is the second detection.
        self.detections.append(signal)
        return signal


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
