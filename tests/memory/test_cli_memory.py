from __future__ import annotations

import json

import pytest

from keel.cli import main
from keel.memory import Scope
from keel.settings import load_settings
from keel.stores import Backends


def test_reembed_after_a_model_change(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:32")
    with Backends.open(load_settings(), background=False) as backends:
        memory = backends.memory
        assert memory is not None
        memory.add("first memory", scope=Scope(tenant_id="t", user_id="u"))
        memory.add("second memory", scope=Scope(tenant_id="t", user_id="v"))
        memory.flush()
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:48")
    assert main(["memory", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status["needs_reembed"] and status["stale"] == 2
    assert main(["memory", "reembed", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["reembedded"] == 2 and result["after"] == {"keel-hashing-48": 2}
    assert main(["memory", "reembed"]) == 0
    assert "re-embedded 0 records" in capsys.readouterr().out
