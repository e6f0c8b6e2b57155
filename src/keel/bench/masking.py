"""``keel bench masking``: what the masker finds of real values, and what it finds where none are.

Recall: Faker (``pip install faker``, in keel's ``bench`` extra) generates, per locale and from
one seed, e-mail addresses, phone numbers, payment cards (Luhn-valid) and IBANs (mod-97 valid),
each written the ways people write them:

- e-mails as Faker makes them (ASCII), with the locale's letters (``jörg.müller@bücher.de``,
  ``иван.петров@слово.ru``), with the IDN domain in punycode (``xn--``), with one Latin letter
  swapped for its Cyrillic look-alike (an "\u043e" in ``bob@example.com``), and in fullwidth forms
  (CJK locales);
- phone numbers as the locale's Faker formats them, as bare digits, and in fullwidth digits
  (CJK locales);
- cards bare, in groups of four (4-6-5 for 15 digits) with spaces or dashes, and in fullwidth
  digits; IBANs compact and in groups of four.

Each value sits in one sentence of several templates (some with a cue such as "call", some
without; Chinese and Japanese ones without spaces), with the locale's names and cities around
it. A value counts as found when the masked sentence is the sentence with exactly that value
replaced by one placeholder of its type: nothing of it left, nothing around it eaten.

False positives: text with no PII, read from this Python's standard library at run time: its
modules' source (code) and their docstrings and the language reference's topics from
``pydoc_data`` (prose), in chunks of at most 2,000 characters (a message's size). Every finding
there is counted against the masker, per 10,000 words (whitespace-separated), although a few
are real (an author's address in a module header, ``127.0.0.1``).

Throughput: the masker's time per KB (UTF-8) over all of those texts, without its cache.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.errors import ConfigError, UsageError
from keel.privacy import PIIMasker

__all__ = ["DEFAULT_LOCALES", "TARGETS", "run_masking_bench"]

DEFAULT_LOCALES: tuple[str, ...] = (
    "en_US",
    "en_GB",
    "en_IN",
    "en_AU",
    "de_DE",
    "de_CH",
    "fr_FR",
    "es_ES",
    "es_MX",
    "it_IT",
    "nl_NL",
    "pt_BR",
    "pt_PT",
    "pl_PL",
    "cs_CZ",
    "hu_HU",
    "ro_RO",
    "sv_SE",
    "da_DK",
    "no_NO",
    "fi_FI",
    "ru_RU",
    "uk_UA",
    "el_GR",
    "tr_TR",
    "he_IL",
    "ar_SA",
    "fa_IR",
    "hi_IN",
    "th_TH",
    "vi_VN",
    "id_ID",
    "ja_JP",
    "zh_CN",
    "zh_TW",
    "ko_KR",
)
"""Faker locales the corpus is generated in (36, every script keel's users write in)."""

TARGETS: dict[str, float] = {"EMAIL": 0.99, "CREDIT_CARD": 0.99, "IBAN": 0.99, "PHONE": 0.95}
"""The recall each entity type must reach (issue 44)."""

ENTITIES: tuple[str, ...] = ("EMAIL", "PHONE", "CREDIT_CARD", "IBAN")

_UNSPACED_LOCALES = frozenset({"ja_JP", "zh_CN", "zh_TW"})
_WIDE_LOCALES = frozenset({"ja_JP", "zh_CN", "zh_TW", "ko_KR"})

# (template, cue): "{value}" is the value; cue marks the templates with a word such as "call"
# before it, which a phone number in running text may need.
_TEMPLATES: dict[str, tuple[tuple[str, bool], ...]] = {
    "EMAIL": (
        ("Please write to {name} at {value} about the refund.", False),
        ("{name} <{value}>", False),
        ("contact: {value}; thanks, {name} from {city}", True),
        ("Order 48213 (2024-05-01) goes to {value}, not to the old address.", False),
    ),
    "PHONE": (
        ("Call {name} on {value} after five.", True),
        ("You can reach me at {value} tomorrow.", True),
        ("{name}, {city}, tel. {value}", True),
        ("{name} ({city}): {value}", False),
        ("Order 48213 of 2024-05-01 ships to {city}; my mobile is {value}.", True),
        ("{value} is the best number for {name}.", False),
    ),
    "CREDIT_CARD": (
        ("Charge my card {value} please.", False),
        ("{name} paid with {value} on 2024-05-01.", False),
        ("card number: {value}, expires 04/29", False),
    ),
    "IBAN": (
        ("Please wire the money to {value} by Friday.", False),
        ("IBAN: {value} ({name}, {city})", False),
        ("{name}'s account is {value}, ref. 4471.", False),
    ),
}
_UNSPACED_TEMPLATES: dict[str, tuple[str, bool]] = {
    "EMAIL": ("请发邮件到{value}谢谢。", False),
    "PHONE": ("请打电话{value}谢谢。", True),
    "CREDIT_CARD": ("卡号{value}已付款。", False),
    "IBAN": ("账户{value}已确认。", False),
}

# Latin letters and their Cyrillic look-alikes.
_HOMOGLYPHS = dict(zip("aceopxyi", "\u0430\u0441\u0435\u043e\u0440\u0445\u0443\u0456", strict=True))


@dataclass(frozen=True)
class _Sample:
    """One value in one sentence."""

    locale: str
    entity: str
    variant: str
    value: str
    prefix: str
    suffix: str
    cue: bool

    @property
    def text(self) -> str:
        return self.prefix + self.value + self.suffix


def _fullwidth(text: str) -> str:
    return "".join(
        "\u3000" if char == " " else chr(ord(char) + 0xFEE0) if "!" <= char <= "~" else char
        for char in text
    )


def _letters(text: str) -> str:
    return "".join(char for char in text.lower() if char.isalnum())


def _email_value(fake: Any, rng: random.Random, locale: str) -> tuple[str, str]:
    roll = rng.random()
    if roll < 0.35:
        return "ascii", str(fake.email())
    local = f"{_letters(fake.first_name())}.{_letters(fake.last_name())}".strip(".")
    domain = f"{_letters(fake.word()) or 'example'}.{fake.tld()}"
    if roll < 0.6 and local:
        return "unicode", f"{local}@{domain}"
    if roll < 0.75:
        try:
            ascii_domain = domain.encode("idna").decode("ascii")
        except UnicodeError:
            ascii_domain = "xn--bcher-kva.example"
        return "punycode", f"{fake.user_name()}@{ascii_domain}"
    if roll < 0.9 or locale not in _WIDE_LOCALES:
        address = str(fake.email())
        positions = [i for i, char in enumerate(address.split("@")[0]) if char in _HOMOGLYPHS]
        if not positions:
            return "ascii", address
        i = rng.choice(positions)
        return "lookalike", address[:i] + _HOMOGLYPHS[address[i]] + address[i + 1 :]
    return "fullwidth", _fullwidth(str(fake.email()))


def _phone_value(fake: Any, rng: random.Random, locale: str) -> tuple[str, str]:
    number = str(fake.phone_number())
    roll = rng.random()
    if roll < 0.15:
        bare = re.sub(r"x\d+$", "", number)
        return "bare", ("+" if bare.startswith("+") else "") + re.sub(r"\D", "", bare)
    if roll < 0.25 and locale in _WIDE_LOCALES:
        return "fullwidth", _fullwidth(number)
    return "as_generated", number


def _grouped(digits: str, sep: str) -> str:
    if len(digits) == 15:
        return sep.join((digits[:4], digits[4:10], digits[10:]))
    return sep.join(digits[i : i + 4] for i in range(0, len(digits), 4))


def _card_value(fake: Any, rng: random.Random, locale: str) -> tuple[str, str]:
    digits = str(fake.credit_card_number())
    roll = rng.random()
    if roll < 0.35:
        return "bare", digits
    if roll < 0.65:
        return "spaced", _grouped(digits, " ")
    if roll < 0.85 or locale not in _WIDE_LOCALES:
        return "dashed", _grouped(digits, "-")
    return "fullwidth", _fullwidth(_grouped(digits, " "))


def _iban_value(fake: Any, rng: random.Random, locale: str) -> tuple[str, str]:
    iban = str(fake.iban())
    if rng.random() < 0.5:
        return "compact", iban
    return "grouped", " ".join(iban[i : i + 4] for i in range(0, len(iban), 4))


_VALUES: dict[str, Callable[[Any, random.Random, str], tuple[str, str]]] = {
    "EMAIL": _email_value,
    "PHONE": _phone_value,
    "CREDIT_CARD": _card_value,
    "IBAN": _iban_value,
}


def _faker() -> Any:
    try:
        from faker import Faker
    except ImportError as exc:
        raise ConfigError(
            "keel bench masking generates its corpus with Faker: pip install 'keel-runtime[bench]' "
            "(or pip install faker)"
        ) from exc
    return Faker


def generate_samples(locales: Sequence[str], per_locale: int, seed: int) -> list[_Sample]:
    """``per_locale`` values of each entity type per locale, each in a sentence; the same for a
    given seed (and Faker version)."""
    faker_class = _faker()
    samples: list[_Sample] = []
    for index, locale in enumerate(locales):
        try:
            fake = faker_class(locale)
        except AttributeError as exc:  # Faker's answer to a locale it does not have
            raise UsageError(f"Faker has no locale {locale!r}: {exc}") from exc
        fake.seed_instance(seed * 1000 + index)
        rng = random.Random(f"{seed}:{locale}")
        for entity in ENTITIES:
            templates = list(_TEMPLATES[entity])
            if locale in _UNSPACED_LOCALES:
                templates.append(_UNSPACED_TEMPLATES[entity])
            for _ in range(per_locale):
                variant, value = _VALUES[entity](fake, rng, locale)
                template, cue = rng.choice(templates)
                filled = template.replace("{name}", str(fake.name())).replace(
                    "{city}", str(fake.city())
                )
                prefix, suffix = filled.split("{value}")
                samples.append(_Sample(locale, entity, variant, value, prefix, suffix, cue))
    return samples


def _found(sample: _Sample, masked: str) -> bool:
    """Whether ``masked`` is the sentence with exactly the value replaced by one placeholder of
    its entity type."""
    if not (masked.startswith(sample.prefix) and masked.endswith(sample.suffix)):
        return False
    middle = masked[len(sample.prefix) : len(masked) - len(sample.suffix)]
    return re.fullmatch(rf"<{sample.entity}_\d+>", middle) is not None


def _chunks(text: str, size: int = 2000) -> list[str]:
    """``text`` cut at line ends into pieces of at most about ``size`` characters."""
    pieces: list[str] = []
    current: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        if length + len(line) > size and current:
            pieces.append("".join(current))
            current, length = [], 0
        current.append(line)
        length += len(line)
    if current:
        pieces.append("".join(current))
    return pieces


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring:
                found.append(docstring)
    return found


def pii_free_texts(modules: int, seed: int) -> dict[str, list[str]]:
    """Code and prose with no PII in them, read from this Python's standard library: the source
    of ``modules`` top-level modules (chosen by ``seed``; 0: all), their docstrings, and the
    language reference's topics (``pydoc_data``), in message-sized chunks."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    every_file = sorted(stdlib.glob("*.py"))
    files = every_file
    if 0 < modules < len(every_file):
        files = sorted(random.Random(seed).sample(every_file, modules))
    code: list[str] = []
    prose: list[str] = []
    for path in files:
        source = path.read_text(encoding="utf-8", errors="replace")
        code.extend(_chunks(source))
        prose.extend(chunk for doc in _docstrings(source) for chunk in _chunks(doc))
    try:
        from pydoc_data import topics as reference
    except ImportError:  # pragma: no cover - a Python built without its docs
        topics: dict[str, str] = {}
    else:
        topics = dict(reference.topics)
    names = sorted(topics)
    if len(files) < len(every_file):  # the same share of the topics as of the modules
        share = max(1, len(names) * len(files) // len(every_file))
        names = sorted(random.Random(seed).sample(names, share))
    prose.extend(chunk for name in names for chunk in _chunks(str(topics[name])))
    return {"code": code, "prose": prose}


def _spread(misses: list[dict[str, str]], count: int) -> list[dict[str, str]]:
    """Up to ``count`` misses, one per entity type and locale first (not all from one)."""
    first: dict[tuple[str, str], dict[str, str]] = {}
    for miss in misses:
        first.setdefault((miss["entity"], miss["locale"]), miss)
    chosen = list(first.values())[:count]
    return chosen + [miss for miss in misses if miss not in chosen][: count - len(chosen)]


def _ratio(hits: int, total: int) -> float:
    return round(hits / total, 4) if total else 1.0


def run_masking_bench(
    *,
    locales: Sequence[str] = DEFAULT_LOCALES,
    per_locale: int = 60,
    modules: int = 0,
    seed: int = 44,
    misses_shown: int = 12,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Recall per entity type over a generated multilingual corpus, false positives per 10,000
    words of PII-free code and prose, and the masker's time per KB; see the module docstring."""
    say = progress or (lambda _message: None)
    say(f"seed {seed}: generating {per_locale} values per entity type in {len(locales)} locales")
    samples = generate_samples(locales, per_locale, seed)
    masker = PIIMasker()
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    by_variant: dict[str, Counter[str]] = {entity: Counter() for entity in ENTITIES}
    variant_totals: dict[str, Counter[str]] = {entity: Counter() for entity in ENTITIES}
    by_locale: dict[str, Counter[str]] = {locale: Counter() for locale in locales}
    locale_totals: dict[str, Counter[str]] = {locale: Counter() for locale in locales}
    uncued = Counter[str]()
    misses: list[dict[str, str]] = []
    masked_bytes = 0
    masking_seconds = 0.0
    for sample in samples:
        text = sample.text
        started = time.perf_counter()
        masked = masker.mask(text, remember=False).text
        masking_seconds += time.perf_counter() - started
        masked_bytes += len(text.encode())
        found = _found(sample, masked)
        totals[sample.entity] += 1
        variant_totals[sample.entity][sample.variant] += 1
        locale_totals[sample.locale][sample.entity] += 1
        if sample.entity == "PHONE" and not sample.cue:
            uncued["total"] += 1
            uncued["found"] += found
        if found:
            hits[sample.entity] += 1
            by_variant[sample.entity][sample.variant] += 1
            by_locale[sample.locale][sample.entity] += 1
        else:
            misses.append(
                {
                    "entity": sample.entity,
                    "locale": sample.locale,
                    "variant": sample.variant,
                    "value": sample.value,
                    "masked": masked,
                }
            )
    recall = {entity: _ratio(hits[entity], totals[entity]) for entity in ENTITIES}
    say("recall: " + ", ".join(f"{entity} {value}" for entity, value in recall.items()))

    say("false positives: masking PII-free code and prose from the standard library")
    corpora = pii_free_texts(modules, seed)
    fp_by_entity: Counter[str] = Counter()
    fp_by_corpus: dict[str, float] = {}
    fp_examples: list[dict[str, str]] = []
    words_total = 0
    findings_total = 0
    for name, texts in corpora.items():
        words = findings = 0
        for text in texts:
            started = time.perf_counter()
            result = masker.mask(text, remember=False)
            masking_seconds += time.perf_counter() - started
            masked_bytes += len(text.encode())
            words += len(text.split())
            for entity, count in result.counts.items():
                fp_by_entity[entity] += count
                findings += count
            if result.masked and len(fp_examples) < misses_shown:
                for finding in masker.findings(text):
                    window = text[max(0, finding.start - 30) : finding.end + 30]
                    fp_examples.append(
                        {"entity": finding.entity, "text": finding.text, "context": window}
                    )
        fp_by_corpus[name] = round(findings * 10_000 / max(1, words), 3)
        words_total += words
        findings_total += findings

    return {
        "recall": recall,
        "false_positives_per_10k_words": round(findings_total * 10_000 / max(1, words_total), 3),
        "locales": list(locales),
        "seed": seed,
        "per_locale": per_locale,
        "samples": {entity: totals[entity] for entity in ENTITIES},
        "recall_by_variant": {
            entity: {
                variant: _ratio(by_variant[entity][variant], count)
                for variant, count in sorted(variant_totals[entity].items())
            }
            for entity in ENTITIES
        },
        "phone_recall_without_cue": _ratio(uncued["found"], uncued["total"]),
        "recall_by_locale": {
            locale: {
                entity: _ratio(by_locale[locale][entity], locale_totals[locale][entity])
                for entity in ENTITIES
            }
            for locale in locales
        },
        "misses": len(misses),
        "worst_misses": _spread(misses, misses_shown),
        "pii_free_words": words_total,
        "pii_free_chunks": sum(len(texts) for texts in corpora.values()),
        "false_positives": findings_total,
        "false_positives_by_entity": dict(sorted(fp_by_entity.items())),
        "false_positives_per_10k_words_by_corpus": fp_by_corpus,
        "false_positive_examples": fp_examples,
        "mask_us_per_kb": round(masking_seconds * 1e6 / max(1.0, masked_bytes / 1024), 1),
        "targets": TARGETS,
        "targets_met": all(recall[entity] >= target for entity, target in TARGETS.items()),
    }
