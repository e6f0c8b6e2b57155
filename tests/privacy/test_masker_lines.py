"""A long text of lines met before (a memories block recalled turn after turn) is known clean
from its lines: the masker keeps the lines it found holding nothing, per policy. What it masks
is what a scan of the whole text masks, always: a value a line holds, one that runs from one
line to the next (a bearer token after "Bearer" on the line before, a private key), and a
number that one text labels as an id but another holds bare."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import MaskingPolicy, MaskResult, PIIMasker
from keel.privacy._detectors import DETECTORS, find_all

RECORDS = [
    f"User: Question {n}: what do the records say about item {n} on 2026-12-{n % 28 + 1:02d}?"
    for n in range(40)
]
LABEL = "- [episodic · 2026-12-07 · user_claim]"


def _block(lines: list[str]) -> str:
    return "\n".join(["Relevant memories (from earlier sessions, most relevant first):", *lines])


def _whole(text: str) -> list[tuple[str, str]]:
    """What a scan of the whole text finds (no lines kept)."""
    return [(f.entity, f.text) for f in find_all(text, DETECTORS)]


def _found(masker: PIIMasker, text: str) -> list[tuple[str, str]]:
    return [(f.entity, f.text) for f in masker.findings(text)]


def _kept_lines(masker: PIIMasker) -> int:
    return sum(len(kept.clean_lines) for kept in masker._detectors.values())


def _warm(masker: PIIMasker) -> None:
    """Every clean line of the tests, kept by the masker (as turns of recalls would)."""
    assert masker.findings(_block([LABEL, *RECORDS])) == []
    assert _kept_lines(masker) == len(RECORDS) + 2


def test_a_block_of_known_lines_is_clean_without_a_scan_and_a_new_value_is_found() -> None:
    masker = PIIMasker()
    _warm(masker)
    again = _block([LABEL, *RECORDS[5:30]])
    assert _found(masker, again) == [] == _whole(again)
    leaking = _block([LABEL, *RECORDS[:20], "Assistant: write to mallory.x7q@example.org", LABEL])
    assert _found(masker, leaking) == [("EMAIL", "mallory.x7q@example.org")]
    assert "mallory" not in masker.mask_text(leaking)


def test_a_bearer_token_on_the_line_after_bearer_is_masked() -> None:
    masker = PIIMasker()
    _warm(masker)
    token = "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2Lk"
    header = "Assistant: send Authorization: Bearer"
    # Each line, in a block of its own, holds nothing: the token is one only after "Bearer".
    for line in (header, token):
        assert _found(masker, _block([LABEL, *RECORDS[:20], line, LABEL])) == []
    text = _block([LABEL, *RECORDS[:20], header, token])
    assert _found(masker, text) == _whole(text) == [("BEARER_TOKEN", token)]
    assert token not in masker.mask_text(text)


def test_a_private_key_over_several_lines_is_masked() -> None:
    masker = PIIMasker()
    _warm(masker)
    key = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
    for line in key.split("\n"):  # each line, in a block of its own, holds nothing
        assert _found(masker, _block([LABEL, *RECORDS[:20], line])) == []
    text = _block([LABEL, *RECORDS[:20], key])
    assert _found(masker, text) == _whole(text) == [("PRIVATE_KEY", key)]
    assert "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in masker.mask_text(text)


def test_a_line_clean_only_beside_an_id_label_is_not_kept_as_clean() -> None:
    """A bare number is an id where the text labels it so: the line that holds it bare is
    clean in that text, not on its own, and is masked in a text without the label."""
    masker = PIIMasker()
    _warm(masker)
    bare = "Assistant: 4155550132 is the one"
    labelled = _block([LABEL, *RECORDS[:20], "User: order id 4155550132", bare])
    assert _found(masker, labelled) == _whole(labelled) == []
    alone = _block([LABEL, *RECORDS[:20], bare])
    assert _found(masker, alone) == _whole(alone) == [("PHONE", "4155550132")]


# Lines the detectors read as a key's BEGIN line, "Bearer" and an id label only once folded
# (a no-break space, fullwidth letters): their rules read the folded lines too.
_FOLDED_BEGIN = "User: zebra key -----BEGIN\u00a0RSA PRIVATE KEY-----"
_FOLDED_BEARER = "Authorization: \uff42\uff45\uff41\uff52\uff45\uff52"
_FOLDED_ID_LABEL = "User: order id\u00a04155550132"


def test_a_key_whose_begin_line_was_met_clean_before_is_masked() -> None:
    masker = PIIMasker()
    _warm(masker)
    assert _found(masker, _block([LABEL, *RECORDS[:20], _FOLDED_BEGIN, "no key after all"])) == []
    body = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"
    text = _block([LABEL, *RECORDS[:20], _FOLDED_BEGIN, body, "-----END RSA PRIVATE KEY-----"])
    assert [entity for entity, _ in _whole(text)] == ["PRIVATE_KEY"]
    assert _found(masker, text) == _whole(text)
    assert body not in masker.mask_text(text)


def test_a_token_after_a_fullwidth_bearer_met_clean_before_is_masked() -> None:
    masker = PIIMasker()
    _warm(masker)
    assert _found(masker, _block([LABEL, *RECORDS[:20], _FOLDED_BEARER, "and nothing"])) == []
    token = "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2Lk"
    text = _block([LABEL, *RECORDS[:20], _FOLDED_BEARER, token])
    assert _found(masker, text) == _whole(text) == [("BEARER_TOKEN", token)]
    assert token not in masker.mask_text(text)


def test_a_line_clean_only_beside_a_folded_id_label_is_not_kept_as_clean() -> None:
    masker = PIIMasker()
    _warm(masker)
    bare = "Assistant: 4155550132 is the one"
    labelled = _block([LABEL, *RECORDS[:20], _FOLDED_ID_LABEL, bare])
    assert _found(masker, labelled) == _whole(labelled) == []
    alone = _block([LABEL, *RECORDS[:20], bare])
    assert _found(masker, alone) == _whole(alone) == [("PHONE", "4155550132")]


def test_an_empty_id_list_beside_a_bare_number_is_no_error() -> None:
    text = '{"item_ids": [], "ref": "4155550132"}'
    try:
        masked = PIIMasker().mask_text(text)
    except TypeError as error:  # the phone detector's, once
        masked = repr(error)
    assert masked == '{"item_ids": [], "ref": "<PHONE_1>"}'


def test_the_lines_are_kept_per_policy() -> None:
    masker = PIIMasker(MaskingPolicy(entities=frozenset({"PHONE"})))
    text = _block([LABEL, *RECORDS, "Assistant: write to mallory.x7q@example.org"])
    assert masker.findings(text) == []  # e-mail addresses are not this tenant's to mask
    masker.set_policy("acme", MaskingPolicy())
    assert [f.entity for f in masker.findings(text, tenant_id="acme")] == ["EMAIL"]


_LINES = st.sampled_from(
    [
        *RECORDS[:6],
        LABEL,
        "Assistant: write to mallory.x7q@example.org",
        "Authorization: Bearer",
        "authorization: BEARER   ",
        "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2Lk",
        "-----BEGIN RSA PRIVATE KEY-----",
        "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
        "-----END RSA PRIVATE KEY-----",
        "User: order id 4155550132",
        "4155550132",
        "call +1 415 555 0132 or",
        "(415) 555-0198 tomorrow",
        "card 4111 1111 1111 1111",
        "536-22-1234",
        "server 10.20.30.40 and fe80::1ff:fe23:4567:890a",
        "sk-proj-Q7wErTy8uIoP9aSdFgHj0kLzXcVb",
        "GB82 WEST 1234 5698 7654 32",
        _FOLDED_BEGIN,
        _FOLDED_BEARER,
        _FOLDED_ID_LABEL,
        '"item_ids": [] then',
        "",
        "   ",
    ]
)


@settings(max_examples=300, deadline=None)
@given(first=st.lists(_LINES, min_size=12, max_size=40), then=st.lists(_LINES, max_size=40))
def test_what_is_found_is_what_a_scan_of_the_whole_text_finds(
    first: list[str], then: list[str]
) -> None:
    masker = PIIMasker()
    _warm(masker)
    earlier = _block([*RECORDS[:12], *first])
    assert _found(masker, earlier) == _whole(earlier)
    later = _block([*RECORDS[10:22], *then])
    assert _found(masker, later) == _whole(later)


def test_a_long_line_is_scanned_each_time_never_kept() -> None:
    """The lines kept stay bounded in characters: a tool's long output line is scanned again
    whenever it comes back (what is found is the same either way)."""
    masker = PIIMasker()
    long_line = "Tool: " + " ".join(f"row {n} ok" for n in range(400))
    assert len(long_line) > 2048
    text = _block([LABEL, long_line, *RECORDS[:5]])
    assert _found(masker, text) == [] == _whole(text)
    assert _kept_lines(masker) == 5 + 2
    assert _found(masker, text) == []


class _EvictedMeanwhile(OrderedDict[str, MaskResult]):
    """Kept results that other threads empty just before this thread drops its oldest (all
    found the cache full): the drop finds nothing to drop."""

    def popitem(self, last: bool = True) -> tuple[str, MaskResult]:
        self.clear()
        return super().popitem(last=last)


def test_a_full_result_cache_another_thread_trimmed_first_is_no_error() -> None:
    masker = PIIMasker()
    full = _EvictedMeanwhile((f"text {n}", MaskResult(text=f"text {n}")) for n in range(2048))
    masker._results[id(masker.policy)] = (masker.policy, full)
    assert masker.mask_text("mail mallory.x7q@example.org") == "mail <EMAIL_1>"
