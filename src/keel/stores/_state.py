"""Kept for the import path ``keel.stores._state.open_state_backend``: the state backend is
opened by the one opener, `keel.stores._open`."""

from __future__ import annotations

from keel.stores._open import open_state_backend

__all__ = ["open_state_backend"]
