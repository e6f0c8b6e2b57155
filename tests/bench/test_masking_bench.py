"""``keel bench masking`` as a user runs it (a small corpus): its JSON contract and issue 44's
recall targets on the default seed."""

from __future__ import annotations

from keel.bench.masking import DEFAULT_LOCALES, TARGETS
from tests.bench._cli import bench_json


def test_bench_masking_json_contract_and_recall_targets() -> None:
    figures = bench_json("masking", "--per-locale", "12", "--modules", "4")
    assert list(figures)[:3] == ["recall", "false_positives_per_10k_words", "locales"]
    assert figures["locales"] == list(DEFAULT_LOCALES) and len(figures["locales"]) >= 30
    assert figures["seed"] == 44 and figures["per_locale"] == 12
    samples = len(DEFAULT_LOCALES) * 12
    assert figures["samples"] == dict.fromkeys(TARGETS, samples)
    for entity, target in TARGETS.items():
        assert figures["recall"][entity] >= target, (entity, figures["worst_misses"])
    assert figures["targets_met"] is True
    # The variants defect 12 names were generated and each is found.
    assert figures["recall_by_variant"]["EMAIL"]["unicode"] >= 0.95
    assert figures["recall_by_variant"]["EMAIL"]["lookalike"] == 1.0
    assert figures["recall_by_variant"]["CREDIT_CARD"]["fullwidth"] == 1.0
    assert figures["recall_by_variant"]["PHONE"]["bare"] >= 0.9
    assert figures["pii_free_words"] > 10_000
    assert figures["false_positives_per_10k_words"] >= 0  # IP addresses, if ipaddress.py is drawn
    assert figures["false_positives_by_entity"].get("PHONE", 0) <= 2
    assert figures["false_positives_by_entity"].get("CREDIT_CARD", 0) == 0
    assert figures["mask_us_per_kb"] > 0
