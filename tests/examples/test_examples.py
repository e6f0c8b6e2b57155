"""The runnable examples in examples/ work offline and do what their docstrings say."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"keel_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_flight_booking_example_books_each_trip_once(tmp_path: Path) -> None:
    example = _load("flight_booking")
    bookings = await example.main("scripted", 2, tmp_path)
    assert sorted(bookings.values()) == [1, 1]


async def test_ecommerce_race_one_commits_the_other_rereads_and_reports(tmp_path: Path) -> None:
    example = _load("ecommerce_support")
    cancel_reply, change_reply, order = await example.race(tmp_path)
    assert cancel_reply == "Order 1024 is cancelled."
    assert "can't be changed" in change_reply
    # Exactly one write committed: version 1 -> 2, the address untouched.
    assert order == {"id": "1024", "status": "cancelled", "address": "1 Old Road", "version": 2}


def test_examples_and_the_readme_use_the_public_api_only() -> None:
    import re

    private = re.compile(r"^\s*(?:from|import)\s+keel(?:\.\w+)*\.(?:_\w+|demo)\b", re.M)
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    sources = {path.name: path.read_text(encoding="utf-8") for path in EXAMPLES.glob("*.py")}
    for name, text in {**sources, "README.md": readme}.items():
        assert not private.findall(text), f"{name} imports a private module or keel.demo"


async def test_ecommerce_build_is_the_support_agent_on_the_settings_database(
    tmp_path: Path,
) -> None:
    from keel.settings import load_settings

    example = _load("ecommerce_support")
    assert hasattr(example, "build"), "examples/ecommerce_support.py has no build(settings)"
    settings = load_settings(data_dir=tmp_path, model="scripted:echo", embedder="hashing:64")
    agent = example.build(settings)
    try:
        reply = await agent.run("hello", session="s1", user="ada")
        assert reply.status == "completed" and reply.text == "hello"  # the settings' model
    finally:
        await agent.aclose()
    # The settings' database, and the shop beside it.
    assert (tmp_path / "keel.db").exists() and (tmp_path / "shop.db").exists()
    tools = {t.name: t for t in example.support_tools(example.Shop(tmp_path / "shop.db"))}
    assert set(tools) == {"lookup_order", "issue_refund"}
    assert tools["issue_refund"].approval == "operator" and tools["issue_refund"].side_effect
    found = tools["lookup_order"].function("ADA@example.com")
    assert '"id": "1024"' in found and '"total": 40.0' in found
