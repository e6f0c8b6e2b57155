"""The approvals routes fed schemathesis' generated requests over real HTTP, on a service whose
queue holds requests (of this tenant, of another, of each kind): none answers 5xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.approvals.conftest import Approvals, add_queue


def test_no_generated_request_to_the_approvals_routes_gets_a_server_error(
    approvals: Approvals,
) -> None:
    add_queue(approvals)
    schema = schemathesis.openapi.from_url(f"{approvals.url}/openapi.json")
    failures: list[str] = []
    operations = 0
    keys = (approvals.keys.create("acme"), approvals.keys.create("acme", user_id="alice"))
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith("/v1/approvals"):
            continue
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=40,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        def check(case: Any) -> None:
            for key in keys:  # the operator's, and a user's
                response = case.call(headers={"Authorization": f"Bearer {key}"})
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")

        check()
    assert operations == 3
    assert not failures, failures[:5]
