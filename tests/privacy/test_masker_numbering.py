"""PIIMasker with a numbering (a user's vault): texts with nothing to mask are served from the
masker's cache, as they are without one; a text that holds a value is masked afresh each time
through the numbering it is given, never served or kept from an earlier call."""

from __future__ import annotations

import pytest

from keel.privacy import PIIMasker


def test_a_text_with_a_value_goes_through_each_numbering_it_is_given() -> None:
    masker = PIIMasker()
    text = "write to alice@example.com"
    assert masker.mask_text(text) == "write to <EMAIL_1>"
    first = masker.mask_text(text, numbering=lambda entity, value: f"<{entity}_7>")
    second = masker.mask_text(text, numbering=lambda entity, value: f"<{entity}_9>")
    assert (first, second) == ("write to <EMAIL_7>", "write to <EMAIL_9>")
    assert masker.mask_text(text) == "write to <EMAIL_1>"


def test_a_text_with_nothing_to_mask_is_detected_once(monkeypatch: pytest.MonkeyPatch) -> None:
    masker = PIIMasker()
    calls: list[str] = []
    findings = masker.findings

    def counted(text: str, *, tenant_id: str | None = None) -> list:  # type: ignore[type-arg]
        calls.append(text)
        return findings(text, tenant_id=tenant_id)

    monkeypatch.setattr(masker, "findings", counted)

    def numbering(entity: str, value: str) -> str:
        raise AssertionError("nothing here to number")

    for _ in range(3):
        assert masker.mask_text("model step completed", numbering=numbering) == (
            "model step completed"
        )
    assert calls == ["model step completed"]
