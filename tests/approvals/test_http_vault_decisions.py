"""``POST /v1/approvals/{id}`` with corrected arguments on a service with a PII vault (issue 44,
defect 1): the correction is masked through the vault of the request's user, so the tool gets
exactly what the operator wrote. Masked per text, an order corrected to ``#11
ops@corp.example`` reached the tool as the user's own stored address."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.privacy import MasterKey
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedModel
from tests.approvals.conftest import Approvals, _shop_model, _shop_tools
from tests.approvals.test_http_decisions import _park
from tests.service.conftest import serving


@pytest.fixture
def vaulted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Approvals]:
    """The approvals service of ``conftest``, its stores opened with a PII vault."""
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    effects: list[str] = []
    release = threading.Event()
    app, agents, keys = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(_shop_model),
        tools=_shop_tools(effects, release),
        memory=False,
        settings=load_settings(data_dir=tmp_path),
    )
    assert agents.backends.vault is not None
    try:
        with serving(app) as running:
            yield Approvals(running.url, keys, agents.backends.approvals, effects, release)
    finally:
        release.set()
        agents.backends.close()


@pytest.mark.parametrize("stored_value", [True, False], ids=["user-with-a-value", "fresh-user"])
def test_a_corrected_order_reaches_the_tool_as_written(
    vaulted: Approvals, stored_value: bool
) -> None:
    # The model takes the order from the message: the user's address, masked (<EMAIL_1>).
    order = "alice@shop.example" if stored_value else "W3"
    with vaulted.client(vaulted.keys.create("acme")) as operator:
        request_id = _park(operator, f"refund {order} 900")
        decided = operator.post(
            f"/v1/approvals/{request_id}",
            json={"approve": True, "arguments": {"order": "#11 ops@corp.example", "amount": 400}},
        )
        assert decided.status_code == 200, decided.text
    assert vaulted.effects == ["refund #11 ops@corp.example 400"], (
        f"the tool ran {vaulted.effects}, not the operator's correction"
    )
