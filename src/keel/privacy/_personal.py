"""Personal data found by its label or its place: a date of birth, a passport or driver's
licence number, a street address, a person's name.

None of these has a shape of its own (a date is a date, nine digits are nine digits, "Jane" is
a word), so each is found where the text says what it is: after "DOB:", "born on", "passport
no.", "driver's license #", "my name is", ``"first_name": "..."``; a street address by its
own parts (a number, capitalised words, a street type: "42 Baker Street", "1600 Pennsylvania
Ave NW") and a cue on its line ("I live at", ``"address1":``, "ship to") or a city, state
and ZIP after it. Only the value is masked; the label stays, so the text still says what
was given.

A name is masked word by word (``<PERSON_1> <PERSON_2>``), so a model can still give a tool a
first and a last name apart; a street address is masked as its street line (number, street,
type), so its unit, city and ZIP stay apart as forms and tools ask for them. No model reads
the text: a name no label introduces ("Hi, I'm Jane") is not found (Presidio's recogniser,
``PrivacyPolicy(presidio=True)``, finds those).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from keel.privacy._matching import Detector, Finding, LabelledDetector, lower_case

__all__ = ["PERSONAL_DETECTORS", "open_personal_value"]

# --- a date of birth ---------------------------------------------------------------------------

_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_ORDINAL = r"(?:st|nd|rd|th)?"
_DOB_LABEL = (
    r"(?<![a-z0-9])(?:d\.?o\.?b\.?|date[ \t_\-]?of[ \t_\-]?birth|birth[ \t_\-]?(?:date|day)"
    r"|born(?:[ \t]+on)?)"
)
_DOB = re.compile(
    # The label, its closing quote, ":", "=", "is", "was" or nothing, then one date: ISO
    # (1985-03-14), numeric (14/03/1985, 3.14.85) or in words (14 March 1985, March 14th, 1985).
    rf"(?i){_DOB_LABEL}[\"']?[ \t]*(?:(?:is|was)[ \t]+|[:=][ \t]*)?[\"']?(?:the[ \t]+)?"
    r"(\d{4}([\-/.])\d{1,2}\2\d{1,2}|\d{1,2}([\-/.])\d{1,2}\3(?:\d{4}|\d{2})"
    rf"|\d{{1,2}}{_ORDINAL}[ \t]+(?:of[ \t]+)?{_MONTH}\.?,?[ \t]+\d{{4}}"
    rf"|{_MONTH}\.?[ \t]+\d{{1,2}}{_ORDINAL},?[ \t]+\d{{4}})"
    r"(?![\d\-/]|\.\d)"
)
_DIGITS = re.compile(r"\d+")


def _date_of_birth(value: str) -> bool:
    """A date that can be one: a day and a month in range either way round (03/14 and 14/03
    are both written), a four-digit year from 1900 to 2099."""
    numbers = [int(run) for run in _DIGITS.findall(value)]
    if len(numbers) == 2:  # in words: the day, the year
        day, year = numbers
        return 1 <= day <= 31 and 1900 <= year <= 2099
    if len(numbers) != 3:
        return False
    if len(_DIGITS.findall(value)[0]) == 4:  # ISO: year, month, day
        year, month, day = numbers
        return 1900 <= year <= 2099 and 1 <= month <= 12 and 1 <= day <= 31
    first, second, year = numbers
    if year >= 100 and not 1900 <= year <= 2099:
        return False
    return (1 <= first <= 12 and 1 <= second <= 31) or (1 <= second <= 12 and 1 <= first <= 31)


# --- a passport or driver's licence number -----------------------------------------------------

_NUMBER_WORD = r"(?:[ \t_\-]?(?:number|num|no\.?|nr\.?|#|id))?"
_DOCUMENT_SEPARATOR = r"[\"']?[ \t]*(?:(?:is|was)[ \t]+|[:=#][ \t]*)?[\"']?"
_PASSPORT = re.compile(
    rf"(?i)(?<![a-z0-9])passport{_NUMBER_WORD}{_DOCUMENT_SEPARATOR}"
    r"([A-Z0-9]{6,9})(?![A-Za-z0-9\-])"
)
_DRIVER_LICENSE = re.compile(
    rf"(?i)(?<![a-z0-9])(?:driver['\u2019]?s?|driving)[ \t_\-]?licen[cs]e{_NUMBER_WORD}"
    rf"{_DOCUMENT_SEPARATOR}([A-Z0-9][A-Z0-9\-]{{3,18}}[A-Z0-9])(?![A-Za-z0-9\-])"
)


def _passport(value: str) -> bool:
    """Digits for the most part ("X1234567", "C01X00T47", "123456789"): "expired",
    "ABCDEFGH" or "current" are words after the label, not a number."""
    digits = sum(char.isdigit() for char in value)
    return digits >= 4 and len(value) - digits <= 3


def _licence(value: str) -> bool:
    return sum(char.isdigit() for char in value) >= 4


# --- a street address --------------------------------------------------------------------------

_STREET_TYPES = (
    *("Street", "St", "Avenue", "Ave", "Av", "Road", "Rd", "Boulevard", "Blvd", "Lane", "Ln"),
    *("Drive", "Dr", "Court", "Ct", "Way", "Place", "Pl", "Terrace", "Ter", "Circle", "Cir"),
    *("Highway", "Hwy", "Parkway", "Pkwy", "Square", "Sq", "Loop", "Trail", "Trl", "Crescent"),
    *("Close", "Row", "Alley", "Plaza", "Walk", "Pike", "Expressway", "Freeway", "Mews"),
)
_STREET_TYPE = "|".join(
    sorted({form for name in _STREET_TYPES for form in (name, name.upper())}, key=len, reverse=True)
)
_STREET_LINE_CHARS = 64
_ADDRESS = re.compile(
    # A house number (221, 221B, 12-14) not inside a longer token, one to four capitalised
    # words (or an ordinal: "5th"), a street type, and a compass point after it ("NW").
    r"\d(?<![\w.\-/:#$]\d)\d{0,5}[A-Za-z]?(?:-\d{1,5}[A-Za-z]?)?,?[ \t]+"
    r"(?:(?:[A-Z][A-Za-z'\u2019\-]*\.?|\d{1,3}(?:st|nd|rd|th))[ \t]+){1,4}"
    rf"(?:{_STREET_TYPE})\.?(?:[ \t]+(?:NE|NW|SE|SW|N|S|E|W)\.?)?(?![\w'\u2019\-])"
)
_ADDRESS_TAIL = re.compile(
    # What may follow a street line: a unit ("Apt 4B", "Suite 569"), or a city then a US
    # state and ZIP ("Springfield, IL 62704") or a UK postcode ("London NW1 6XE").
    r",?[ \t]*(?:(?:Apt|Apartment|Suite|Ste|Unit|Flat|Floor|Fl|Room|#)\.?[ \t]*[A-Za-z0-9\-]+"
    r"|,[ \t]*(?:[A-Z][A-Za-z'\u2019\-]+[ \t]+){0,2}[A-Z][A-Za-z'\u2019\-]+,?[ \t]+"
    r"(?:[A-Z]{2}[ \t]+\d{5}(?:-\d{4})?|[A-Z]{1,2}\d[A-Z\d]?[ \t]*\d[A-Z]{2})(?![\w\-]))"
)
_ADDRESS_CUES = frozenset(
    {
        *("address", "addr", "address1", "address2", "addressline1", "street", "billing"),
        *("live", "lives", "lived", "living", "located", "location", "reside", "resides"),
        *("residence", "home", "house", "apartment", "office", "stay", "staying", "visit"),
        *("ship", "shipping", "shipped", "deliver", "delivered", "delivery", "send", "sent"),
        *("mail", "mailing", "move", "moved", "moving", "at", "to", "from", "near"),
    }
)
_CUE_CHARS = 48
_WORDS = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class _AddressDetector(Detector):
    """A street line with a cue just before it on its line ("I live at", ``"address1":``,
    "ship to") or a unit, a city and ZIP after it: "2 Google Drive files" is no address."""

    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        for match in self.pattern.finditer(text):
            start, end = match.span()
            if end - start > _STREET_LINE_CHARS:
                continue
            if _ADDRESS_TAIL.match(text, end) is None and not _address_cue(text, start):
                continue
            found.append(Finding(self.entity, start, end, match.group()))
        return found


def _address_cue(text: str, start: int) -> bool:
    line_start = text.rfind("\n", max(0, start - _CUE_CHARS), start) + 1
    context = text[max(line_start, start - _CUE_CHARS) : start].lower()
    return any(word in _ADDRESS_CUES for word in _WORDS.findall(context))


# --- a person's name ---------------------------------------------------------------------------

_NAME_LABEL = (
    # Whose name, or which: "my name", "customer's name", "first_name", "lastName", "surname".
    r"(?<![a-z0-9])(?:(?:my|his|her|their|(?:customer|client|patient|user|passenger|guest"
    r"|account[ \t_\-]?holder|card[ \t_\-]?holder)(?:['\u2019]?s)?|full|first|last|given|family"
    r"|middle|legal|maiden|sur)[ \t_\-]?)name"
)
_NAME_WORD = r"[^\W\d_](?:[^\W_]|['\u2019\-](?=[^\W\d_]))*"
_NAME_REST = (
    # What follows "name": "is", "was", ":" or "=", a quote, then up to five words.
    rf"(?:[ \t]+(?:is|was)[ \t]*:?|[\"']?[ \t]*[:=])[ \t]*[\"']?"
    rf"({_NAME_WORD}(?:[ \t]+{_NAME_WORD}){{0,4}})"
)
_NAME = re.compile(rf"(?i){_NAME_LABEL}{_NAME_REST}")
_NAME_AFTER_LABEL = re.compile(rf"(?i){_NAME_REST}")
_NAME_QUALIFIED = re.compile(rf"(?i){_NAME_LABEL[: -len('name')]}\Z")
"""A name's label up to "name", ending where the text is cut (`_NameDetector.labelled`)."""
_BEFORE_QUALIFIED_NAME = frozenset("abcdefghijklmnopqrstuvwxyz \t_-")
_PARTICLES = frozenset(
    {"van", "von", "de", "del", "della", "der", "den", "da", "di", "du", "la", "le", "bin", "al"}
)
_NOT_A_NAME = frozenset(
    {
        *("not", "unknown", "none", "null", "nil", "anonymous", "tbd", "n", "na", "redacted"),
        *("required", "optional", "string", "str", "text", "any", "list", "annotated", "field"),
        *("the", "a", "an", "and", "or", "but", "so", "this", "that", "here", "there", "it"),
    }
)
_NAME_WORD_RUN = re.compile(_NAME_WORD)
_SELF_NAMED = re.compile(
    # "I am Yusuf Rossi", "I'm Jane Doe": a first and a last name (one capitalised word after
    # "I am" is as often a nationality or a mood: "I am American", "I'm Sorry").
    rf"(?<![A-Za-z0-9])I(?:[ \t]+am|['\u2019]m)[ \t]+({_NAME_WORD}(?:[ \t]+{_NAME_WORD}){{1,4}})"
)


