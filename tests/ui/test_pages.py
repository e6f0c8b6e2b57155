"""Every page of the viewer in a real headless Chromium at 1,280 px, on the database a real
``keel demo`` filled (issue 49): its key content present and visible, not cut off by a box
that hides or scrolls its overflow, no sideways scroll, no console error, and axe-core (npm,
installed by ``setup.sh``) with every rule on finds nothing serious or critical. One demo
database, one server and one browser serve every test here (tests/ui/conftest.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page

from tests.ui.conftest import DemoViewer

pytestmark = pytest.mark.slow

AXE = Path(__file__).resolve().parents[2] / ".venv" / "npm" / "node_modules" / "axe-core"
WIDTH = 1280
SESSION = "demo-session"

_CUT = """(el) => {
  const r = el.getBoundingClientRect();
  if (r.width === 0 || r.height === 0) return 'has no size';
  for (let box = el.parentElement; box; box = box.parentElement) {
    const style = getComputedStyle(box);
    if (style.overflowX === 'visible' && style.overflowY === 'visible') continue;
    const b = box.getBoundingClientRect();
    if (r.left < b.left - 1 || r.right > b.right + 1)
      return 'cut sideways by ' + box.tagName + '.' + box.className;
    const hides = ['hidden', 'clip'].includes(style.overflowY);
    if (hides && (r.top < b.top - 1 || r.bottom > b.bottom + 1))
      return 'cut by ' + box.tagName + '.' + box.className;
  }
  if (r.left < 0 || r.right > document.documentElement.clientWidth + 1) return 'past the page';
  return '';
}"""

_AXE_RUN = """async () => {
  const rules = Object.fromEntries(axe.getRules().map((rule) => [rule.ruleId, {enabled: true}]));
  const result = await axe.run(document, {rules});
  return result.violations.map((v) => ({id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.slice(0, 3).map((node) => node.target.join(' '))}));
}"""


@pytest.fixture(scope="module")
def signed_in(browser: Browser, demo_viewer: DemoViewer) -> Iterator[BrowserContext]:
    """One signed-in browser context (its cookie) for every page of this module."""
    context = browser.new_context(viewport={"width": WIDTH, "height": 900})
    page = context.new_page()
    page.goto(f"{demo_viewer.url}/ui/login")
    page.get_by_label("API key").fill(demo_viewer.key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*/ui/runs$"))
    page.close()
    yield context
    context.close()


class Visit:
    """One page open in the browser, with what its console said."""

    def __init__(self, context: BrowserContext, url: str) -> None:
        self.page: Page = context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        response = self.page.goto(url)
        assert response is not None
        self.status = response.status

    def shown(self, selector: str, *, at_least: int = 1) -> Any:
        """The elements ``selector`` finds: at least ``at_least``, each visible and whole."""
        found = self.page.locator(selector)
        assert found.count() >= at_least, f"{selector}: {found.count()} found"
        for index in range(min(found.count(), 12)):
            element = found.nth(index)
            assert element.is_visible(), f"{selector} #{index} is not visible"
            cut = element.evaluate(_CUT)
            assert cut == "", f"{selector} #{index} {cut}"
        return found

    def check(self) -> None:
        """No sideways scroll, no console error, no serious or critical axe violation."""
        scroll = self.page.evaluate("document.documentElement.scrollWidth")
        assert scroll <= WIDTH, f"{self.page.url} scrolls sideways ({scroll} px)"
        assert self.errors == [], self.errors
        if not (AXE / "axe.min.js").exists():
            pytest.skip("axe-core is not installed: ./setup.sh installs it with npm")
        self.page.add_script_tag(path=str(AXE / "axe.min.js"))
        violations = self.page.evaluate(_AXE_RUN)
        grave = [v for v in violations if v["impact"] in ("serious", "critical")]
        assert grave == [], json.dumps(grave, indent=1)
        self.page.close()


def _visit(context: BrowserContext, viewer: DemoViewer, path: str) -> Visit:
    visit = Visit(context, f"{viewer.url}{path}")
    assert visit.status == 200, (path, visit.status)
    return visit


def _booking_run(context: BrowserContext, viewer: DemoViewer) -> str:
    """The newest run that called book_flight, found through the run search."""
    visit = _visit(context, viewer, "/ui/runs?tool=book_flight")
    href = visit.page.locator("a.run-link").first.get_attribute("href")
    visit.page.close()
    assert href is not None
    return href


def test_the_run_list_has_durations_and_finds_runs_by_text_and_tool(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, "/ui/runs")
    visit.shown("table.runs tbody tr", at_least=10)
    durations = visit.shown("td.duration", at_least=10)
    assert all(re.fullmatch(r"[\d.]+ (ms|s)", d) for d in durations.all_inner_texts())
    tokens = visit.page.locator("table.runs tbody td.num").all_inner_texts()
    assert any("," in figure for figure in tokens), "thousands are separated"
    for cell in ("td.nowrap", "td.num"):
        heights = visit.page.locator(cell).evaluate_all(
            "(cells) => cells.map((c) => c.getBoundingClientRect().height)"
        )
        assert max(heights) < 2 * min(heights) + 4, f"{cell}: a date or id wrapped"
    visit.check()

    search = "/ui/runs?text=BOOK+it&tool=book_flight&status=succeeded"
    visit = _visit(signed_in, demo_viewer, search)
    rows = visit.shown("table.runs tbody tr")
    assert all("book it" in text.lower() for text in rows.all_inner_texts())
    assert visit.page.get_by_label("Text in input or output").input_value() == "BOOK it"
    assert visit.page.get_by_label("Tool called").input_value() == "book_flight"
    visit.check()
    visit = _visit(signed_in, demo_viewer, "/ui/runs?text=no+run+says+this")
    assert "No runs match" in visit.page.locator("main").inner_text()
    visit.page.close()


def test_a_model_step_shows_the_messages_it_was_sent_by_section_beside_its_output(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, _booking_run(signed_in, demo_viewer))
    step = visit.page.locator("li.step.kind-model").nth(1)
    step.locator("summary").first.click()
    opened = f"#{step.get_attribute('id')} > details"
    sent = visit.shown(f"{opened} .exchange .sent ol.messages")
    sections = {name.strip() for name in sent.first.locator(".section-name").all_inner_texts()}
    assert {"system", "turns", "rules"} <= sections
    visit.shown(f"{opened} .exchange .sent li.message pre", at_least=3)
    legend = step.locator(".legend").first.inner_text()
    assert all(name in legend for name in sections), "each message's section is on the bar"
    assert "Yes, book it." in sent.first.inner_text()
    visit.shown(f"{opened} .exchange .answer h3")
    assert re.search(r"\d,\d{3} \+ \d+ tokens", step.locator("summary").first.inner_text())
    assert re.search(r"\d\.\d+ ms", step.locator(".latency").first.inner_text())
    tool = visit.page.locator("li.step.kind-tool").first
    tool.locator("summary").first.click()
    opened = f"#{tool.get_attribute('id')} > details"
    arguments = visit.shown(f"{opened} pre.arguments").first.inner_text()
    assert isinstance(json.loads(arguments), dict) and '\\"' not in arguments
    visit.shown("a.timeline-link")
    visit.check()


def test_the_timeline_shows_each_step_in_time_and_where_the_time_went(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    run = _booking_run(signed_in, demo_viewer)
    visit = _visit(signed_in, demo_viewer, f"{run}/timeline")
    visit.shown("table.where tbody tr", at_least=3)
    rows = visit.shown("table.waterfall tbody tr", at_least=4)
    kinds = " ".join(rows.all_inner_texts())
    assert "model" in kinds and "tool" in kinds and "checkpoint" in kinds
    visit.shown("table.waterfall tr.kind-model .lane-bar")
    first_token = visit.page.locator("table.waterfall tr.kind-model td.num").all_inner_texts()
    assert any(re.fullmatch(r"[\d.]+ ms", text) for text in first_token)
    visit.check()


def test_the_session_page_shows_the_conversation_the_diff_first_and_a_fitted_graph(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, f"/ui/sessions/{SESSION}")
    turns = visit.shown("ol.conversation li.turn", at_least=10)
    said = " ".join(turns.all_inner_texts())
    assert "Hi! I'd like to book a flight." in said and "Where will you be flying from?" in said
    visit.shown("li.turn.status-interrupted")
    visit.shown("li.turn .badge.resumed")
    settled = visit.shown("ol.conversation li.event.tool")
    assert "settled by an operator" in " ".join(settled.all_inner_texts())
    graph = visit.shown("svg.graph")
    box = graph.first.bounding_box()
    assert box is not None
    for part in ("g.node", "g.edge"):
        visit.shown(f"svg.graph {part}", at_least=2)
        inside = graph.first.evaluate(
            """(svg, part) => { const b = svg.getBoundingClientRect();
              return [...svg.querySelectorAll(part)].every((g) => {
                const r = g.getBoundingClientRect();
                return r.left >= b.left - 1 && r.right <= b.right + 1 && r.top >= b.top - 1
                  && r.bottom <= b.bottom + 1; }); }""",
            part,
        )
        assert inside, f"a {part} of the graph is cut off"
    assert visit.page.locator("table.checkpoints tbody tr").count() == 20, "paged"
    visit.shown("a.older")
    visit.check()

    visit = _visit(signed_in, demo_viewer, f"/ui/sessions/{SESSION}?a=2&b=20")
    diff = visit.shown("#diff table.diff tbody tr", at_least=2)
    assert "machine.state" in " ".join(diff.all_inner_texts())
    visit.shown("#diff ins")
    top = visit.page.locator("#diff").bounding_box()
    conversation = visit.page.get_by_role("heading", name="Conversation").bounding_box()
    assert top is not None and conversation is not None and top["y"] < conversation["y"]
    visit.check()

    visit = _visit(signed_in, demo_viewer, f"/ui/sessions/{SESSION}?page=2")
    visit.shown("table.checkpoints tbody tr", at_least=1)
    visit.shown("a[rel=prev]")
    visit.check()


def test_the_memory_page_lists_users_and_ranks_hits_apart_from_failures(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, "/ui/memory")
    users = visit.shown("ul.users a")
    assert "demo-user" in users.all_inner_texts()
    visit.check()
    visit = _visit(signed_in, demo_viewer, "/ui/memory?user=demo-user&q=flight")
    rank = visit.shown("ol.hits .rank").first
    assert "keyword rank" in rank.inner_text()
    background = rank.evaluate("(el) => getComputedStyle(el).backgroundColor")
    assert background != "rgb(251, 227, 225)", "a hit's ranking is not a failure banner"
    visit.shown("table.records tbody tr", at_least=5)
    visit.check()


def test_the_health_page_charts_have_axes_with_units(
    signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, "/ui/health?since=all")
    title = visit.page.get_by_role("heading", level=1).inner_text()
    assert "agent agent" not in title and "all sessions" in title
    charts = visit.shown("svg.chart", at_least=4)
    for index in range(charts.count()):
        chart = charts.nth(index)
        labels = chart.locator("text").all_text_contents()
        assert "time (UTC)" in labels and len(labels) >= 6, labels
        assert not any("e+" in label for label in labels), labels
        heights = chart.locator("text").evaluate_all(
            "(texts) => texts.map((t) => parseFloat(getComputedStyle(t).fontSize)"
            " * t.ownerSVGElement.getBoundingClientRect().width"
            " / t.ownerSVGElement.viewBox.baseVal.width)"
        )
        assert min(heights) >= 11, f"chart text drawn at {min(heights):.1f} px"
    visit.shown("table.stats tbody tr")
    visit.check()


def test_the_approvals_sign_in_and_missing_pages_and_the_favicon(
    browser: Browser, signed_in: BrowserContext, demo_viewer: DemoViewer
) -> None:
    visit = _visit(signed_in, demo_viewer, "/ui/approvals")
    visit.shown("h1")
    visit.check()
    context = browser.new_context(viewport={"width": WIDTH, "height": 900})
    visit = _visit(context, demo_viewer, "/ui/login")
    visit.shown("form input#key")
    visit.check()
    context.close()
    icon = httpx.get(f"{demo_viewer.url}/favicon.ico", follow_redirects=True, timeout=30)
    assert icon.status_code == 200 and "svg" in icon.headers["content-type"]
    visit = Visit(signed_in, f"{demo_viewer.url}/ui/runs/ffffffffffffffff")
    assert visit.status == 404
    visit.shown("main a[href='/ui/runs']")
    visit.errors = [e for e in visit.errors if "404" not in e]
    visit.check()
