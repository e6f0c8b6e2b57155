"""The redactors of traces: every PII kind keel masks, plus credentials only traces carry.

Traces hold raw model outputs, tool arguments and tool results, which is exactly where API keys
and personal data leak. [`redact_pii`][] is the default of [`Tracer`][]: it
masks everything [`PIIMasker`][] masks (e-mail addresses, phone numbers,
payment cards, IBANs, US SSNs, IP addresses, API keys and tokens, private keys) with the same
typed placeholders memory and checkpoints hold (``<EMAIL_1>``), then what only
[`redact_secrets`][] knows. Any ``Callable[[str], str]`` can be plugged in instead through the
``redact=`` argument (an agent passes its own masking policy).

[`redact_secrets`][] is the credentials-only redactor, deliberately conservative: when a
string looks like a credential it is masked, at the cost of masking the odd harmless
look-alike. What it masks, each replaced by ``[REDACTED:<kind>]``:

- OpenAI / Anthropic style keys (``sk-...``, ``sk-proj-...``, ``sk-ant-...``)
- AWS access key ids (``AKIA...``, ``ASIA...``) and ``aws_secret_access_key = ...`` values
- GitHub tokens (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``, ``ghr_``, ``github_pat_``)
- Slack tokens (``xox[abprs]-...``), Google API keys (``AIza...``)
- ``Authorization: Bearer ...`` / ``Basic ...`` credentials
- JSON Web Tokens (``eyJ....eyJ....sig``)
- PEM private key blocks
- values of ``password=``, ``secret:``, ``api_key=``, ``token=`` ... assignments
- e-mail addresses
- card numbers (13-19 digits that pass the Luhn check)

It does not mask phone numbers, IBANs or SSNs: on its own it is not enough for traces.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any

from keel.privacy import DEFAULT_MASKER, PIIMasker, PrivacyView, mask_pii
from keel.privacy._detectors import luhn_ok

__all__ = ["RedactionMemo", "Redactor", "redact_json", "redact_pii", "redact_secrets"]

Redactor = Callable[[str], str]
"""A function that masks sensitive parts of a text and returns the masked text."""

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "private_key",
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
            re.DOTALL,
        ),
    ),
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")),
    ("api_key", re.compile(r"\bsk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}")),
    ("aws_key", re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b")),
    ("github_token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})")),
    ("slack_token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("google_key", re.compile(r"\bAIza[0-9A-Za-z_-]{30,}")),
)

# Credentials after a scheme word keep the scheme so the trace still says what was sent.
_BEARER = re.compile(r"(?i)\b(bearer\s+)([A-Za-z0-9\-._~+/]{8,}=*)")
_AUTHORIZATION = re.compile(
    r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?(?:basic\s+|token\s+|bearer\s+)?)"
    r"([A-Za-z0-9\-._~+/]{8,}=*)"
)
_ASSIGNMENT = re.compile(
    r"""(?ix)
    (["']?\b(?:password|passwd|pwd|secret|client_secret|api[_-]?key|apikey|access[_-]?token
        |refresh[_-]?token|auth[_-]?token|private[_-]?key|aws_secret_access_key)["']?
    \s*[:=]\s*)
    ("[^"\n]+"|'[^'\n]+'|[^\s"',;}]{4,})
    """
)


_PLACEHOLDER = re.compile(r"[\"']?<[A-Z][A-Z0-9_]*_\d+>[\"']?")


def _assignment(match: re.Match[str]) -> str:
    value = match.group(2)
    if _PLACEHOLDER.fullmatch(value):  # masked already (``<SECRET_1>``): the vault's to reveal
        return match.group(0)
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group(1)}{quote}[REDACTED:secret]{quote}"


_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_CARD = re.compile(r"\b\d(?:[ -]?\d){12,18}\b")


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"[ -]", "", match.group(0))
    return "[REDACTED:card]" if 13 <= len(digits) <= 19 and luhn_ok(digits) else match.group(0)


# Cheap substring checks that gate each regex: Python's regex engine costs ~0.1 us per
# character per pattern, while ``in`` is memchr-fast, so clean text (the common case, e.g. large
# tool results) is scanned once per needle instead of once per pattern.
_NEEDLES: dict[str, tuple[str, ...]] = {
    "private_key": ("PRIVATE KEY",),
    "jwt": ("eyJ",),
    "api_key": ("sk-",),
    "aws_key": ("AKIA", "ASIA", "AGPA", "AIDA", "AROA"),
    "github_token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    "slack_token": ("xox",),
    "google_key": ("AIza",),
}
_ASSIGNMENT_NEEDLES = ("pass", "pwd", "secret", "key", "token")
_DIGITS_TO_ZERO = str.maketrans("123456789", "000000000")


def redact_secrets(text: str) -> str:
    """``text`` with credentials, e-mail addresses and card numbers masked.

    The built-in fallback redactor of keel's traces (see the module docstring for the list).
    It never raises and is idempotent: redacting twice gives the same text.
    """
    if not text:
        return text
    for kind, pattern in _PATTERNS:
        if any(needle in text for needle in _NEEDLES[kind]):
            text = pattern.sub(f"[REDACTED:{kind}]", text)
    lowered = text.lower()
    if "bearer" in lowered:
        text = _BEARER.sub(lambda m: f"{m.group(1)}[REDACTED:credential]", text)
    if "authorization" in lowered:
        text = _AUTHORIZATION.sub(lambda m: f"{m.group(1)}[REDACTED:credential]", text)
    if any(needle in lowered for needle in _ASSIGNMENT_NEEDLES):
        text = _ASSIGNMENT.sub(_assignment, text)
    if "@" in text:
        text = _EMAIL.sub("[REDACTED:email]", text)
    # Every card number format has a run of at least four digits.
    if "0000" in text.translate(_DIGITS_TO_ZERO):
        text = _CARD.sub(_card, text)
    return text


def redact_pii(text: str) -> str:
    """``text`` with every PII kind and every credential masked: the default of traces.

    [`mask_pii`][] (PIIMasker's default policy, typed placeholders such as
    ``<EMAIL_1>`` and ``<US_SSN_1>``), then [`redact_secrets`][] for the credentials only it
    knows (``password=...`` assignments, ``Authorization: Basic ...``). Idempotent.
    """
    if not text:
        return text
    if len(text) <= _CACHED_CHARS:
        return _redact_short(text)
    return redact_secrets(mask_pii(text))


# Traces repeat the same short strings at every step (the keys and labels of the budget
# report, model names, statuses): their redaction, a pure function, is remembered.
_CACHED_CHARS = 256


@functools.lru_cache(maxsize=4096)
def _redact_short(text: str) -> str:
    return redact_secrets(mask_pii(text))


def redact_json(value: Any, redact: Redactor) -> Any:
    """``value`` (a JSON-like structure) with ``redact`` applied to every string in it.

    Mapping keys are redacted too when they are strings, since applications sometimes key
    dictionaries by e-mail address or token.
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, _CONTAINERS):
        return _redact_container(value, redact, getattr(redact, _CLEAN, _NOTHING_CLEAN))
    return value


