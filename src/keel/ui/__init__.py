"""The web trace viewer: runs, sessions, memory and health, served by ``keel serve`` at ``/ui``
and by ``keel ui`` on the embedded database."""

from keel.ui._router import mount_ui
from keel.ui._viewer import COOKIE

__all__ = ["COOKIE", "mount_ui"]
