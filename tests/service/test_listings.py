"""Listings are bounded, over real HTTP: a page holds at most ``limit`` items (200 at most),
the next page is named by ``X-Next-Cursor`` and ``Link``, and a long input or output is
clipped in a listing while the run's own route has it whole."""

from __future__ import annotations

import httpx

from keel.service._paging import CLIPPED_CHARS
from tests.service.conftest import Service


def _pages(client: httpx.Client, path: str, **params: object) -> list[list[dict[str, object]]]:
    pages = []
    response = client.get(path, params=params)
    for _ in range(20):
        assert response.status_code == 200, response.text
        pages.append(response.json())
        cursor = response.headers.get("X-Next-Cursor")
        if cursor is None:
            assert "Link" not in response.headers
            return pages
        link = response.headers["Link"]
        assert link.endswith('>; rel="next"') and f"cursor={cursor}" in link
        response = client.get(link[1 : link.index(">")])
    raise AssertionError("the pages never ended")


def test_runs_and_checkpoints_come_a_page_at_a_time(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        replies = []
        for city in ("Oslo", "Lima", "Rome", "Pune", "Kiev"):
            turn = acme.post(
                "/v1/sessions/s1/turns", json={"message": f"Book {city}", "user": "u1"}
            )
            replies.append(turn.json())
        pages = _pages(acme, "/v1/runs", limit=2)
        assert [len(page) for page in pages] == [2, 2, 1]
        listed = [run["run_id"] for page in pages for run in page]
        assert listed == [reply["run_id"] for reply in reversed(replies)]
        history = _pages(acme, "/v1/sessions/s1/checkpoints", limit=4)
        versions = [info["version"] for page in history for info in page]
        newest = replies[-1]["state_version"]
        assert versions == list(range(newest, 0, -1)) and len(history) > 1
        for path in ("/v1/runs", "/v1/sessions/s1/checkpoints", "/v1/sessions/s1/in-doubt"):
            assert acme.get(path, params={"limit": 201}).status_code == 422
            assert acme.get(path, params={"cursor": "not a cursor"}).status_code == 422
        assert acme.get("/v1/runs", params={"cursor": "12.zz"}).json() == []


def test_a_long_input_is_clipped_in_the_listing_and_whole_in_the_run(service: Service) -> None:
    long_text = "Book " + "very " * 1_500 + "far Oslo"
    with service.client(service.keys.create("acme")) as acme:
        for session in ("s1", "s2", "s3"):
            turn = acme.post(
                f"/v1/sessions/{session}/turns", json={"message": long_text, "user": "u1"}
            )
            assert turn.status_code == 200, turn.text
        listing = acme.get("/v1/runs")
        runs = listing.json()
        assert len(runs) == 3 and len(listing.content) < 3 * (CLIPPED_CHARS + 1_500)
        assert all(run["clipped"] and len(run["input"]) == CLIPPED_CHARS + 1 for run in runs)
        assert runs[0]["input"] == long_text[:CLIPPED_CHARS] + "…"
        whole = acme.get(f"/v1/runs/{runs[0]['run_id']}").json()
        assert whole["run"]["input"] == long_text
        short = acme.post("/v1/sessions/s4/turns", json={"message": "Book Rome", "user": "u1"})
        newest = acme.get("/v1/runs", params={"limit": 1}).json()[0]
        assert newest["run_id"] == short.json()["run_id"] and newest["clipped"] is False


def test_a_long_memory_is_clipped_in_a_search_and_whole_by_its_id(memory_service: Service) -> None:
    service = memory_service
    long_text = "Rex the dog " + "barks loudly " * 600
    with (
        service.client(service.keys.create("acme")) as acme,
        service.client(service.keys.create("globex")) as globex,
    ):
        note = acme.post("/v1/memory", json={"user": "u1", "text": long_text}).json()
        hits = acme.get("/v1/memory/search", params={"user": "u1", "q": "Rex dog"}).json()
        record = hits[0]["record"]
        assert record["id"] == note["id"] and record["clipped"]
        assert record["text"] == note["text"][:CLIPPED_CHARS] + "…"
        whole = acme.get(f"/v1/memory/{note['id']}", params={"user": "u1"})
        assert whole.status_code == 200 and whole.json()["text"] == note["text"]
        assert len(note["text"]) > CLIPPED_CHARS
        assert acme.get(f"/v1/memory/{note['id']}", params={"user": "u2"}).status_code == 404
        assert globex.get(f"/v1/memory/{note['id']}", params={"user": "u1"}).status_code == 404


def test_a_listing_that_pages_by_number_refuses_any_other_cursor(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        turn = acme.post("/v1/sessions/s1/turns", json={"message": "Book Oslo", "user": "u1"})
        assert turn.status_code == 200, turn.text
        for path in ("/v1/sessions/s1/checkpoints", "/v1/sessions/s1/in-doubt"):
            refused = acme.get(path, params={"cursor": "abc"})
            assert refused.status_code == 422, refused.text
            assert "cursor" in refused.json()["error"]["message"]
        older = acme.get("/v1/sessions/s1/checkpoints", params={"cursor": "2"})
        assert [info["version"] for info in older.json()] == [1]
        assert acme.get("/v1/sessions/s1/in-doubt", params={"cursor": "0"}).json() == []


def test_a_query_parameter_the_route_does_not_take_is_refused_by_name(service: Service) -> None:
    """``?user=`` on /v1/runs once answered every user's runs, as if filtered by that user."""
    with service.client(service.keys.create("acme")) as acme:
        turn = acme.post("/v1/sessions/s1/turns", json={"message": "Book Oslo", "user": "u1"})
        assert turn.status_code == 200, turn.text
        refused = acme.get("/v1/runs", params={"user": "u2", "limit": 5})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "UnknownParameter" and error["message"].startswith("user:")
        assert "session" in error["message"]  # what the route does take
        for path in ("/v1/sessions/s1", "/v1/sessions/s1/checkpoints", "/v1/approvals"):
            assert acme.get(path, params={"tenant": "other"}).status_code == 400, path
        assert acme.get("/v1/runs", params={"session": "s1", "limit": 5}).status_code == 200
        assert acme.get("/health", params={"probe": "lb"}).status_code == 200
