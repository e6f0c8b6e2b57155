"""An ``Idempotency-Key`` sent again over real HTTP once its session no longer keeps the
reply (16 newer keyed turns): the same request gets the same reply and books nothing again;
the key with another message is 422 and books nothing."""

from __future__ import annotations

from tests.service.conftest import Service


def test_a_late_retry_of_a_keyed_turn_gets_its_reply_and_runs_once(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:

        def send(text: str, key: str) -> dict[str, object]:
            body = {"message": text, "user": "u1"}
            response = acme.post(
                "/v1/sessions/s1/turns", json=body, headers={"Idempotency-Key": key}
            )
            assert response.status_code == 200, response.text
            reply: dict[str, object] = response.json()
            return reply

        first = send("Book Oslo", "order-1")
        for n in range(16):
            send(f"Book C{n}", f"order-{n + 2}")
        retried = send("Book Oslo", "order-1")
        assert retried["replayed"] and retried["run_id"] == first["run_id"]
        assert retried["text"] == first["text"]
        assert service.booked.count("Oslo") == 1, "the late retry booked again"
        reused = acme.post(
            "/v1/sessions/s1/turns",
            json={"message": "Book Lima", "user": "u1"},
            headers={"Idempotency-Key": "order-1"},
        )
        assert reused.status_code == 422 and "another message" in reused.json()["error"]["message"]
    assert "Lima" not in service.booked
