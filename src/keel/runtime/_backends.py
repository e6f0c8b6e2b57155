"""The stores an agent runs on: :class:`~keel.stores.Backends`, opened by
:meth:`Backends.open <keel.stores.Backends.open>` (the one composition root, in
:mod:`keel.stores._open`), re-exported here where the runtime has always offered it."""

from __future__ import annotations

from keel.stores import Backends

__all__ = ["Backends"]
