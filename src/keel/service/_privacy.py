"""Who reads values and who reads placeholders over HTTP, when the service has a PII vault.

Everything the service stores holds placeholders (``<EMAIL_3>``); the vault keeps the values,
sealed per tenant and user. A read of history (a session's messages, runs and their steps,
in-doubt calls, memory) shows the values to the user they belong to (a user key reading its
own data) and placeholders to the tenant's operator key, unless the deployment grants
operators values (``ServeOptions.operators_see_values``). Each read opens its own view of the
vault and drops it with the response: nothing outlives a request, so a ``forget`` in any
worker takes effect in every other at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from keel.privacy import PrivacyView, privacy_view

if TYPE_CHECKING:
    from keel.privacy import PIIMasker, Vault
    from keel.service._keys import Caller

__all__ = ["Disclosure"]

_Payload = TypeVar("_Payload")


@dataclass(frozen=True)
class Disclosure:
    """The service's vault (None: off, placeholders as the masker wrote them) and whether a
    tenant's operator key reads its users' values."""

    vault: Vault | None = None
    operators_see_values: bool = False

    def viewer(self, who: Caller, owner: str | None) -> PrivacyView:
        """The privacy view ``who`` reads ``owner``'s data through: one that reveals the
        owner's values, or one that reveals nothing (an operator not granted values, another
        user, or no vault)."""
        return privacy_view(None, who.tenant_id, owner, self._vault_for(who, owner))

    def reads_values(self, who: Caller, owner: str | None) -> bool:
        """Whether ``who`` may read ``owner``'s values: a user key its own user's, an operator
        key its users' where the deployment grants operators values."""
        if owner is None:
            return False
        if who.user_id is not None:
            # A user key reads its own user's data only (the routes answer 404 otherwise).
            return who.user_id == owner
        return self.operators_see_values

    def _vault_for(self, who: Caller, owner: str | None) -> Vault | None:
        return self.vault if self.reads_values(who, owner) else None

    async def masked(
        self, masker: PIIMasker | None, tenant_id: str, user_id: str, text: str
    ) -> str:
        """``text`` masked through ``user_id``'s privacy view before it is stored: their
        vault's numbering (what a user writes outside a turn is numbered as a turn numbers
        it: masked without the vault, ``<EMAIL_1>`` would stand for another of the user's
        values), or the masker alone without a vault."""
        return await privacy_view(masker, tenant_id, user_id, self.vault).amask(text)

    async def shown(self, who: Caller, owner: str | None, payload: _Payload) -> _Payload:
        """``payload`` (JSON-ready: dicts, lists, strings) as ``who`` may read ``owner``'s
        data: the owner's placeholders replaced by their values, or left as they are."""
        return await self.viewer(who, owner).revealed(payload)
