"""One error body per API, over real HTTP: keel's routes answer keel's ``{"error": {"type",
"message"}}`` for every error, the framework's own included (an unknown route, a wrong method,
a body that is not UTF-8 or nests too deeply); the OpenAI routes answer OpenAI's shape."""

from __future__ import annotations

import httpx

from tests.service._openai_service import OpenAIService, facade

__all__ = ["facade"]

_NOT_UTF8 = b'{"message": "caf\xe9", "user": "u1"}'
_TOO_DEEP = b'{"message": ' + b"[" * 100_000 + b"]" * 100_000 + b', "user": "u1"}'
_JSON = {"Content-Type": "application/json"}


def _keel_error(response: httpx.Response, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]


def _openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]


def test_keels_routes_answer_keels_error_body_for_every_error(facade: OpenAIService) -> None:
    with facade.http(facade.keys.create("acme")) as acme:
        _keel_error(acme.get("/v1/nowhere"), 404, "NotFound")
        wrong_method = acme.delete("/v1/sessions/s1/turns")
        _keel_error(wrong_method, 405, "MethodNotAllowed")
        assert wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["message"] == "DELETE is not allowed here (POST)"
        turns = "/v1/sessions/s1/turns"
        _keel_error(acme.post(turns, content=_NOT_UTF8, headers=_JSON), 400, "MalformedJSON")
        _keel_error(acme.post(turns, content=_TOO_DEEP, headers=_JSON), 400, "MalformedJSON")
        assert acme.get("/v1/sessions/s1").status_code == 404, "a refused body ran a turn"
    with facade.http(None) as anonymous:
        _keel_error(anonymous.get("/v1/nowhere"), 404, "NotFound")


def test_the_openai_routes_answer_openais_error_body(facade: OpenAIService) -> None:
    chat = "/v1/chat/completions"
    with facade.http(facade.keys.create("acme")) as acme:
        _openai_error(acme.get(chat), 405)
        _openai_error(acme.post(chat, content=_NOT_UTF8, headers=_JSON), 400)
        _openai_error(acme.post(chat, content=_TOO_DEEP, headers=_JSON), 400)
        _openai_error(acme.post(chat, content=b'{"model": ', headers=_JSON), 400)
        _openai_error(acme.post(chat, json={"model": "keel"}), 422, "messages")
        _openai_error(acme.delete("/v1/models"), 405)
        headers = facade.headers("s1")
        too_many = {"model": "keel", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        _openai_error(acme.post(chat, json=too_many, headers=headers), 400, "n")
    with facade.http(None) as anonymous:
        _openai_error(anonymous.post(chat, json={}), 401)
        assert anonymous.post(chat, json={}).json()["error"]["code"] == "invalid_api_key"
    assert facade.model.calls == []
