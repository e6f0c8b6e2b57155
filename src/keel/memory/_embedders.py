"""Embedders: text -> unit-length float32 vectors, named so a model change is detected.

[`OnnxEmbedder`][] runs all-MiniLM-L6-v2 (or another BERT-family sentence encoder) offline on
ONNX Runtime, the default; [`SentenceTransformerEmbedder`][] runs any sentence-transformers
model through torch;
[`OpenAIEmbedder`][] calls any OpenAI-compatible ``/embeddings`` endpoint;
[`HashingEmbedder`][] needs nothing installed (feature hashing; weak semantics, fast tests).
Provider libraries are imported lazily, inside the classes that use them.
"""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from keel._assets import minilm_dir
from keel._bridge import map_blocking, run_blocking
from keel.errors import ConfigError, ModelError, ModelUnavailableError
from keel.memory._onnx import BertConfig, build_bert_encoder
from keel.memory._text import word_set

__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "Embedder",
    "HashingEmbedder",
    "OnnxEmbedder",
    "OpenAIEmbedder",
    "SentenceTransformerEmbedder",
    "default_embedder",
]

FloatArray = npt.NDArray[np.float32]

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"


def _normalize(matrix: npt.NDArray[Any]) -> FloatArray:
    array = np.asarray(matrix, dtype=np.float32)
    if array.ndim == 1:
        array = array.reshape(1, -1)
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    normalized: FloatArray = (array / norms).astype(np.float32, copy=False)
    return normalized


class _LoadedModels:
    """Models loaded once per folder for the whole process: every embedder of one folder
    shares the loaded model, and two threads never load it twice."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, folder: str, load: Callable[[], Any]) -> Any:
        with self._lock:
            model = self._loaded.get(folder)
            if model is None:
                model = self._loaded[folder] = load()
            return model


RECENT_QUERIES = 256
"""Query vectors an embedder keeps, by text (`Embedder.embed_one`)."""


class _RecentVectors:
    """The vectors of the last ``size`` texts embedded one at a time, by text (thread-safe)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.computed = 0  # texts that were embedded (not found here)
        # In use order, the least recent first: a hit moves to the end and the least recent
        # goes in one step (a plain dict, popped and set again, found its first entry past
        # every slot those moves emptied).
        self._vectors: OrderedDict[str, FloatArray] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, text: object) -> bool:
        return text in self._vectors

    def vector(self, text: str, embed: Callable[[Sequence[str]], FloatArray]) -> FloatArray:
        with self._lock:
            found = self._vectors.get(text)
            if found is not None:
                self._vectors.move_to_end(text)  # the most recent again
        if found is None:
            found = np.array(embed([text])[0], dtype=np.float32)
            found.flags.writeable = False  # shared by every caller that asks for the text
            with self._lock:
                self.computed += 1
                self._vectors[text] = found
                while len(self._vectors) > self.size:
                    self._vectors.popitem(last=False)
        return found


class Embedder(ABC):
    """Turns texts into unit vectors. ``name`` is stored with every vector."""

    name: str
    dimension: int
    #: A query's vector costs about what handing it to a thread would (no model to run):
    #: computed where the search needs it, never overlapped with another query.
    cheap_queries: bool = False
    #: The vectors come from a model this process loads on its first [`embed`][] (a second
    #: or two for MiniLM): [`warm`][] loads it ahead.
    loads_model: bool = False

    @abstractmethod
    def embed(self, texts: Sequence[str]) -> FloatArray:
        """One unit-length row per text, shape ``(len(texts), dimension)``."""

    def warm(self) -> bool:
        """Load now what the first [`embed`][] would (the model, its tokenizer, the runtime's
        first pass), so that no request waits for it: a server calls it before it takes
        traffic. True when a model was loaded; an embedder with none to load (a remote API,
        hashing) does nothing and returns False. Blocking: an event loop runs it through
        ``run_blocking``."""
        if not self.loads_model:
            return False
        self.embed(["warm"])
        return True

    async def aembed(self, texts: Sequence[str]) -> FloatArray:
        """``embed`` without blocking the event loop."""
        return await run_blocking(self.embed, texts)

    def embed_one(self, text: str) -> FloatArray:
        """The vector of one text, shape ``(dimension,)``: a search's query. The last
        ``RECENT_QUERIES`` texts' vectors are kept, so a text asked again (the same query
        searched twice in a turn, a retried turn) costs no second pass of the model."""
        return self._recent_vectors().vector(text, self.embed)

    def has_query(self, text: str) -> bool:
        """Whether [`embed_one`][]'s vector of ``text`` is kept (asking for it costs nothing)."""
        return text in self._recent_vectors()

    def _recent_vectors(self) -> _RecentVectors:
        recent: _RecentVectors | None = self.__dict__.get("_recent")
        if recent is None:
            recent = self.__dict__.setdefault("_recent", _RecentVectors(RECENT_QUERIES))
        return recent

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, dimension={self.dimension})"


