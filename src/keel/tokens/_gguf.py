"""Exact token counts for a GGUF model, from the tokenizer stored in the GGUF file itself.

llama.cpp loads only the vocabulary (``vocab_only``), which takes milliseconds and no weights,
and tokenizes exactly as it does at inference time.
"""

from __future__ import annotations

import atexit
import threading
from functools import cache
from pathlib import Path
from typing import Any

from keel._assets import smollm2_gguf
from keel._llama import silence_llama_logs
from keel.errors import UnknownModelError
from keel.tokens._base import ExactTokenizer

__all__ = ["GGUFTokenizer", "gguf_tokenizer"]


class GGUFTokenizer(ExactTokenizer):
    """The tokenizer embedded in a GGUF model file."""

    def __init__(self, name: str, path: Path) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:  # the local-model extra is not installed
            raise UnknownModelError(
                name, "exact counts need llama-cpp-python (the 'local' extra)"
            ) from exc
        silence_llama_logs()
        super().__init__(name)
        self.path = path
        self._vocab: Any = Llama(model_path=str(path), vocab_only=True, verbose=False)
        # llama.cpp's tokenizer keeps per-call scratch state; one caller at a time.
        self._lock = threading.Lock()
        # Free the native vocabulary before interpreter teardown: llama-cpp-python's own
        # finalizer fails noisily once the ctypes module is half gone.
        atexit.register(self.close)

    def close(self) -> None:
        """Release the native vocabulary (idempotent)."""
        with self._lock:
            vocab, self._vocab = self._vocab, None
        if vocab is not None:
            vocab.close()

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text: special-token spellings inside it are not special."""
        if not text:
            return []
        with self._lock:
            return list(self._vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def encode_template(self, text: str) -> list[int]:
        """Token ids of rendered chat-template text, where ``<|im_start|>`` is one token."""
        if not text:
            return []
        with self._lock:
            return list(self._vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, tokens: list[int]) -> str:
        with self._lock:
            return bytes(self._vocab.detokenize(tokens)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"GGUFTokenizer({self._name!r})"


@cache
def gguf_tokenizer(name: str) -> GGUFTokenizer:
    """The tokenizer of a bundled GGUF model (``smollm2``), loaded once."""
    if name != "smollm2":
        raise UnknownModelError(name, "bundled GGUF models: smollm2")
    # ModelNotInstalledError when the model is absent: it names `keel models install`.
    return GGUFTokenizer(f"gguf:{name}", smollm2_gguf())