def _in_code(text: str, end: int) -> bool:
    """Whether the word that ends at ``end`` is code: a type or a call (``Optional[str]``,
    ``Column(...)``), an assignment, a generic, an attribute's owner (``Foo.bar``). Read from
    the character right after the word only, so a word's fate never waits on later words."""
    after = text[end : end + 1]
    return after in ("[", "(", "=", "<") or (after == "." and text[end + 1 : end + 2].isalnum())


@dataclass(frozen=True)
class _NameDetector(LabelledDetector):
    """The capitalised words after a name's label, each its own finding (a first name and a
    last name stay apart for a tool that takes them apart), and the same words wherever else
    the text holds them; the run ends at the first word in lower case that is not a particle
    ("van der"), and a type or a call in code (``first_name: Optional[str]``, ``last_name =
    Column(...)``) is no name."""

    min_words: int = 1
    """Fewer capitalised words than this after the label are no name."""

    qualified: re.Pattern[str] | None = None
    """For the label that ends with "name" ("my name", "first_name"): what stands before the
    word, up to it. Every "name" is found with `str.find`, and only there what is before it
    and after it is read (`labelled`): ``pattern`` tried at every start before it costs tens
    of microseconds a label."""

    def labelled(self, text: str) -> list[Finding]:
        """The runs of words after a label: what ``pattern.finditer`` finds, group 1."""
        lowered = lower_case(text)
        if self.qualified is None or len(lowered) != len(text):
            return LabelledDetector.find(self, text)
        word = self.words[0]
        found: list[Finding] = []
        matched_to = 0  # as finditer: the next match starts after the one before
        at = lowered.find(word)
        while at != -1:
            # A qualifier ends right before the word or one separator before it: a quote
            # there (a JSON key, "name") is none.
            rest = None
            if at > 0 and lowered[at - 1] in _BEFORE_QUALIFIED_NAME:
                rest = _NAME_AFTER_LABEL.match(text, at + len(word))
            if rest is not None:
                label = self.qualified.search(text, max(matched_to, at - self.reach), at)
                if label is not None:
                    found.append(Finding(self.entity, rest.start(1), rest.end(1), rest.group(1)))
                    matched_to = rest.end()
            at = lowered.find(word, max(at + 1, matched_to))
        return found

    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        for whole in self.labelled(text):
            words = [
                (match.start() + whole.start, match.group())
                for match in _NAME_WORD_RUN.finditer(whole.text)
            ]
            kept: list[tuple[int, str]] = []
            for start, word in words:
                if _in_code(text, start + len(word)):
                    break  # a type, a call, an attribute: the run ends before it
                if len(word) > 1 and word[0].isupper() and word.lower() not in _NOT_A_NAME:
                    kept.append((start, word))
                elif word.lower() not in _PARTICLES or not kept:
                    break
            if len(kept) < self.min_words:
                continue
            found.extend(
                Finding(self.entity, start, start + len(word), word) for start, word in kept
            )
        if not found:
            return found
        # A name given once is the same name where the text says it again ("My name is Jane
        # Doe. ... Regards, Jane"), on any of its lines, after it was given: a text streamed
        # is masked as it comes (`StreamMasker`), and what came before was shown before.
        given: dict[str, int] = {}
        for finding in found:
            given.setdefault(finding.text, finding.start)
        again = re.compile(
            r"(?<![\w\-'\u2019])(?:"
            + "|".join(sorted(map(re.escape, given), key=len, reverse=True))
            + r")(?![\w\-'\u2019])"
        )
        labelled = {finding.start for finding in found}
        found.extend(
            Finding(self.entity, match.start(), match.end(), match.group())
            for match in again.finditer(text, min(given.values()) + 1)
            if match.start() > given[match.group()] and match.start() not in labelled
        )
        found.sort(key=lambda finding: finding.start)
        return found


