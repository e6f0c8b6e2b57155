"""The PII vault over HTTP: who reads values, who reads placeholders, and an operator's
``POST /v1/privacy/forget``; every request real HTTP to uvicorn on 127.0.0.1."""

from __future__ import annotations

from tests.service.conftest import Service


def test_forget_without_a_vault_is_404_and_a_user_key_never_reaches_it(service: Service) -> None:
    operator = service.client(service.keys.create("acme"))
    user = service.client(service.keys.create("acme", "u1"))
    with operator, user:
        answered = operator.post("/v1/privacy/forget", json={"user_id": "u1"})
        assert answered.status_code == 404
        assert "no PII vault" in answered.json()["error"]["message"]
        assert user.post("/v1/privacy/forget", json={"user_id": "u1"}).status_code == 404
        assert operator.post("/v1/privacy/forget", json={"user": "u1"}).status_code == 422
        schema = operator.get("/openapi.json").json()
        assert "post" in schema["paths"]["/v1/privacy/forget"]
