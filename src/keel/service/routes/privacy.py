"""A tenant's operator forgets one of its users (the PII vault's values), or erases them from
every store."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_blocking
from keel.service._access import access_log, caller
from keel.service._context import ServiceContext, context_of
from keel.service._errors import HTTPError
from keel.service._ids import UserId
from keel.service._keys import Caller

__all__ = ["EraseRequest", "ForgetRequest", "router"]

router = APIRouter()


class ForgetRequest(BaseModel):
    """The user whose values to erase (of the key's tenant)."""

    model_config = ConfigDict(extra="forbid")

    user_id: UserId = Field(description="The user to forget.")


@router.post(
    "/v1/privacy/forget",
    responses={404: {"description": "Not an operator key, or the service keeps no PII vault"}},
)
async def forget_user(
    body: ForgetRequest,
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Erase a user of this operator key's tenant from the PII vault: their data key and
    sealed values are destroyed, so none of their values can be recovered by any worker, even
    with the master key and a copy of the database; histories keep their placeholders. Answers
    how many values were erased (0 for a user with none). Only a tenant's operator key may
    (a user key gets 404)."""
    if not who.operator:
        raise HTTPError(404, "NotFound", "not found")
    vault = context.privacy.vault
    if vault is None:
        raise HTTPError(404, "NotFound", "this service keeps no PII vault (set KEEL_PII_KEY)")
    erased = await run_blocking(vault.forget, who.tenant_id, body.user_id)
    access_log.info(
        "operator key %s forgot user %s (%d values erased)",
        who.key_id,
        body.user_id,
        erased,
        extra={"tenant": who.tenant_id, "key_id": who.key_id, "forgot": body.user_id},
    )
    return {"user_id": body.user_id, "erased": erased}


class EraseRequest(BaseModel):
    """The user to erase from every store (of the key's tenant)."""

    model_config = ConfigDict(extra="forbid")

    user_id: UserId = Field(description="The user to erase.")


@router.post(
    "/v1/privacy/erase",
    responses={404: {"description": "Not an operator key, or the service cannot erase"}},
)
async def erase_user(
    body: EraseRequest,
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Erase a user of this operator key's tenant from every store: their sessions and
    checkpoints, tool journal, approvals, traces, memory, vault rows and API keys (another
    tenant's user of the same id is left alone). Answers what was removed, by store and
    table, with the id of the erasure's audit row (which holds counts, never the user).
    Idempotent: a rerun after a failure finishes the job. Only a tenant's operator key may
    (a user key gets 404). Run it while the user has no turn in flight: a turn running
    meanwhile may write again what it held."""
    if not who.operator:
        raise HTTPError(404, "NotFound", "not found")
    if context.erase_user is None:
        raise HTTPError(404, "NotFound", "this service cannot erase users")
    try:
        report = await context.erase_user(who.tenant_id, body.user_id, f"operator key {who.key_id}")
    finally:
        # The erasure deleted the user's keys (or may have, before it failed); this worker's
        # cache of verified keys still held them.
        context.keys.forget_user(who.tenant_id, body.user_id)
    access_log.info(
        "operator key %s erased a user (%d rows, erasure %s)",
        who.key_id,
        report.total,
        report.erasure_id,
        extra={"tenant": who.tenant_id, "key_id": who.key_id, "erasure": report.erasure_id},
    )
    return report.to_dict()