PERSONAL_DETECTORS: tuple[Detector, ...] = (
    LabelledDetector(
        "DATE_OF_BIRTH",
        _DOB,
        _date_of_birth,
        priority=65,
        group=1,
        line_bound=True,
        words=("dob", "d.o.b", "birth", "born"),
        reach=9,  # "date of birth": the match starts 9 characters before "birth"
    ),
    LabelledDetector(
        "PASSPORT",
        _PASSPORT,
        _passport,
        priority=65,
        group=1,
        line_bound=True,
        words=("passport",),
    ),
    LabelledDetector(
        "DRIVER_LICENSE",
        _DRIVER_LICENSE,
        _licence,
        priority=65,
        group=1,
        line_bound=True,
        words=("driver", "driving"),
        needs=("licen",),
    ),
    _AddressDetector("ADDRESS", _ADDRESS, priority=35, line_bound=True),
    _NameDetector(
        "PERSON",
        _NAME,
        priority=35,
        group=1,
        line_bound=True,  # a text holds a name only if one of its lines gives one a label
        qualified=_NAME_QUALIFIED,
        words=("name",),
        after=re.compile(r"(?:[ \t]+(?:is|was)[ \t:]|[\"']?[ \t]*[:=])"),
        # The longest label before "name": "account_holder's " (17 characters).
        reach=18,
    ),
    _NameDetector(
        "PERSON",
        _SELF_NAMED,
        priority=35,
        group=1,
        line_bound=True,
        words=("i am ", "i'm ", "i\u2019m "),
        min_words=2,
    ),
)


