"""``keel bench masking``: the masker's recall on generated values in many locales, and its false
positives on text with none."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonLastOption, bench_app, emit_or_show, err_console, fail, out_console
from keel.errors import UsageError


@bench_app.command("masking")
def bench_masking_command(
    per_locale: Annotated[
        int, typer.Option(min=1, help="Values of each entity type generated per locale.")
    ] = 60,
    locales: Annotated[
        str | None,
        typer.Option(help="Comma-separated Faker locales (default: 36 locales, every script)."),
    ] = None,
    modules: Annotated[
        int,
        typer.Option(
            min=0, help="Standard-library modules read as PII-free text (0: all of them)."
        ),
    ] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the generated values and templates.")] = 44,
    as_json: JsonLastOption = False,
) -> None:
    """Recall per entity type (e-mail, phone, card, IBAN) on values Faker generates per locale,
    written the ways people write them (Unicode and IDN addresses, look-alike letters,
    fullwidth digits, bare numbers), and false positives per 10,000 words of the standard
    library's code and prose."""
    from keel.bench.masking import DEFAULT_LOCALES, run_masking_bench

    chosen = DEFAULT_LOCALES
    if locales is not None:
        chosen = tuple(name.strip() for name in locales.split(",") if name.strip())
        if not chosen:
            fail(UsageError("--locales names no locale"))
    report = run_masking_bench(
        locales=chosen,
        per_locale=per_locale,
        modules=modules,
        seed=seed,
        progress=err_console.print,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    recall = ", ".join(f"{entity} {value}" for entity, value in report["recall"].items())
    out_console.print(
        f"seed {report['seed']}, {len(report['locales'])} locales, {report['per_locale']} values "
        f"per type and locale: recall {recall} (targets met: {report['targets_met']}); phone "
        f"recall without a cue word {report['phone_recall_without_cue']}",
        markup=False,
    )
    out_console.print(
        f"false positives: {report['false_positives_per_10k_words']} per 10k words "
        f"({report['false_positives']} in {report['pii_free_words']} words of code and prose; "
        f"by type {report['false_positives_by_entity']}); masking "
        f"{report['mask_us_per_kb']} µs per KB",
        markup=False,
    )
    for example in report["false_positive_examples"][:5]:
        out_console.print(
            f"  found {example['entity']} in PII-free text: {example['context']!r}", markup=False
        )
    for miss in report["worst_misses"]:
        out_console.print(
            f"  missed {miss['entity']} ({miss['locale']}, {miss['variant']}): "
            f"{miss['value']!r} -> {miss['masked']!r}",
            markup=False,
        )
