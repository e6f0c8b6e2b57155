"""A detector's ``gate`` (a pattern every match of its own contains, looked for first) changes
what it costs, never what it finds: every match of the pattern holds the gate, and the
findings with and without it are the same."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import PIIMasker
from keel.privacy._detectors import (
    DETECTORS,
    Detector,
    Finding,
    _LabelledDetector,
    find_all,
    fold,
)

CORPUS = Path(__file__).parent / "corpus"
GATED = [detector for detector in DETECTORS if detector.gate is not None]
LABELLED = [detector for detector in DETECTORS if isinstance(detector, _LabelledDetector)]


def _corpus() -> list[str]:
    texts = []
    for name in ("positives.jsonl", "negatives.jsonl"):
        for line in (CORPUS / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(fold(str(json.loads(line)["text"])))
    return texts


# Near misses of each gated kind next to the real ones: keys, addresses, numbers cut short.
_NEAR = [
    "sk-proj-Q7wErTy8uIoP9aSdFgHj0kLzXcVb",
    "sk_live_4eC39HqLyjWDarjtT1zdp7dc rk_test_abcdefghijklmnop1234",
    "AKIAIOSFODNN7EXAMPLE ASIA1234567890ABCDEF ghp_" + "a" * 36,
    "github_pat_" + "B" * 40 + " xoxb-1234567890-abc AIza" + "x" * 35,
    "536-22-1234 078-05-1120 2026-12-07 12-34-5678 1-22-3333",
    "10.0.0.1 192.168.001.010 1.2.3 v10.0.19041.1264 3.14159",
    "fe80::1 ::1 2001:db8::8a2e:370:7334 12:30:45 a:b:c User: Question 18: item",
    "password: hunter2! DB_PASSWORD=x pwd='abc' api_key: null token = get_token() PIN is 4821",
    "postgres://u:p@ss@h:5432/d https://example.com:8080/x Authorization: Basic dXNlcjpw",
    '{"client_secret": "a b c", "passcode": "1"} my password is incorrect; passwords: 3',
    "SSN: 536221234 ssn is 536 22 1234 Social Security No. 078.05.1120 ssn 000-12-3456 SSN:1",
    "DOB: 1985-03-14 date of birth is 14 March 1985, born on Mar 3rd, 1990 born 1985 newborn 1/2/3",
    "passport no. X1234567 Passport Number: 123456789 passports: 12 passport is expired",
    "driver's license: D1234567 driving licence number MORGA753116SM9IJ drivers: 4 license: A1234",
    'my name is Jane Doe "first_name": "Yusuf" lastName = Column() your name is required names',
    "I am Yusuf Rossi, I'm Jane, xI am Bo Li; the customer's name: Wei; account_holder_name=Al Bo",
    "my my name is Al; surname surname: Bo; first name is name is Jo; user name: first_name: Li",
]


def _misses(detector: Detector, text: str) -> list[str]:
    """The matches of ``detector``'s pattern in ``text`` that do not hold its gate."""
    assert detector.gate is not None
    return [
        match.group(0)
        for match in detector.pattern.finditer(text)
        if detector.gate.search(match.group(0)) is None
    ]


def test_the_gated_detectors_are_the_costly_ones() -> None:
    assert {d.entity for d in GATED} == {"API_KEY", "US_SSN", "IP_ADDRESS", "SECRET"}
    assert len(GATED) == 5  # both IP address detectors, a URL's password


def test_every_match_holds_its_gate_and_the_findings_are_the_same() -> None:
    texts = [*_corpus(), *_NEAR, "\n".join(_NEAR)]
    matched = 0
    for detector in GATED:
        ungated = dataclasses.replace(detector, gate=None)
        for text in texts:
            assert _misses(detector, text) == [], (detector.entity, text)
            assert detector.find(text) == ungated.find(text), (detector.entity, text)
            matched += len(list(detector.pattern.finditer(text)))
    assert matched > 30  # the texts hold real matches of each kind, not only misses


_PIECES = st.sampled_from(
    [
        *("sk-", "sk_", "rk_", "pk_", "live_", "test_", "proj-", "AKIA", "ASIA", "gh", "p_"),
        *("github_pat_", "xox", "b-", "AIza", "A", "z", "Q7wErTy8uIoP9aSdFgHj", "-", ".", ":"),
        *("::", "1", "22", "333", "4444", "fe80", "db8", " ", "\n", "_", "x"),
        *("pass", "word", "PIN", " is ", "=", '"', "'", "://", "@", "Basic ", "token", "key"),
        *("dob", "date of birth", "born ", "passport", "driver's licen", "ce", "se", "no. "),
        *("my name", "first_", "name", "Jane", "March ", "14", "1985", "X1234567", "/", "-"),
        *("I am ", "I'm ", "customer's ", "sur", "Name", " is", ": ", "Doe", "x"),
    ]
)


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=30))
def test_generated_texts_hold_no_match_without_its_gate(pieces: list[str]) -> None:
    text = "".join(pieces)
    for detector in GATED:
        assert _misses(detector, text) == []
        assert detector.find(text) == dataclasses.replace(detector, gate=None).find(text)
    for labelled in LABELLED:
        assert _labelled_find(labelled, text) == _plain(labelled).find(text), text


def _labelled_find(detector: Detector, text: str) -> list[Finding]:
    """What a labelled detector's pattern finds where its words stand (a name's detector then
    splits it into words and looks for them again: that is not the gate's work)."""
    labelled = getattr(detector, "labelled", None)
    return labelled(text) if labelled is not None else _LabelledDetector.find(detector, text)


def _plain(detector: Detector) -> Detector:
    """``detector``'s pattern and validator run over the whole text."""
    return Detector(
        detector.entity,
        detector.pattern,
        detector.validate,
        detector.priority,
        detector.group,
        line_bound=detector.line_bound,
    )


def test_a_labelled_detector_finds_what_its_pattern_finds_over_the_whole_text() -> None:
    """It tries its pattern only where one of its words stands: never a match less."""
    # Three of credentials, an SSN, a date of birth, a passport, a licence, and a name after
    # its label or after "I am".
    assert len(LABELLED) == 9
    texts = [*_corpus(), *_NEAR, "\n".join(_NEAR), " ".join(_NEAR).upper()]
    matched = 0
    for detector in LABELLED:
        for text in texts:
            found = _labelled_find(detector, text)
            assert found == _plain(detector).find(text), (detector.pattern, text)
            matched += len(found)
    assert matched > 15


def test_a_memories_block_holds_what_the_ungated_detectors_find() -> None:
    """A block of recalled records (digits, dates, colons on every line) with one value of
    each gated kind: the masker finds what the detectors without their gates find."""
    ungated = [dataclasses.replace(d, gate=None) for d in DETECTORS]
    block = "\n".join(
        [
            "Relevant memories (from earlier sessions, most relevant first):",
            "- [episodic · 2026-12-07 · user_claim]",
            *(f"User: Question {n}: what do the records say about item {n}?" for n in range(30)),
            "- [episodic · 2026-12-07 · inferred]",
            "Assistant: the key is sk-live-Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2, SSN 536-22-1234,",
            "server 10.20.30.40 and fe80::1ff:fe23:4567:890a",
        ]
    )
    masked = PIIMasker().mask_text(block)
    for value in ("sk-live-Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2", "536-22-1234", "10.20.30.40", "fe80::1ff"):
        assert value not in masked
    found = PIIMasker().findings(block)
    assert [(f.entity, f.text) for f in found] == [
        (f.entity, f.text) for f in find_all(block, ungated)
    ]
