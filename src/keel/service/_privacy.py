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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from keel._bridge import run_blocking
from keel.errors import PlaceholderError
from keel.privacy import PLACEHOLDER, placeholders_in

if TYPE_CHECKING:
    from keel.privacy import PIIMasker, UserVault, Vault
    from keel.service._keys import Caller

__all__ = ["Disclosure"]

_Payload = TypeVar("_Payload")


@dataclass(frozen=True)
class Disclosure:
    """The service's vault (None: off, placeholders as the masker wrote them) and whether a
    tenant's operator key reads its users' values."""

    vault: Vault | None = None
    operators_see_values: bool = False

    def viewer(self, who: Caller, owner: str | None) -> UserVault | None:
        """The view of the vault that shows ``owner``'s values to ``who``; None when ``who``
        reads placeholders (an operator not granted values, or no vault)."""
        if self.vault is None or owner is None:
            return None
        if who.user_id is not None:
            # A user key reads its own user's data only (the routes answer 404 otherwise).
            return self.vault.user(who.tenant_id, owner) if who.user_id == owner else None
        return self.vault.user(who.tenant_id, owner) if self.operators_see_values else None

    async def shown(self, who: Caller, owner: str | None, payload: _Payload) -> _Payload:
        """``payload`` (JSON-ready: dicts, lists, strings) as ``who`` may read ``owner``'s
        data: the owner's placeholders replaced by their values, or left as they are."""
        return await revealed(self.viewer(who, owner), payload)

    async def masked(
        self, masker: PIIMasker | None, tenant_id: str, user_id: str, text: str
    ) -> str:
        """``text`` masked with the user's stable placeholders, its values kept in the vault
        (what a user writes outside a turn, a memory note, is numbered as a turn numbers it:
        masked without the vault, ``<EMAIL_1>`` would stand for another of the user's
        values). Without a vault or a masker, ``text`` as it is (the store masks it)."""
        if self.vault is None or masker is None:
            return text
        numbering = self.vault.user(tenant_id, user_id).placeholder
        return await run_blocking(masker.mask_text, text, tenant_id=tenant_id, numbering=numbering)


async def revealed(viewer: UserVault | None, payload: _Payload) -> _Payload:
    """``payload`` with every placeholder ``viewer`` can resolve replaced by its value, in
    every string it holds; another user's, erased or unknown placeholders stay as written.
    The values are read from the vault in one look-up, off the event loop."""
    if viewer is None:
        return payload
    found = list(dict.fromkeys(p for text in _strings(payload) for p in placeholders_in(text)))
    if not found:
        return payload
    values = await run_blocking(_resolvable, viewer, found)
    if not values:
        return payload
    replaced: _Payload = _replace(payload, values)
    return replaced


def _resolvable(viewer: UserVault, placeholders: list[str]) -> dict[str, str]:
    """The values of those of ``placeholders`` that ``viewer`` resolves (all at once when it
    resolves them all, one by one to leave the others out otherwise)."""
    try:
        return viewer.values(placeholders)
    except PlaceholderError:
        pass
    values: dict[str, str] = {}
    for placeholder in placeholders:
        try:
            values.update(viewer.values([placeholder]))
        except PlaceholderError:
            continue
    return values


def _strings(payload: Any) -> Iterator[str]:
    if isinstance(payload, str):
        yield payload
    elif isinstance(payload, dict):
        for item in payload.values():
            yield from _strings(item)
    elif isinstance(payload, list | tuple):
        for item in payload:
            yield from _strings(item)


def _replace(payload: Any, values: dict[str, str]) -> Any:
    if isinstance(payload, str):
        return PLACEHOLDER.sub(lambda match: values.get(match.group(0), match.group(0)), payload)
    if isinstance(payload, dict):
        return {name: _replace(item, values) for name, item in payload.items()}
    if isinstance(payload, list | tuple):
        return [_replace(item, values) for item in payload]
    return payload
