"""Loop detection: repeats, oscillation, repeated errors, no progress; warn, then stop."""

from __future__ import annotations

from keel.errors import LoopDetectedError
from keel.guards import GuardConfig, LoopDetector, normalize_arguments


def test_normalized_arguments_ignore_spelling_noise() -> None:
    assert normalize_arguments('{"city": "Paris ", "unit": null}') == normalize_arguments(
        {"city": "paris"}
    )
    assert normalize_arguments("{'b': 1, 'a': 2}") == normalize_arguments('{"a": 2, "b": 1}')
    assert normalize_arguments("not json  at all") == "not json at all"


def test_third_identical_call_in_the_window_is_detected_then_stops() -> None:
    detector = LoopDetector(GuardConfig(loop_window=5, loop_max_repeats=2))
    assert detector.check_call("weather", '{"city": "Paris"}') is None
    assert detector.check_call("weather", '{"city": "PARIS"}') is None
    first = detector.check_call("weather", '{"city": "Paris"}')
    assert first is not None and first.kind == "repeated_call" and not first.stop
    assert "called 3 times" in first.evidence[0]
    assert "Change approach" in first.advice()
    second = detector.check_call("weather", '{"city": "Paris"}')
    assert second is not None and second.stop
    error = second.error()
    assert isinstance(error, LoopDetectedError)
    assert any(line.startswith("earlier:") for line in error.evidence)


def test_repeats_outside_the_window_are_fine() -> None:
    detector = LoopDetector(
        GuardConfig(loop_window=3, loop_max_repeats=1, detect_oscillation=False)
    )
    assert detector.check_call("a", "{}") is None
    assert detector.check_call("b", '{"x": 1}') is None
    assert detector.check_call("c", '{"x": 2}') is None
    assert detector.check_call("a", "{}") is None  # the first "a" left the window


def test_oscillation() -> None:
    detector = LoopDetector()
    for name in ("a", "b", "a"):
        assert detector.check_call(name, "{}") is None
    signal = detector.check_call("b", "{}")
    assert signal is not None and signal.kind == "oscillation"
    assert "alternating a({}) and b({})" in signal.evidence[0]
    assert LoopDetector(GuardConfig(detect_oscillation=False)).check_call("a", "{}") is None


def test_same_error_repeated() -> None:
    detector = LoopDetector()
    assert detector.check_error("book", None) is None
    assert detector.check_error("book", "Error: no seats") is None
    signal = detector.check_error("book", "Error:  no seats")
    assert signal is not None and signal.kind == "repeated_error"
    assert detector.check_error("other", "Error: no seats") is None


def test_no_progress_needs_n_unchanged_fingerprints() -> None:
    detector = LoopDetector(GuardConfig(max_steps_without_progress=3))
    assert detector.check_progress("v1") is None
    assert detector.check_progress("v2") is None
    assert detector.check_progress("v2") is None
    signal = detector.check_progress("v2")
    assert signal is not None and signal.kind == "no_progress" and not signal.stop
    again = detector.check_progress("v2")
    assert again is not None and again.stop
