"""Every route of the published OpenAPI schema, fed schemathesis' generated requests over real
HTTP with a valid key: none answers 5xx (bad input is the client's error, never the server's).

schemathesis' own pytest plugin does not run on this pytest, so the operations are driven here
with Hypothesis directly (derandomized in CI by the shared profile)."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.service.conftest import Service


def test_no_generated_request_gets_a_server_error(service: Service) -> None:
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    headers = {"Authorization": f"Bearer {service.keys.create('acme')}"}
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        def check(case: Any) -> None:
            response = case.call(headers=headers)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")

        check()
    assert operations >= 10
    assert not failures, failures[:5]
