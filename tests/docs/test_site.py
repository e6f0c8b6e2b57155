"""The documentation site builds strictly (a broken link, a missing page or API reference fails)
and offline: no plugin that downloads at build time, no font or script fetched from elsewhere."""

from __future__ import annotations

import contextlib
import html
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from keel import Agent, AgentReply, ContextBudget, GuardConfig, Settings
from keel.runtime._session import DecideOptions

ROOT = Path(__file__).resolve().parents[2]
# A proxy nothing listens on: a plugin that tried to download would fail the build.
_OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
_EXTERNAL_RESOURCE = re.compile(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"(https?://[^\"]+)\"")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        env={**os.environ, **_OFFLINE, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return folder


def test_only_offline_plugins_are_configured() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    plugins = [next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]]
    assert plugins == ["search", "mkdocstrings"]
    assert config["theme"]["font"] is False
    assert config["strict"] is True


def test_no_page_loads_anything_from_elsewhere(site: Path) -> None:
    loaded = {
        f"{page.relative_to(site)}: {url}"
        for page in site.rglob("*.html")
        for url in _EXTERNAL_RESOURCE.findall(page.read_text(encoding="utf-8"))
        # A link (<a>) to another site is fine; <link> is only a stylesheet, icon or font.
    }
    assert loaded == set()


def test_every_page_is_built_and_the_api_reference_comes_from_the_docstrings(site: Path) -> None:
    for page in ("getting-started", "concepts/memory", "deployment", "operations", "benchmarks"):
        assert (site / page / "index.html").exists(), page
    agent = (site / "reference/keel/index.html").read_text(encoding="utf-8")
    assert 'id="keel.runtime.Agent"' in agent
    summary = inspect.getdoc(Agent).splitlines()[0]  # Agent's own docstring, rendered
    assert html.escape(summary, quote=False) in agent
    errors = (site / "reference/errors/index.html").read_text(encoding="utf-8")
    assert 'id="keel.errors.KeelError"' in errors


def test_make_docs_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The test command's own build target, on a copy of the pages with one broken link."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "src").symlink_to(ROOT / "src")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    with (tmp_path / "docs/architecture.md").open("a") as page:
        page.write("\nSee [the missing page](missing.md).\n")
    result = subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "docs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "missing.md" in result.stdout + result.stderr


# --- the API reference (issue 45: what people look up) ----------------------------------------

_REFERENCED_MODULES = (
    "keel.runtime",
    "keel.models",
    "keel.approvals",
    "keel.privacy",
    "keel.stores",
    "keel.tracing",
    "keel.service",
    "keel.integrations.langgraph",
    "keel.integrations.openai_agents",
    "keel.integrations.pydantic_ai",
    "keel.integrations.mcp_server",
)
_RAW_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`?")


def _reference_pages(site: Path) -> dict[str, str]:
    return {
        str(page.relative_to(site)): page.read_text(encoding="utf-8")
        for page in (site / "reference").rglob("index.html")
    }


def _text_of(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _row_of(page: str, anchor: str) -> str:
    """The text of the table row that holds ``anchor`` (a model's field, a parameter)."""
    assert f'id="{anchor}"' in page, anchor
    start = page.index(">", page.index(f'id="{anchor}"')) + 1
    return _text_of(page[start : page.index("</tr>", start)])


def test_every_public_class_and_function_has_a_reference_entry(site: Path) -> None:
    modules = {name: importlib.import_module(name) for name in _REFERENCED_MODULES}
    anchors = set(re.findall(r'id="([\w.]+)"', "".join(_reference_pages(site).values())))
    # An object several modules export is documented once, under one of them.
    documented = set()
    for anchor in anchors:
        owner, _, name = anchor.rpartition(".")
        with contextlib.suppress(ImportError, ValueError):  # an anchor that names no module
            documented.add(id(getattr(importlib.import_module(owner), name, None)))
    missing = [
        f"{name}.{public}"
        for name, module in modules.items()
        for public in module.__all__
        if (inspect.isclass(value := getattr(module, public)) or inspect.isfunction(value))
        and id(value) not in documented
    ]
    assert missing == []


def test_a_pydantic_model_shows_each_field_with_its_type_default_and_description(
    site: Path,
) -> None:
    pages = _reference_pages(site)
    for page, model, path in [
        ("reference/tools/index.html", GuardConfig, "keel.guards.GuardConfig"),
        ("reference/context/index.html", ContextBudget, "keel.context.ContextBudget"),
        ("reference/keel/index.html", AgentReply, "keel.runtime.AgentReply"),
        ("reference/keel/index.html", Settings, "keel.settings.Settings"),
    ]:
        for name, field in model.model_fields.items():
            row = _row_of(pages[page], f"{path}.{name}")
            assert row.startswith(name), (path, name, row)
            assert field.description is not None
            # Compared without spaces: markup (``code``) renders with spaces around it here.
            description = "".join(field.description.replace("`", "").split())
            assert description in "".join(row.split()), (path, name, row)
            if field.is_required():
                assert row.endswith("required"), (path, name, row)
            elif field.default_factory is None:
                assert row.endswith(repr(field.default)), (path, name, row)
    guard = _row_of(pages["reference/tools/index.html"], "keel.guards.GuardConfig.max_steps")
    assert guard == "max_steps int Most model calls in one run; the run stops at the limit. " + (
        "Constraints: ≥ 1 20"
    )


def test_decide_documents_each_of_its_options(site: Path) -> None:
    page = _reference_pages(site)["reference/keel/index.html"]
    start = page.index('id="keel.runtime.Agent.decide"')
    decide = page[start : page.index('id="keel.runtime.Agent.decide_sync"', start)]
    rows = {
        _text_of(row).split(" ")[0]: _text_of(row)
        for row in re.findall(r"<tr class=\"doc-section-item\">(.*?)</tr>", decide, re.S)
    }
    for option in DecideOptions.__annotations__:
        assert option in rows, option
        # The name, its type, a description of more than a few words, the default.
        assert len(rows[option].split()) > 8, rows[option]
    assert "True approves the call" in rows["approve"]


def test_the_reference_shows_no_sphinx_markup(site: Path) -> None:
    found = [
        f"{name}: {_text_of(page[max(m.start() - 80, 0) : m.end() + 40])}"
        for name, page in _reference_pages(site).items()
        for m in _RAW_ROLE.finditer(page)
    ]
    # A reST literal-block marker ("Example::") left at the end of a paragraph.
    found += [
        f"{name}: {_text_of(paragraph)}"
        for name, page in _reference_pages(site).items()
        for paragraph in re.findall(r"<p>(.*?)</p>", page, re.S)
        if _text_of(paragraph).endswith("::")
    ]
    assert found == []