# --- what a stream holds back -------------------------------------------------------------------

_OPEN_ADDRESS = re.compile(
    # A house number then words that start with a capital, a digit or "#", apart by spaces
    # and commas, up to the end (a street type, a unit, a city and a ZIP may be on their
    # way; a word in lower case ends it), the last word perhaps cut short.
    r"\d(?<![\w.\-/:#$]\d)\d{0,5}[A-Za-z]?(?:-\d{1,5}[A-Za-z]?)?"
    r"(?:[ \t,]+[A-Z0-9#][\w'\u2019\-.#]*){0,10}[ \t,]*[\w'\u2019\-.#]*\Z"
)
_OPEN_DATE_OF_BIRTH = re.compile(
    # A label then up to 24 characters a date is made of: its year may be on its way.
    rf"(?i){_DOB_LABEL}[\"']?[ \t]*(?:(?:is|was)[ \t]+|[:=][ \t]*)?[\"']?[\w ,.\-/]{{0,24}}\Z"
)
_OPEN_SELF_NAMED = re.compile(
    # "I am" and one word, and what has come of the next: a last name may be on its way.
    rf"(?<![A-Za-z0-9])I(?:[ \t]+am|['\u2019]m)[ \t]+{_NAME_WORD}(?:[ \t]+[\w'\u2019\-]*)?\Z"
)
_OPEN_TAIL_CHARS = 128


def open_personal_value(folded: str) -> int | None:
    """Where a value that spans words and may still be unfinished starts near the end of
    ``folded`` (a text as the detectors read it), else None: a street line whose type has
    not come yet ("I live at 42 Baker"), a date of birth in words whose year has not
    ("born on March 14,"), a name after "I am" whose last name has not ("I am Yusuf"). A
    stream holds it back (`StreamMasker`), as it holds an open
    quoted credential."""
    begin = max(0, len(folded) - _OPEN_TAIL_CHARS)
    starts = []
    if any(char.isdigit() for char in folded[begin:]):
        address = _OPEN_ADDRESS.search(folded, begin)
        if address is not None:
            starts.append(address.start())
    lowered = folded[begin:].lower()
    if "i am " in lowered or "i'm " in lowered or "i\u2019m " in lowered:
        named = _OPEN_SELF_NAMED.search(folded, begin)
        if named is not None:
            starts.append(named.start())
    if "birth" in lowered or "born" in lowered or "dob" in lowered or "d.o.b" in lowered:
        date = _OPEN_DATE_OF_BIRTH.search(folded, begin)
        if date is not None:
            starts.append(date.start())
    return min(starts) if starts else None
