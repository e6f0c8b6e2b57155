"""The documentation site builds strictly (a broken link, a missing page or API reference fails)
and offline: no plugin that downloads at build time, no font or script fetched from elsewhere."""

from __future__ import annotations

import html
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from keel import Agent

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