class OwnId(str):
    """An id keel generated for its own records (a ``uuid4().hex``: 32 lower-case hex
    digits), which a run's attributes keep as it is: it holds nothing of a user's, and the
    redactor would read a run of its digits as a payment card now and then (about one id in
    5,000), which no look-up by the id would then find. Any other text passed as one is
    redacted as every attribute is."""

    __slots__ = ()


_OWN_ID = re.compile("[0-9a-f]{32}")


def redact_attributes(attributes: Mapping[str, Any] | None, redact: Callable[[Any], Any]) -> Any:
    """A run's ``attributes`` as ``redact`` (a tracer's JSON redaction) gives them, except
    the [`OwnId`][keel.tracing._redact.OwnId]s among their values: kept as they are (plain
    ``str``), after the others."""
    values = dict(attributes or {})
    own = {
        name: str(value)
        for name, value in values.items()
        if isinstance(value, OwnId) and _OWN_ID.fullmatch(value)
    }
    if not own:
        return redact(values)
    return {**redact({name: v for name, v in values.items() if name not in own}), **own}


_CONTAINERS = (dict, list, tuple)  # a tuple: ``dict | list | tuple`` is built at every call


# Numbers, booleans and null are kept as they are without a call each: a trace's budget and
# attributes are mostly these.
_SCALARS = frozenset({int, float, bool, type(None)})

_CLEAN = "keel_clean_texts"
"""The attribute of a [`RedactionMemo`][keel.tracing._redact.RedactionMemo]'s redactor that
holds the texts its policy leaves as they are: a walk over a JSON value looks each string up
there itself, a call saved per string (a trace's budget report is a hundred of them a turn,
nearly all clean)."""
_NOTHING_CLEAN: frozenset[str] = frozenset()


def _redact_container(
    value: dict[Any, Any] | list[Any] | tuple[Any, ...],
    redact: Redactor,
    clean: Collection[str],
) -> Any:
    # ``text in clean``: what ``redact`` itself answers first (the text, unchanged).
    if isinstance(value, dict):
        redacted: dict[Any, Any] = {}
        for key, item in value.items():
            kind = type(item)
            if kind is str:
                item = item if item in clean else redact(item)
            elif kind in _CONTAINER_TYPES:
                item = _redact_container(item, redact, clean)
            elif kind not in _SCALARS:
                item = redact_json(item, redact)
            if isinstance(key, str) and key not in clean:
                key = redact(key)
            redacted[key] = item
        return redacted
    return [
        item
        if type(item) in _SCALARS
        else (item if item in clean else redact(item))
        if type(item) is str
        else _redact_container(item, redact, clean)
        if type(item) in _CONTAINER_TYPES
        else redact_json(item, redact)
        for item in value
    ]


_CONTAINER_TYPES = frozenset(_CONTAINERS)


