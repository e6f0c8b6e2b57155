"""The PII vault's erasure: a tenant's operator forgets one of its users."""

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

__all__ = ["ForgetRequest", "router"]

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
