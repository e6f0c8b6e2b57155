"""Pattern detectors for PII and secrets, each with a validator that rejects look-alikes.

Regular expressions find candidates; checksums and range checks (Luhn for payment cards,
mod-97 for IBANs, octet ranges for IPv4, SSA rules for SSNs) reject the strings that only look
like one, so order numbers, dates and version strings stay readable.

The detectors read a folded copy of the text (`fold`): fullwidth forms, digits of other
scripts, Unicode spaces and dashes become their ASCII equivalents one character for one, and
invisible format characters (zero-width space and joiners, soft hyphen, word joiner, byte order
mark: Unicode category Cf) are left out, so a card written in fullwidth digits or an address
with a zero-width space inside is found like any other, and the span replaced is the original
one, the invisible characters inside it included. Before that, JSON's string escapes are read
as the characters they stand for (`_unescaped`): a tool's output written with
``json.dumps(..., ensure_ascii=True)`` holds ``j\\u00f6rg@b\\u00fccher.example``,
``+1 415\\u0020555 0132`` or ``Bearer\\nTOKEN``, and each escape stands for one character
whose span is the whole escape; a JSON text held in a JSON string, escaped twice
(``j\\\\u00f6rg``), is decoded again, and a text whose once-decoded form still holds only short
escapes (``card\\\\n4111...``: JSON encoded twice, or ``C:\\\\nina``, a path) is read both ways
(`fold_readings`). Addresses may hold any letters
(``jörg.müller@bücher.example``, a Cyrillic letter among Latin ones). A phone number needs a
shape no count or date has (a ``+``, a trunk ``0``, ten digits in groups) or a word such as
"call" or "Telefon" just before it; bare digits the text labels as an id
(``"product_id": "4896585277"``) are an id wherever they stand in it.

Every pattern starts with a character class, not a look-behind, so the regular expression
engine skips to the positions that can start a match instead of trying each one; the masker
runs on every text of every turn.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from keel.privacy._folding import FoldMap, fold, fold_map, fold_readings
from keel.privacy._matching import Detector, EntityType, Finding
from keel.privacy._matching import LabelledDetector as _LabelledDetector
from keel.privacy._personal import PERSONAL_DETECTORS

__all__ = [
    "DETECTORS",
    "Detector",
    "EntityType",
    "Finding",
    "FoldMap",
    "find_all",
    "fold",
    "fold_map",
    "fold_readings",
    "luhn_ok",
    "open_quoted_secret",
]

# --- validators ------------------------------------------------------------------------------

_FILE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "pdf", "txt", "js", "css"})


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


def _card(value: str) -> bool:
    digits = "".join(ch for ch in value if ch.isdigit())
    # One digit repeated passes Luhn for some lengths (sixteen zeros, thirteen sixes), but it
    # is a placeholder, not a card.
    if not (12 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_ok(digits)):
        return False
    if len(digits) == 12:
        return digits[0] in "56" or digits.startswith("0604")  # Maestro, the 12-digit scheme
    # Issuer prefixes: 2 (Mastercard 2-series, Mir, JCB 2131), 3 (Amex, Diners, JCB), 4 (Visa),
    # 5-6 (Mastercard, Maestro, Discover, UnionPay), 8 (UnionPay 81), 9 (national schemes);
    # 1 only as JCB's 15-digit 1800. A millisecond timestamp (13 digits, 1...) is none of them.
    return (
        digits[0] in "2345689"
        or digits.startswith("0604")
        or (len(digits) == 15 and digits.startswith("1800"))
    )


def _iban(value: str) -> bool:
    compact = value.replace(" ", "").upper()
    # 15 (Norway) to 34 characters; 14 too, the length of the Thai account numbers Faker writes
    # as IBANs (mod-97 still decides).
    if not 14 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    numeric = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(numeric) % 97 == 1


def _ssn(value: str) -> bool:
    area, group, serial = value.split("-")
    if area in {"000", "666"} or area.startswith("9"):
        return False
    return group != "00" and serial != "0000"


# --- credentials, found by their label or their place ----------------------------------------
# A credential has no shape of its own: it is what follows "password:", "DB_PASSWORD=",
# '"api_key": "..."' or "my PIN is", or what stands between "user:" and "@host" in a URL. The
# value alone is masked; the label stays, so the text still says what was given.
_SECRET_LABEL = (
    r"(?:pass(?:word|wd|phrase|code)|pwd|secret(?:[_\-]?(?:access[_\-]?)?key)?"
    r"|client[_\-]?secret|(?:access|api|private|signing|encryption)[_\-]?key|apikey"
    r"|(?:(?:access|refresh|auth|api|session|bearer)[_\-]?)?token|credentials?)"
)
_SECRET_ASSIGNED = re.compile(
    # The label (after "DB_", "aws_" or nothing; nothing glued to it after), its closing
    # quote, ":", "=", "=>" or ":=", then the value: quoted whole, or unquoted up to a space,
    # a quote or a bracket, and not a call or an index ("get_password()", "env[...]").
    rf"(?i)(?<![a-z0-9]){_SECRET_LABEL}[\"']?[ \t]*(?::=|=>|[:=])[ \t]*[\"']?"
    r"((?<=\")[^\"\n]{3,256}(?=\")|(?<=')[^'\n]{3,256}(?=')"
    r"|(?<![\"'])[^\s\"'`,;{}<>()\[\]]{4,256}+(?![(\[]))"
)
_OPEN_QUOTED_SECRET = re.compile(
    rf"(?i)(?<![a-z0-9]){_SECRET_LABEL}[\"']?[ \t]*(?::=|=>|[:=])[ \t]*"
    r"(?:\"[^\"\n]{0,255}|'[^'\n]{0,255})\Z"
)


_QUOTED_LABEL_WORDS = ("pass", "pwd", "secret", "key", "token", "credential")


def open_quoted_secret(folded: str) -> int | None:
    """Where the quoted value of a credential whose closing quote has not come yet starts in
    ``folded`` (a text as the detectors read it), else None: a value in quotes may hold
    spaces ('"password": "correct horse battery"'), so a stream holds it back until it
    closes (`StreamMasker`)."""
    tail = folded[-320:]
    # Looked for on every piece a stream receives: a text with no quote, no ":" or "=", or
    # none of the labels' words near its end holds none (str operations, not the pattern).
    if not ('"' in tail or "'" in tail) or not (":" in tail or "=" in tail):
        return None
    lowered = tail.lower()
    if not any(word in lowered for word in _QUOTED_LABEL_WORDS):
        return None
    found = _OPEN_QUOTED_SECRET.search(folded, max(0, len(folded) - 320))
    if found is None:
        return None
    quote = max(folded.rfind('"', found.start()), folded.rfind("'", found.start()))
    return quote + 1


_SECRET_SAID = re.compile(
    # "my password is Zx9!qLmP", "the PIN was 4821": a value with a digit or a sign in it
    # (`_said_secret`), its sentence's closing punctuation left out.
    r"(?i)(?<![a-z0-9])(?:pass(?:word|phrase|code)|pin(?: code)?)[ \t]+(?:is|was)[ \t]*:?[ \t]+"
    r"([^\s\"'`<>]{3,128}?)(?=[.,;:!?)]*(?:\s|$|[\"']))"
)
_URL_PASSWORD = re.compile(
    # scheme://user:PASSWORD@host: the password may hold an "@" written unencoded (the last
    # one before the host ends it).
    r"(?i)[a-z](?<![a-z0-9+.\-][a-z])[a-z0-9+.\-]{1,20}://[^\s/?#@:]{0,128}:"
    r"([^\s/?#]{1,256})@(?=[a-z0-9\[])"
)
_BASIC_CREDENTIALS = re.compile(
    r"(?i)(?<![a-z])authorization[\"']?[ \t]*[:=][ \t]*[\"']?basic[ \t]+([A-Za-z0-9+/]{6,}={0,2})"
)
_NOT_A_SECRET = frozenset(
    {"null", "none", "nil", "true", "false", "undefined", "empty", "required", "optional"}
)
_PLACEHOLDER_SHAPE = re.compile(r"<[A-Z][A-Z0-9_]*_\d+>|\[REDACTED[^\]]*\]")
_MASKED_ALREADY = re.compile(r"[*x•.\-_ ]+")


def _assigned_secret(value: str) -> bool:
    """A value, not a word saying there is none, a variable, or a mask already applied."""
    return not (
        value.lower() in _NOT_A_SECRET
        or value.startswith(("$", "%(", "{{"))
        or _PLACEHOLDER_SHAPE.fullmatch(value) is not None
        or _MASKED_ALREADY.fullmatch(value) is not None
    )


def _said_secret(value: str) -> bool:
    """Said in a sentence ("my password is ..."): only a value with a digit or a sign in it,
    so "my password is incorrect" stays as written."""
    return _assigned_secret(value) and not value.isalpha()


_SSN_LABELLED = re.compile(
    # "SSN: 536221234", "my ssn is 536 22 1234", "Social Security No. 536.22.1234": after its
    # label, nine digits in the SSN's groups with any one separator, or none.
    r"(?i)(?<![a-z0-9])(?:ssn|social[ \t]+security(?:[ \t]+(?:number|no\.?|#))?)[\"']?[ \t]*"
    r"(?:#|no\.?|number)?[ \t]*[:=]?[ \t]*(?:(?:is|was)[ \t]+)?[\"']?"
    r"(\d{3}([ \-.]?)\d{2}\2\d{4})(?![\d\-])"
)


def _labelled_ssn(value: str) -> bool:
    digits = "".join(char for char in value if char.isdigit())
    return _ssn(f"{digits[:3]}-{digits[3:5]}-{digits[5:]}")


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


# --- e-mail ----------------------------------------------------------------------------------

# Marks that letters of Indic and other scripts carry (not \w, yet part of a name).
_MARKS = (
    "\u0300-\u036f\u0483-\u0489\u0591-\u05c7\u0610-\u061a\u064b-\u065f"  # Latin, Cyrillic...
    "\u0900-\u0903\u093a-\u094f\u0951-\u0957\u0962\u0963\u0981-\u0983\u09bc-\u09cd"  # Indic
    "\u0e31\u0e34-\u0e3a\u0e47-\u0e4e"  # Thai
)
# Read outwards from each "@": the local part is the run of its characters that ends there (at
# most 64, RFC 5321; a window of twice that), the domain the labels that start after it.
_EMAIL_LOCAL = re.compile(rf"(?<![\w.%+\-{_MARKS}])[\w.%+\-{_MARKS}]++\Z")
_EMAIL_DOMAIN = re.compile(rf"[\w\-{_MARKS}]++(?:\.[\w\-{_MARKS}]++)++")
_EMAIL_LOCAL_WINDOW = 128
# Scripts written without spaces: an address in a Chinese or Japanese sentence is delimited by
# the change of script, not by a space.
_UNSPACED = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def _email_span(value: str) -> tuple[int, int] | None:
    """The address within a candidate (offsets into ``value``), None if it is none."""
    at = value.index("@")
    start, end = 0, len(value)
    local = value[:at]
    last_unspaced = None
    for last_unspaced in _UNSPACED.finditer(local):  # noqa: B007
        pass
    if last_unspaced is not None and last_unspaced.end() < at:
        start = last_unspaced.end()
    while start < at and value[start] in ".-+%":
        start += 1
    if start == at:
        return None
    top_level = value[value.rindex(".") + 1 :]
    first_unspaced = _UNSPACED.search(top_level)
    if first_unspaced is not None and first_unspaced.start() > 0:
        end -= len(top_level) - first_unspaced.start()
        top_level = top_level[: first_unspaced.start()]
    if top_level.lower() in _FILE_SUFFIXES:  # "logo@2x.png" is a file name, not an address
        return None
    if not (top_level.startswith("xn--") or (len(top_level) >= 2 and top_level.isalpha())):
        return None
    return start, end


@dataclass(frozen=True)
class _EmailDetector(Detector):
    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        after_previous = 0  # a local part holds no "@": it starts after the one before
        at = text.find("@")
        while at != -1:
            window = max(after_previous, at - _EMAIL_LOCAL_WINDOW)
            local = _EMAIL_LOCAL.search(text, window, at)
            domain = self.pattern.match(text, at + 1)
            if local is not None and domain is not None:
                span = _email_span(text[local.start() : domain.end()])
                if span is not None:
                    start, end = local.start() + span[0], local.start() + span[1]
                    found.append(Finding(self.entity, start, end, text[start:end]))
                    after_previous, at = end, text.find("@", end)
                    continue
            after_previous, at = at + 1, text.find("@", at + 1)
        return found


# --- phone -----------------------------------------------------------------------------------

_PHONE = re.compile(
    # A "(", "+" or digit that does not continue a word, a number, an id or a version...
    # (a "+" may follow a ":": "tel:+1 415...", "phone:+44..."; a digit there is a time's)
    r"[(+\d](?<![A-Za-z0-9_+\-./#@,$%][(+\d])(?<!:[(\d])"
    # (six more digits at least, no more than three other characters apart: most numbers in
    # a text are shorter, and are dropped here rather than by the checks in Python)
    r"(?=(?:\D{0,3}\d){6})"
    r"(?:(?<=\d)|\+?\d)\d*+"
    # ...then digit groups, each after a separator: space . - / or a parenthesis ("(0)",
    # "(835) ", ") "), or " - "; possessive, so a run of digits is never re-split.
    r"(?:(?> [\-/] |\)?[ \-./]?\(?)\d++){0,9}+\)?"
    r"(?:(?:x|ext\.?)\d{1,6}+)?"  # an extension (no space: "x204", "ext.12")
    r"(?![A-Za-z0-9_@]|[.,:\-/]\d)"
)
_DIGIT_RUN = re.compile(r"\d+")
_EXTENSION = re.compile(r"(?:x|ext\.?)\d+\Z")
_DATE = re.compile(
    r"(?<!\d)(?:(?:19|20)\d\d([-./])\d{1,2}\1\d{1,2}|\d{1,2}([-./])\d{1,2}\2(?:19|20)\d\d)(?!\d)"
)
_PARENS = re.compile(r"\([^)]*\)?")
_AREA_CODE = re.compile(r"\(\+?\d{1,5}\)")
_THOUSANDS = re.compile(r"\d{1,3}(?:([ .])\d{3})(?:\1\d{3})*")
# Bare digits that are a phone number without a cue: ten digits not starting with 0 or 1 (a
# North American number, most countries' mobiles; a Unix time starts with 1), a mainland China
# mobile, a national number with its trunk 0, or an international one with its 00.
_BARE_PHONE = re.compile(r"[2-9]\d{9}|1[3-9]\d{9}|0[1-9]\d{7,10}|00[1-9]\d{8,12}")
_SSN_SHAPE = re.compile(r"\d{3}-\d{2}-\d{4}")
# The tail of a code in capitals and digits ("GB82 WEST 1234 5698 ..."): an IBAN or an account
# number the IBAN check rejected, not a phone number.
_CODE_GROUP_BEFORE = re.compile(r"(?<![A-Za-z0-9])[A-Z0-9]{4} \Z")
_PHONE_CONTEXT_CHARS = 40
# Words that say a phone number follows, lowercased: whole words, word stems, and the words of
# scripts written without spaces (found anywhere). A set lookup per word of the few words
# before a number, not one pattern of many alternatives tried at each position.
_PHONE_WORDS = frozenset(
    (
        *("call", "calls", "called", "phone", "phoned", "tel", "telephone", "mobile", "cell"),
        *("cellphone", "fax", "whatsapp", "sms", "text", "dial", "ring", "reach", "contact"),
        *("kontakt", "hotline", "number", "ph", "mob", "tlf", "tfn", "handy", "portable"),
        *("celular", "móvil", "movil", "numéro", "número", "numero", "nummer", "numer"),
        *("telefoon", "telefone", "teléfono", "telefono", "téléphone", "cep", "gsm", "nomor"),
        *("sđt", "thoại", "тел", "звоните"),
    )
)
_PHONE_WORD_STEMS = ("telefon", "puhelin", "mobil", "телефон", "номер", "τηλ")
# Scripts without spaces, or whose vowel signs split a word in two for \w+.
_UNSPACED_PHONE_WORDS = (
    *("電話", "电话", "手机", "手機", "携帯", "연락처", "전화", "휴대폰", "โทร"),
    *("טלפון", "هاتف", "تلفن", "جوال", "फ़ोन", "फोन", "मोबाइल"),
)
_WORD = re.compile(r"\w+")
# Numbers a text labels as ids: after "id", "ids", "_id", "Id" ("order id 4896585277",
# "product_id": "4896585277", productId: 4896585277), or in a list after one ("item_ids":
# ["4896585277", "7747408585"]).
_ID_LABELLED = re.compile(
    r"(?:(?<![A-Za-z])[Ii]|(?<=[a-z])I)[Dd][Ss]?[\"' :=]{0,4}"
    r"(?:\[([\d\"' ,]*)|[\"'({]{0,2}(\d{7,15})(?!\d))"
)
_ID_DIGITS = re.compile(r"\d{7,15}")


def _phone_cue(context: str) -> bool:
    """Whether ``context`` (the text just before a number, on its line) says a phone number
    follows: "call me at", "Tel.", "Telefonnummer:", "电话"."""
    for word in _WORD.findall(context.lower()):
        if word in _PHONE_WORDS or word.startswith(_PHONE_WORD_STEMS):
            return True
    return not context.isascii() and any(word in context for word in _UNSPACED_PHONE_WORDS)


def _phone_span(value: str, text: str, start: int) -> tuple[int, int, bool] | None:
    """The number within a candidate (offsets into ``value``) and whether it is one by its
    digits alone (a bare run, no cue); None if it is no phone number.

    Without a "+" or a word such as "call" just before it, it needs a shape a count, a year, a
    date, an id or a version does not have: ten digits or more in groups, a trunk "0", an area
    code in parentheses."""
    begin, end = 0, len(value)
    if value[0] == "(" and value.count("(") > value.count(")"):
        begin = 1
    if value[-1] == ")" and value.count(")") > value.count("("):
        end -= 1
    core = _EXTENSION.sub("", value[begin:end])
    groups = _DIGIT_RUN.findall(core)
    digits = sum(len(group) for group in groups)
    if not 7 <= digits <= 15:
        return None
    if len(groups) > 1 and len(groups[-1]) == 1:
        return None  # an ISBN (978-3-16-148410-0) ends in one check digit; a number does not
    if _DATE.search(core) or not all(_AREA_CODE.fullmatch(part) for part in _PARENS.findall(core)):
        return None  # a date inside, or parentheses around something else: "48213 (2024-05-01)"
    if "0123456789".find("".join(groups)) != -1:
        return None  # the digits in order: an alphabet, not a number
    longest = max(len(group) for group in groups)
    if "." in core:
        # Dots only: 881.428.6570, +61.8.8353.3740, but not an IP address (four groups of at
        # most three), a version (10.0.19041.1264), a decimal (+3.140000) or a standard's
        # number (POSIX 1003.1-1988).
        if not core.lstrip("(+").replace(".", "").isdigit() or longest > 4:
            return None
        if len(groups) == 4 and longest <= 3:
            return None
    international = core.startswith(("+", "(+"))
    if international:
        return (begin, end, False) if groups[0][0] != "0" else None  # no country code starts 0
    line_start = text.rfind("\n", max(0, start - _PHONE_CONTEXT_CHARS), start) + 1
    context = text[max(line_start, start - _PHONE_CONTEXT_CHARS) : start]
    if _phone_cue(context):  # a cue on the number's own line
        return begin, end, False
    if "." in core:
        return (begin, end, False) if digits >= 10 else None
    if len(groups[0]) == 1 and longest >= 7:
        return None  # "0 160133733": columns of a table
    if _SSN_SHAPE.fullmatch(core) or _CODE_GROUP_BEFORE.search(context):
        return None
    if len(groups) == 1:
        if start > 0 and text[start - 1] in "([{=":
            return None  # a literal in code: IPv4Address(3221225985), {2147483647: ...}
        return (begin, end, True) if _BARE_PHONE.fullmatch(core) else None
    if "(" in core:
        return (begin, end, False) if digits >= 8 else None
    if _THOUSANDS.fullmatch(core):
        return None  # 1 234 567 890: a grouped amount
    if digits >= 10 or (core[0] == "0" and (digits >= 9 or len(groups) >= 3)):
        return begin, end, False
    return None


@dataclass(frozen=True)
class _PhoneDetector(Detector):
    def drops_for(self, text: str) -> bool:
        # A bare number labelled as an id anywhere in the text is dropped wherever it stands.
        return _ID_LABELLED.search(text) is not None

    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        bare: list[Finding] = []
        for match in self.pattern.finditer(text):
            span = _phone_span(match.group(), text, match.start())
            if span is not None:
                start, end = match.start() + span[0], match.start() + span[1]
                if span[2] and text[start - 1 : start] == '"' and text[end : end + 2] == '":':
                    continue  # a bare number as a JSON object's key: an id ("5206946487": {})
                finding = Finding(self.entity, start, end, text[start:end])
                (bare if span[2] else found).append(finding)
        if bare:
            # A bare run of digits the text labels as an id somewhere is an id wherever it
            # stands in the text (a key, a list's item), unless a phone word names it there too.
            ids = {
                number
                for hit in _ID_LABELLED.finditer(text)
                for number in _ID_DIGITS.findall(hit.group(1) or hit.group(2) or "")
            }
            ids -= {finding.text for finding in found}
            found.extend(finding for finding in bare if finding.text not in ids)
            found.sort(key=lambda finding: finding.start)
        return found


# Line-bound (see ``Detector``): every built-in but a private key (``[\s\S]*?`` runs from its
# BEGIN line to its END line) and a bearer token (``\s+`` may be a line break: "Bearer" ending
# one line, the token the next), which say what the line they continue from holds
# (``continues``). The others' classes, separators and look-arounds hold no
# ``\n`` (a line break before or after reads as the text's start or end does); a phone
# number's look-ahead may read past one, but a number it accepts has its seven digits within
# itself, and an id labelled elsewhere in the text only drops a number.
DETECTORS: tuple[Detector, ...] = (
    Detector(
        "PRIVATE_KEY",
        re.compile(
            r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE KEY-----"
        ),
        priority=100,
        continues=re.compile("-----BEGIN "),  # the line it starts on
    ),
    Detector(
        "JWT",
        re.compile(r"eyJ(?<!\weyJ)[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        priority=90,
        line_bound=True,
    ),
    Detector(
        "BEARER_TOKEN",
        re.compile(r"(?i)b(?<!\wb)earer\s+([A-Za-z0-9\-._~+/]{16,}=*)"),
        priority=85,
        group=1,
        # "bearer" then only white space to the line's end: the token may be on a later line.
        continues=re.compile(r"(?i)earer\s*$", re.MULTILINE),
    ),
    Detector(
        "API_KEY",
        re.compile(
            # A prefix no word holds is found glued to the text before it ("KEYsk_live_...",
            # "idghp_..."); a bare "sk-", "AKIA" or "AIza" only at a word's start, as "task-"
            # and base64 hold them.
            r"(?:sk-(?:proj|ant|live|test)-[A-Za-z0-9_-]{20,}"
            r"|gh[pousr]_[A-Za-z0-9]{36,}"
            r"|github_pat_[A-Za-z0-9_]{40,}"
            r"|xox[abposr]-[A-Za-z0-9-]{10,}"
            r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"
            r"|\b(?:sk-[A-Za-z0-9_-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35}))"
        ),
        priority=80,
        line_bound=True,
        # Each alternative's fixed start: the pattern itself is tried at every word's start.
        gate=re.compile(r"sk-|AKIA|ASIA|gh[pousr]_|github_pat_|xox|AIza|k_(?:live|test)_"),
    ),
    Detector(
        "SECRET",
        _URL_PASSWORD,
        _assigned_secret,
        priority=95,
        group=1,
        line_bound=True,
        gate=re.compile("://"),
    ),
    _LabelledDetector(
        "SECRET",
        _BASIC_CREDENTIALS,
        priority=85,
        group=1,
        line_bound=True,
        words=("authorization",),
        needs=("basic",),
        after=re.compile(r"[\"']?[ \t]*[:=][ \t]*[\"']?basic[ \t]"),
    ),
    # Below the keys of a known shape: "OPENAI_API_KEY=sk-..." is an API_KEY. Every label
    # ends with one of the words ("secret_access_key" 14 characters before its "key").
    _LabelledDetector(
        "SECRET",
        _SECRET_ASSIGNED,
        _assigned_secret,
        priority=75,
        group=1,
        line_bound=True,
        words=(
            *("password", "passwd", "passphrase", "passcode", "pwd"),
            *("secret", "key", "token", "credential"),
        ),
        after=re.compile(r"s?[\"']?[ \t]*[:=]"),
        reach=16,
        needs=(":", "="),
    ),
    _LabelledDetector(
        "SECRET",
        _SECRET_SAID,
        _said_secret,
        priority=75,
        group=1,
        line_bound=True,
        words=("password", "passphrase", "passcode", "pin"),
        after=re.compile(r"(?: code)?[ \t]+(?:is|was)[ \t:]"),
        needs=("is", "was"),
    ),
    _EmailDetector("EMAIL", _EMAIL_DOMAIN, priority=70, line_bound=True),
    Detector(
        "IBAN",
        re.compile(
            r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?"
            r"(?![A-Za-z0-9])"
        ),
        _iban,
        priority=60,
        line_bound=True,
    ),
    Detector(
        "CREDIT_CARD",
        re.compile(
            # After a "+" it is a phone number, after a "." a decimal fraction; glued to a
            # letter on either side it is part of a code (a hex id's first digits).
            r"\d(?<![A-Za-z0-9_\-+.]\d)"
            r"(?:\d{3}(?:[ \-]?\d{4}){2}(?:[ \-]?\d{1,4}){0,2}|\d{3}[ \-]?\d{6}[ \-]?\d{4,5})"
            r"(?![A-Za-z0-9_\-])"
        ),
        _card,
        priority=50,
        line_bound=True,
    ),
    Detector(
        "US_SSN",
        re.compile(r"\d(?<![\d\-]\d)\d{2}-\d{2}-\d{4}(?![\d-])"),
        _ssn,
        priority=45,
        line_bound=True,
        gate=re.compile(r"-\d\d-\d{4}"),  # its last two groups (a date's "-12-07" is not)
    ),
    _LabelledDetector(
        "US_SSN",
        _SSN_LABELLED,
        _labelled_ssn,
        priority=45,
        group=1,
        line_bound=True,
        words=("ssn", "social"),
        needs=("ssn", "social"),
    ),
    Detector(
        "IP_ADDRESS",
        re.compile(r"\d(?<![\d.]\d)\d{0,2}(?:\.\d{1,3}){3}(?![\d.])"),
        _ipv4,
        priority=40,
        line_bound=True,
        gate=re.compile(r"\.\d"),  # a dot before a digit, not tried at every digit
    ),
    Detector(
        "IP_ADDRESS",
        re.compile(r"(?<![0-9A-Za-z:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![0-9A-Za-z:])"),
        _ipv6,
        priority=40,
        line_bound=True,
        # Its first two colons: the pattern, which may start with no hex digit, is otherwise
        # tried at every position of the text ("User: ..." has one colon, then none near).
        gate=re.compile(r":[0-9A-Fa-f]{0,4}:"),
    ),
    _PhoneDetector("PHONE", _PHONE, priority=30, line_bound=True),
    *PERSONAL_DETECTORS,
)


def find_all(text: str, detectors: tuple[Detector, ...] | list[Detector]) -> list[Finding]:
    """Non-overlapping findings in text order; on overlap the higher priority, then longer, wins.

    The detectors read `fold`'s copy of ``text``; each finding's span and ``text`` are the
    original ones (fullwidth digits as written, a JSON escape whole, format characters inside
    it included; those just before or after it are not part of it), its ``value`` the folded
    one."""
    readings = fold_readings(text)
    if len(readings) == 1:
        folded, positions = readings[0]
        return _in_text(text, folded, positions, [f for _, f in _chosen(folded, detectors)])
    # Read two ways: the readings' findings compete as one reading's do, in the text's
    # positions (the higher priority, then the first reading's, then the longer wins).
    candidates: list[tuple[int, int, Finding]] = []
    for rank, (folded, positions) in enumerate(readings):
        chosen = _chosen(folded, detectors)
        found = _in_text(text, folded, positions, [finding for _, finding in chosen])
        candidates.extend(
            (priority, rank, finding) for (priority, _), finding in zip(chosen, found, strict=True)
        )
    candidates.sort(
        key=lambda item: (-item[0], item[1], item[2].start - item[2].end, item[2].start)
    )
    found = []
    for _, _, finding in candidates:
        if not any(finding.start < other.end and other.start < finding.end for other in found):
            found.append(finding)
    found.sort(key=lambda finding: finding.start)
    return found


def _chosen(
    folded: str, detectors: tuple[Detector, ...] | list[Detector]
) -> list[tuple[int, Finding]]:
    """The findings in one reading of a text, in its positions, with their priorities."""
    candidates: list[tuple[int, Finding]] = []
    for detector in detectors:
        candidates.extend((detector.priority, finding) for finding in detector.find(folded))
    candidates.sort(key=lambda item: (-item[0], -(item[1].end - item[1].start), item[1].start))
    chosen: list[tuple[int, Finding]] = []
    for priority, finding in candidates:
        # Overlap in the folded text's positions: those of the findings the detectors gave.
        if any(finding.start < other.end and other.start < finding.end for _, other in chosen):
            continue
        chosen.append((priority, finding))
    chosen.sort(key=lambda item: item[1].start)
    return chosen


def _in_text(
    text: str, folded: str, positions: FoldMap | None, chosen: list[Finding]
) -> list[Finding]:
    """``chosen`` (found in ``folded``, a reading of ``text``) in ``text``'s positions."""
    if folded is text:
        return chosen
    found: list[Finding] = []
    for finding in chosen:
        start, end = finding.start, finding.end
        if positions is not None:
            start, end = positions.span(start, end)
        found.append(Finding(finding.entity, start, end, text[start:end], finding.text))
    return found