_MEMO_TEXT_CHARS = 4096
"""The longest text a [`RedactionMemo`][keel.tracing._redact.RedactionMemo] keeps: a model
step's kept messages are cut at 4,000 characters (``keel.tracing._loop.KEPT_CHARS``)."""
_MEMO_TEXTS = 1024
"""The most texts each of its stores keeps (the oldest goes first): a turn records some
hundred, most of them the same every turn (the budget report's keys, the system prompt)."""


class _Texts:
    """Texts and their redaction under one policy object, forgotten when it is another."""

    __slots__ = ("kept", "policy")

    def __init__(self) -> None:
        self.policy: object = None
        self.kept: OrderedDict[str, str] = OrderedDict()

    def under(self, policy: object) -> OrderedDict[str, str]:
        if policy is not self.policy:
            self.kept, self.policy = OrderedDict(), policy
        return self.kept


def _keep(kept: OrderedDict[str, str], text: str, masked: str) -> None:
    if len(text) <= _MEMO_TEXT_CHARS:
        if len(kept) >= _MEMO_TEXTS:
            # The oldest, in one step (a plain dict's first entry is found past every slot
            # its earlier drops emptied); another thread may have dropped it first.
            with contextlib.suppress(KeyError):
                kept.popitem(last=False)
        kept[text] = masked


class RedactionMemo:
    """A tracer's redaction, remembered for the texts that come back at every step and turn.

    Only a redactor known to be a pure function of its masking policy and the text is
    remembered: [`redact_pii`][keel.tracing.redact_pii], [`redact_secrets`][], a
    ``functools.partial(masker.mask_text, tenant_id=...)`` of a [`PIIMasker`][] (what an
    agent's tracer masks with), or a turn's [`PrivacyView.mask`][keel.privacy.PrivacyView.mask]
    (numbered through the user's vault: one placeholder per value, for the view's life). Any
    other ``Callable`` is called for every text, as it is given. What is remembered is the
    redactor's own answer for the very text, forgotten whenever the policy in force is
    another object (``PIIMasker.set_policy``): a text is never stored less masked than the
    redactor would mask it now.

    Texts the policy leaves as they are (most of a trace) are kept per policy, in ``clean``,
    which the memo of a turn's copy of the tracer shares when it masks with the same masker
    and tenant (``shared_with``): they are the same under any user's numbering. A text with
    something masked is kept per memo only, since its placeholders may be one user's.
    """

    __slots__ = ("_clean", "_masked", "_policy", "_source", "redact")

    def __init__(self, redact: Redactor, shared_with: RedactionMemo | None = None) -> None:
        self.redact = redact
        found = _policy_of(redact)
        self._source: _Source | None = None if found is None else found[0]
        self._policy: Callable[[], object] | None = None if found is None else found[1]
        self._clean: _Texts = (
            shared_with._clean
            if shared_with is not None and found is not None and shared_with._source == found[0]
            else _Texts()
        )
        self._masked = _Texts()

    def current(self) -> Redactor:
        """The redactor to use now (for one step or run header): remembering, when
        ``redact`` is one of the known policies; else ``redact`` itself."""
        if self._policy is None:
            return self.redact
        policy = self._policy()
        clean, masked_texts, redact = (
            self._clean.under(policy),
            self._masked.under(policy),
            self.redact,
        )

        def remembered(text: str) -> str:
            if text in clean:
                return text
            masked = masked_texts.get(text)
            if masked is None:
                masked = redact(text)
                _keep(clean if masked == text else masked_texts, text, masked)
            return masked

        setattr(remembered, _CLEAN, clean)
        return remembered


_Source = tuple[str, object, str | None]
"""Which policy a redactor masks with: its kind, the masker, the tenant."""


def _policy_of(redact: Redactor) -> tuple[_Source, Callable[[], object]] | None:
    """Which policy ``redact`` masks with, and what gives the policy object in force now,
    when ``redact`` is a known pure policy; None otherwise."""
    if redact is redact_pii:
        return ("pii", DEFAULT_MASKER, None), lambda: DEFAULT_MASKER.policy_for(None)
    if redact is redact_secrets:
        return ("secrets", None, None), lambda: redact_secrets
    if isinstance(redact, functools.partial):
        masker = getattr(redact.func, "__self__", None)
        if (
            isinstance(masker, PIIMasker)
            and getattr(redact.func, "__func__", None) is PIIMasker.mask_text
            and not redact.args
            and set(redact.keywords) <= {"tenant_id"}
        ):
            return _masker_policy(masker, redact.keywords.get("tenant_id"))
        return None
    view = getattr(redact, "__self__", None)
    if isinstance(view, PrivacyView) and getattr(redact, "__func__", None) is PrivacyView.mask:
        return None if view.masker is None else _masker_policy(view.masker, view.tenant_id)
    return None


def _masker_policy(
    masker: PIIMasker, tenant_id: str | None
) -> tuple[_Source, Callable[[], object]]:
    return ("mask_text", masker, tenant_id), lambda: masker.policy_for(tenant_id)
