"""Guards the engine enforces on every run: loops, limits, unusable replies, death spirals."""

from __future__ import annotations

from keel.guards._config import Fallback, GuardConfig
from keel.guards._loops import LoopDetector, LoopKind, LoopSignal, normalize_arguments
from keel.guards._response import (
    ResponseProblem,
    ResponseProblemKind,
    StructuredOutcome,
    check_response,
    output_json_schema,
    validate_structured,
)
from keel.guards._spiral import SpiralMonitor, SpiralSnapshot, SpiralThresholds

__all__ = [
    "Fallback",
    "GuardConfig",
    "LoopDetector",
    "LoopKind",
    "LoopSignal",
    "ResponseProblem",
    "ResponseProblemKind",
    "SpiralMonitor",
    "SpiralSnapshot",
    "SpiralThresholds",
    "StructuredOutcome",
    "check_response",
    "normalize_arguments",
    "output_json_schema",
    "validate_structured",
]