class OnnxEmbedder(Embedder):
    """A BERT-family sentence encoder on ONNX Runtime; all-MiniLM-L6-v2 from its package by default.

    The encoder graph is built in memory from the folder's ``model.safetensors`` (no torch, no
    export step) and gives the same vectors as sentence-transformers (cosine > 0.99999), so
    records embedded by either are interchangeable. Texts are sorted by length and run in small
    batches, which keeps padding (wasted work) low.

    Args:
        path: a sentence-transformers folder; the bundled all-MiniLM-L6-v2 when None.
        name: the name stored with each vector; the folder name by default.
        batch_size: texts per forward pass.
        threads: forward passes run at once for a batch of texts; all available CPUs by
            default. Each pass runs on one thread, so a single query (the search path) never
            takes more than one core from the agent and SQLite.
    """

    _sessions = _LoadedModels()
    loads_model = True

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        name: str | None = None,
        batch_size: int = 16,
        threads: int | None = None,
    ) -> None:
        folder, self.name = _model_folder(path, name)
        self.path = str(folder)
        self.config = BertConfig.from_folder(folder)
        self.dimension = self.config.hidden_size
        self.batch_size = max(1, batch_size)
        self.threads = threads or _available_cpus()

    def _load(self) -> tuple[Any, Any]:
        loaded: tuple[Any, Any] = self._sessions.get(self.path, self._open)
        return loaded

    def _open(self) -> tuple[Any, Any]:
        try:
            import onnxruntime
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(
                "the ONNX embedder needs onnxruntime, onnx and tokenizers: "
                "pip install 'keel-runtime[embeddings]'"
            ) from exc
        folder = Path(self.path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.no_padding()
        tokenizer.enable_truncation(self.config.max_seq_length)
        options = onnxruntime.SessionOptions()
        # One thread per forward pass; batches run several passes at once (run() is
        # thread-safe and releases the GIL). No spinning pool fighting SQLite for the CPU.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(
            build_bert_encoder(folder, self.config), options, providers=["CPUExecutionProvider"]
        )
        return session, tokenizer

    def embed(self, texts: Sequence[str]) -> FloatArray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        session, tokenizer = self._load()
        encodings = tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        output = np.zeros((len(texts), self.dimension), dtype=np.float32)

        def run(chunk: list[int]) -> None:
            width = max(1, *(len(encodings[i].ids) for i in chunk))
            input_ids = np.zeros((len(chunk), width), dtype=np.int64)
            attention_mask = np.zeros((len(chunk), width), dtype=np.int64)
            for row, i in enumerate(chunk):
                ids = encodings[i].ids
                input_ids[row, : len(ids)] = ids
                attention_mask[row, : len(ids)] = 1
            (pooled,) = session.run(
                ["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask}
            )
            output[chunk] = pooled

        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        # Up to ``threads`` passes at once on keel's blocking pool (this thread runs one).
        map_blocking(run, chunks, width=self.threads)
        return _normalize(output)


def _model_folder(path: str | Path | None, name: str | None) -> tuple[Path, str]:
    """The model folder and the name its vectors are stored under."""
    if path is not None:
        folder = Path(path)
        return folder, name or folder.name
    # ModelNotInstalledError (a ConfigError) when absent: it names `keel models install`.
    return minilm_dir(), name or DEFAULT_EMBEDDING_MODEL


class SentenceTransformerEmbedder(Embedder):
    """A sentence-transformers model on the CPU; all-MiniLM-L6-v2 from its package by default.

    The model loads on first use (torch import included, a few seconds) and is shared by every
    embedder created for the same folder in this process.
    """

    _models = _LoadedModels()
    loads_model = True

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        name: str | None = None,
        batch_size: int = 64,
        threads: int | None = None,
    ) -> None:
        folder, self.name = _model_folder(path, name)
        self.path = str(folder)
        self.batch_size = batch_size
        # Intra-op threads for batches. Short queries always use one thread: on a loaded or
        # small machine, torch's spinning worker threads turn a 10 ms query into a second.
        self.threads = threads or max(1, _available_cpus() // 2)
        self.dimension = (
            384
            if self.name == DEFAULT_EMBEDDING_MODEL
            else self._model().get_sentence_embedding_dimension()
        )
        self._lock = threading.Lock()

    def _model(self) -> Any:
        return self._models.get(self.path, self._open)

    def _open(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ConfigError(
                "the sentence-transformers embedder needs torch and sentence-transformers: "
                "pip install 'keel-runtime[sentence-transformers]'"
            ) from exc
        from transformers.utils import logging as transformers_logging

        # A library's load progress bar is not the caller's output.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        return SentenceTransformer(self.path, device="cpu")

    def embed(self, texts: Sequence[str]) -> FloatArray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        model = self._model()
        import torch

        # torch modules are not re-entrant across threads; one encode at a time per embedder.
        with self._lock:
            torch.set_num_threads(1 if len(texts) < 16 else self.threads)
            vectors = model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return _normalize(vectors)


class OpenAIEmbedder(Embedder):
    """Any OpenAI-compatible embeddings endpoint (OpenAI, vLLM, Ollama, LM Studio, TEI...).

    Args:
        model: the endpoint's model name (stored with each vector).
        dimension: the vector size the model returns.
        base_url: the API root, e.g. ``http://localhost:8000/v1``; the SDK default if None.
        api_key: the key; ``OPENAI_API_KEY`` or a placeholder for keyless local servers.
        batch_size: texts per request.
        timeout: seconds per request.
    """

    def __init__(
        self,
        model: str,
        *,
        dimension: int,
        base_url: str | None = None,
        api_key: str | None = None,
        batch_size: int = 256,
        timeout: float = 30.0,
        max_retries: int = 2,
    ) -> None:
        self.name = model
        self.dimension = dimension
        self.base_url = base_url
        self.batch_size = batch_size
        import openai

        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
            timeout=timeout,
            max_retries=max_retries,
        )

    def embed(self, texts: Sequence[str]) -> FloatArray:
        import openai

        rows: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            try:
                response = self._client.embeddings.create(model=self.name, input=batch)
            except openai.APIConnectionError as exc:
                raise ModelUnavailableError(
                    f"embeddings endpoint unreachable: {exc}", model=self.name
                ) from exc
            except openai.APIError as exc:
                raise ModelError(f"embeddings request failed: {exc}", model=self.name) from exc
            data = sorted(response.data, key=lambda item: item.index)
            if len(data) != len(batch):
                raise ModelError(
                    f"embeddings endpoint returned {len(data)} vectors for {len(batch)} texts",
                    model=self.name,
                )
            rows.extend(list(item.embedding) for item in data)
        if not rows:
            return np.zeros((0, self.dimension), dtype=np.float32)
        matrix = _normalize(np.asarray(rows, dtype=np.float32))
        if matrix.shape[1] != self.dimension:
            raise ModelError(
                f"embeddings endpoint returned dimension {matrix.shape[1]}, "
                f"configured {self.dimension}",
                model=self.name,
            )
        return matrix


class HashingEmbedder(Embedder):
    """Feature-hashed bag of words: no model, no download, deterministic.

    Lexical only (it knows nothing about synonyms); useful for tests and for deployments that
    rely on keyword search and want vectors without torch.
    """

    cheap_queries = True

    def __init__(self, dimension: int = 256) -> None:
        self.dimension = dimension
        self.name = f"keel-hashing-{dimension}"

    def embed(self, texts: Sequence[str]) -> FloatArray:
        matrix = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in word_set(text):
                digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
                value = int.from_bytes(digest, "little")
                matrix[row, value % self.dimension] += 1.0 if (value >> 32) & 1 else -1.0
        return _normalize(matrix)


def _available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_embedder() -> Embedder:
    """The offline default: all-MiniLM-L6-v2 on ONNX Runtime."""
    return OnnxEmbedder()
