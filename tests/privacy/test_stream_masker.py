"""StreamMasker: a text masked as it arrives in pieces shows no PII early and splits no
placeholder; the pieces put together are the masked whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keel.privacy import PIIMasker, StreamMasker

_MASKER = PIIMasker()

_SECRETS = (
    "jane.doe@example.com",
    "(415) 555-0198",
    "4111 1111 1111 1111",
    "GB82 WEST 1234 5698 7654 32",
    "sk-proj-abcdefghijklmnopqrstuvwxyz012345",
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADAN BgkqhkiG9w0B AQEFAASC\n-----END PRIVATE KEY-----",
)
_WORDS = ("Hello", "your", "booking", "is", "confirmed.", "Call", "or", "write", "to", "\n")


@given(
    parts=st.lists(st.sampled_from(_SECRETS + _WORDS), min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=15), min_size=1, max_size=30),
)
def test_pieces_show_no_pii_early_and_add_up_to_the_masked_whole(
    parts: list[str], cuts: list[int]
) -> None:
    text = " ".join(parts)
    whole = _MASKER.mask_text(text)
    stream = StreamMasker(_MASKER.mask_text)
    shown = ""
    position, turn = 0, 0
    while position < len(text):
        size = cuts[turn % len(cuts)]
        turn += 1
        shown += stream.feed(text[position : position + size])
        position += size
        # Released text is the start of the masked whole: no raw PII, no half placeholder.
        assert whole.startswith(shown)
        for secret in _SECRETS:
            assert secret.split()[0][:8] not in shown
    shown += stream.finish()
    assert shown == whole
    assert stream.released == whole


def test_plain_text_is_released_while_it_streams() -> None:
    stream = StreamMasker(_MASKER.mask_text, hold_chars=8)
    text = "one two three four five six seven eight nine ten"
    shown = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert any(shown[:-1]), "nothing was released before the end"
    assert "".join(shown) + stream.finish() == text
