"""Static embeddings (model2vec): one vector per token, averaged per text, no network at all.

[`StaticEmbedder`][] reads a model2vec folder. By default that folder is distilled from the
bundled all-MiniLM-L6-v2 on this machine (about 30 s on 2 cores, through torch, once) and kept
in the cache folder; every later embedder loads it in milliseconds. A text is embedded by a
table look-up per token instead of a transformer pass: hundreds of times faster than MiniLM on
a CPU, for some loss of recall (``keel bench locomo --embedder local:minilm-static`` measures
both side by side).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from keel._assets import minilm_dir
from keel.errors import ConfigError
from keel.memory._embedders import Embedder, FloatArray, _LoadedModels, _normalize

__all__ = ["STATIC_MINILM", "StaticEmbedder", "distill_minilm"]

STATIC_MINILM = "all-MiniLM-L6-v2-static"
"""The name stem of the static embeddings distilled from the bundled all-MiniLM-L6-v2."""

_MANIFEST = "keel.json"
_WEIGHTS = "model.safetensors"


def _default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("keel")) / "models"


def distill_minilm(cache_dir: Path | None = None, *, dimension: int = 256) -> Path:
    """The folder of static embeddings distilled from the bundled all-MiniLM-L6-v2, at
    ``dimension`` (PCA), built on first use and reused after.

    The build writes into a temporary folder that is renamed into place when complete, so a
    process killed mid-build leaves nothing half-written, and two processes that build at once
    both end with the same complete folder (the later rename loses, its copy is deleted).

    Raises:
        ConfigError: the folder is absent and the distillation libraries (keel's
            ``static-embeddings`` extra: model2vec, torch, transformers) are not installed.
    """
    cache = cache_dir if cache_dir is not None else _default_cache_dir()
    target = cache / f"{STATIC_MINILM}-{dimension}"
    if (target / _MANIFEST).is_file():
        return target
    source = minilm_dir()
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from model2vec.distill import distill
    except ImportError as exc:
        raise ConfigError(
            "distilling static embeddings needs model2vec[distill] and torch: "
            "pip install 'keel-runtime[static-embeddings]'"
        ) from exc
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    try:
        _quiet_transformers()
        model = distill(model_name=str(source), pca_dims=dimension, device="cpu")
        model.save_pretrained(str(building))
        digest = hashlib.sha256((building / _WEIGHTS).read_bytes()).hexdigest()[:12]
        manifest = {
            # The weights' digest is in the name stored with every vector: static embeddings
            # distilled elsewhere (another library version, another machine's float rounding)
            # are another model, and keel sees the change instead of mixing the two.
            "name": f"{STATIC_MINILM}-{dimension}-{digest}",
            "source": "all-MiniLM-L6-v2",
            "dimension": dimension,
        }
        (building / _MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        try:
            building.rename(target)
        except OSError:
            if not (target / _MANIFEST).is_file():
                raise
            # Another process finished first: its folder stands.
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _quiet_transformers() -> None:
    """The model's load report is not the caller's output (model2vec's own progress bar, on
    stderr, stays: a 30 s build should say that it is working)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


class StaticEmbedder(Embedder):
    """Static token embeddings (a model2vec folder): fast on any CPU, weaker than MiniLM.

    Args:
        path: a model2vec folder. None: the embeddings distilled from the bundled
            all-MiniLM-L6-v2 ([`distill_minilm`][]), built into ``cache_dir`` on first use.
        name: the name stored with each vector; the folder's ``keel.json`` name (which carries
            a digest of the weights) or the folder name by default.
        dimension: the PCA dimension of the distilled default (ignored with ``path``).
        cache_dir: where the distilled default is kept; the user's cache folder by default.

    Raises:
        ConfigError: the folder is not a model2vec folder, or the default cannot be built.
    """

    _models = _LoadedModels()
    cheap_queries = True  # a query is a look-up of its tokens' rows and a mean
    loads_model = True  # loaded when made (its dimension is read): warm is one cheap pass

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        name: str | None = None,
        dimension: int = 256,
        cache_dir: Path | None = None,
    ) -> None:
        folder = Path(path) if path is not None else distill_minilm(cache_dir, dimension=dimension)
        if not (folder / _WEIGHTS).is_file():
            raise ConfigError(f"{folder}: not a model2vec folder (no {_WEIGHTS})")
        self.path = str(folder)
        manifest = folder / _MANIFEST
        stored = json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else {}
        self.name = name or str(stored.get("name") or folder.name)
        self.dimension = int(self._model().dim)

    def _model(self) -> Any:
        return self._models.get(self.path, self._open)

    def _open(self) -> Any:
        try:
            from model2vec import StaticModel
        except ImportError as exc:
            raise ConfigError(
                "static embeddings need model2vec: pip install 'keel-runtime[static-embeddings]'"
            ) from exc
        return StaticModel.from_pretrained(self.path)

    def embed(self, texts: Sequence[str]) -> FloatArray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # No worker processes: forking inside a host application (a server, an agent with
        # open database connections) is not an embedder's call to make.
        vectors = self._model().encode(
            list(texts), show_progress_bar=False, use_multiprocessing=False
        )
        return _normalize(vectors)
