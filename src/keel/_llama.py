"""Shared llama.cpp plumbing: native log output goes nowhere unless asked for.

llama.cpp writes diagnostics straight to the process's stderr from C, even with
``verbose=False`` (for example a context-size note when only the vocabulary is loaded). keel
installs a no-op log callback once, so a CLI's output stays what the user asked for.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["silence_llama_logs"]

_lock = threading.Lock()
_callback: Any = None  # kept referenced: llama.cpp calls it from C for the process lifetime


def silence_llama_logs() -> None:
    """Route llama.cpp's native log messages to a no-op (idempotent, thread-safe)."""
    global _callback
    with _lock:
        if _callback is not None:
            return
        import llama_cpp

        def _discard(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            return None

        _callback = llama_cpp.llama_log_callback(_discard)
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
