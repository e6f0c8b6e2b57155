"""Pattern detectors for PII and secrets, each with a validator that rejects look-alikes.

Regular expressions find candidates; checksums and range checks (Luhn for payment cards,
mod-97 for IBANs, octet ranges for IPv4, SSA rules for SSNs) reject the strings that only look
like one, so order numbers, dates and version strings stay readable.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DETECTORS", "Detector", "EntityType", "Finding", "find_all", "luhn_ok"]

EntityType = str
"""An entity type name, also the placeholder's prefix (``EMAIL`` -> ``<EMAIL_1>``)."""


@dataclass(frozen=True)
class Finding:
    """One detected span of sensitive text."""

    entity: EntityType
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Detector:
    """A named pattern plus an optional validator of each match."""

    entity: EntityType
    pattern: re.Pattern[str]
    validate: Callable[[str], bool] | None = None
    priority: int = 0
    group: int = 0

    def find(self, text: str) -> list[Finding]:
        """Every validated match in ``text``."""
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


_FILE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "pdf", "txt", "js", "css"})


def _email(value: str) -> bool:
    # "logo@2x.png" is a file name, not an address.
    return value.rsplit(".", 1)[-1].lower() not in _FILE_SUFFIXES


def luhn_ok(digits: str) -> bool:
    """Whether ``digits`` (digits only) pass the Luhn check, the checksum of payment cards."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _luhn(value: str) -> bool:
    # One digit repeated passes Luhn for some lengths (sixteen zeros, thirteen sixes), but it
    # is a placeholder, not a card.
    digits = "".join(ch for ch in value if ch.isdigit())
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_ok(digits)


def _card(value: str) -> bool:
    # Separators, when present, must be consistent groups (4-4-4-4, 4-6-5) not arbitrary.
    if not _luhn(value):
        return False
    digits = "".join(ch for ch in value if ch.isdigit())
    return digits[0] in "3456"


def _iban(value: str) -> bool:
    compact = value.replace(" ", "").upper()
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    numeric = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(numeric) % 97 == 1


def _ssn(value: str) -> bool:
    area, group, serial = value.split("-")
    if area in {"000", "666"} or area.startswith("9"):
        return False
    return group != "00" and serial != "0000"


def _ipv4(value: str) -> bool:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def _ipv6(value: str) -> bool:
    if value.count(":") < 2:
        return False
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


def _phone(value: str) -> bool:
    digits = sum(ch.isdigit() for ch in value)
    if not (8 if value.startswith("+") else 10) <= digits <= 15:
        return False
    # A date or a dotted version string is not a phone number.
    return not re.fullmatch(r"\d{4}[-./]\d{2}[-./]\d{2}", value.strip())


DETECTORS: tuple[Detector, ...] = (
    Detector(
        "PRIVATE_KEY",
        re.compile(
            r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE KEY-----"
        ),
        priority=100,
    ),
    Detector(
        "JWT",
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        priority=90,
    ),
    Detector(
        "BEARER_TOKEN",
        re.compile(r"(?i)\bbearer\s+([A-Za-z0-9\-._~+/]{16,}=*)"),
        priority=85,
        group=1,
    ),
    Detector(
        "API_KEY",
        re.compile(
            r"\b(?:sk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{20,}"
            r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
            r"|gh[pousr]_[A-Za-z0-9]{36,}"
            r"|github_pat_[A-Za-z0-9_]{40,}"
            r"|xox[abposr]-[A-Za-z0-9-]{10,}"
            r"|AIza[0-9A-Za-z_-]{35}"
            r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,})"
        ),
        priority=80,
    ),
    Detector(
        "EMAIL",
        re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}\b"),
        _email,
        priority=70,
    ),
    Detector(
        "IBAN",
        re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"),
        _iban,
        priority=60,
    ),
    Detector(
        "CREDIT_CARD",
        re.compile(
            r"(?<![\d-])(?:\d{4}[ -]?){3}\d{1,7}(?![\d-])"
            r"|(?<![\d-])\d{4}[ -]?\d{6}[ -]?\d{5}(?![\d-])"
        ),
        _card,
        priority=50,
    ),
    Detector("US_SSN", re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), _ssn, priority=45),
    Detector(
        "IP_ADDRESS",
        re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])"),
        _ipv4,
        priority=40,
    ),
    Detector(
        "IP_ADDRESS",
        re.compile(r"(?<![0-9A-Za-z:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![0-9A-Za-z:])"),
        _ipv6,
        priority=40,
    ),
    Detector(
        "PHONE",
        re.compile(
            # international: +CC then digit groups; NANP: (415) 555-0198 / 415-555-0198;
            # national with a trunk 0: 07700 900123, 020 7946 0018
            r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,5}\)?){1,6}(?![\w-])"
            r"|(?<![\w+])(?:\(\d{3}\)\s?|\d{3}[ .-])\d{3}[ .-]\d{4}(?![\w-])"
            r"|(?<![\w+])0\d{2,4}[ .-]?\d{3,4}[ .-]?\d{3,4}(?![\w-])"
        ),
        _phone,
        priority=30,
    ),
)


def find_all(text: str, detectors: tuple[Detector, ...] | list[Detector]) -> list[Finding]:
    """Non-overlapping findings in text order; on overlap the higher priority, then longer, wins."""
    candidates: list[tuple[int, Finding]] = []
    for detector in detectors:
        candidates.extend((detector.priority, finding) for finding in detector.find(text))
    candidates.sort(key=lambda item: (-item[0], -(item[1].end - item[1].start), item[1].start))
    chosen: list[Finding] = []
    for _, finding in candidates:
        if any(finding.start < other.end and other.start < finding.end for other in chosen):
            continue
        chosen.append(finding)
    chosen.sort(key=lambda finding: finding.start)
    return chosen
