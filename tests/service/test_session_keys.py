"""A session's store key: no two (tenant, session) pairs share one, whatever ``/`` and ``%``
their ids hold, and a state under a session's key that another tenant's agent wrote is not
that session's (``Agent.session_state`` and the service check the owner)."""

from __future__ import annotations

from urllib.parse import unquote

import httpx
from hypothesis import given
from hypothesis import strategies as st

from keel.runtime import session_key
from keel.state import AgentState
from tests.service.conftest import Service

_IDS = st.text(alphabet="ab/%2Fc", min_size=1, max_size=6).filter(lambda text: text.strip())


@given(tenant=_IDS, session=_IDS)
def test_a_key_spells_its_tenant_and_session_back(tenant: str, session: str) -> None:
    encoded_tenant, _, rest = session_key(tenant, session).partition("/")
    assert (unquote(encoded_tenant), rest) == (tenant, session)


@given(first=st.tuples(_IDS, _IDS), second=st.tuples(_IDS, _IDS))
def test_no_two_tenant_and_session_pairs_share_a_key(
    first: tuple[str, str], second: tuple[str, str]
) -> None:
    if first != second:
        assert session_key(*first) != session_key(*second)


def test_the_pair_a_shared_key_would_confuse_has_two_keys() -> None:
    assert session_key("acme/x", "s1") != session_key("acme", "x/s1")


def test_a_state_another_tenant_wrote_under_a_sessions_key_is_not_that_sessions(
    service: Service,
) -> None:
    slashed, plain = service.agents("acme/x"), service.agents("acme")
    assert slashed.run_sync("Book Oslo", session="s1", user="u1").status == "completed"
    theirs = slashed.session_state("s1")
    assert theirs is not None and theirs.runtime.tenant_id == "acme/x"
    # As a key built without encoding the tenant would have put it: under acme's "x/s1".
    plain.state.create(plain.session_key("x/s1"), theirs)
    assert plain.session_state("x/s1") is None
    with httpx.Client(
        base_url=service.url,
        headers={"Authorization": f"Bearer {service.keys.create('acme')}"},
        timeout=30,
    ) as acme:
        for path in ("/v1/sessions/x%2Fs1", "/v1/sessions/x%2Fs1/checkpoints"):
            assert acme.get(path).status_code == 404, path
        revert = {"version": 1, "expected_version": 1}
        assert acme.post("/v1/sessions/x%2Fs1/revert", json=revert).status_code == 404
    assert isinstance(slashed.session_state("s1"), AgentState)
