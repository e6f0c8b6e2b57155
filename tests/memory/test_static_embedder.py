"""Static embeddings distilled from the bundled MiniLM (model2vec): built once, offline, safely,
and good enough that an agent recalls by meaning, not by shared words."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from keel.errors import ConfigError
from keel.memory import StaticEmbedder, distill_minilm, embedder_from_spec
from keel.memory._static import STATIC_MINILM
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder whose ``models`` holds the distilled embeddings (built once, ~40 s)."""
    root = tmp_path_factory.mktemp("keel-data")
    distill_minilm(root / "models")
    return root


def test_the_spec_builds_once_into_the_data_folder_and_names_the_weights(data_dir: Path) -> None:
    folder = data_dir / "models" / f"{STATIC_MINILM}-256"
    built_at = (folder / "model.safetensors").stat().st_mtime_ns
    embedder = embedder_from_spec("local:minilm-static", load_settings(data_dir=data_dir))
    assert isinstance(embedder, StaticEmbedder) and embedder.dimension == 256
    # The name stored with each vector carries a digest of the weights.
    assert embedder.name.startswith(f"{STATIC_MINILM}-256-") and len(embedder.name) > 30
    assert (folder / "model.safetensors").stat().st_mtime_ns == built_at  # reused, not rebuilt
    # Nothing half-built is left next to it.
    assert [p.name for p in (data_dir / "models").iterdir()] == [folder.name]
    vectors = embedder.embed(["I adopted a puppy", "", "tax forms are due in April"])
    assert vectors.shape == (3, 256) and vectors.dtype == np.float32
    norms = np.linalg.norm(vectors, axis=1)
    assert norms[0] == pytest.approx(1.0, abs=1e-5) and norms[2] == pytest.approx(1.0, abs=1e-5)


def test_meaning_is_closer_than_unrelated_text(data_dir: Path) -> None:
    embedder = StaticEmbedder(cache_dir=data_dir / "models")
    pets, puppy, tax = embedder.embed(
        ["Do I have any pets?", "I adopted a puppy from the shelter", "The tax filing is due"]
    )
    assert float(pets @ puppy) > float(pets @ tax) + 0.1


async def test_an_agent_recalls_by_meaning_across_sessions(data_dir: Path, tmp_path: Path) -> None:
    def policy(call: ScriptedCall) -> Message | str:
        return "Noted."

    model = ScriptedModel(policy)
    settings = load_settings(
        data_dir=data_dir,
        database=f"sqlite:///{tmp_path / 'keel.db'}",
        embedder="local:minilm-static",
    )
    async with Agent.open(settings=settings, model=model, system_prompt="You help.") as agent:
        assert agent.memory is not None
        assert agent.memory.embedder.name.startswith(STATIC_MINILM)
        await agent.handle("s1", "ada", "I adopted a puppy from the shelter last week.")
        await agent.handle("s1", "ada", "The quarterly tax filing is due in April.")
        await agent.memory.aflush()
        # No word in common with the puppy turn: only the vectors can find it.
        await agent.handle("s2", "ada", "Do I have any pets?")
        recalled = [m.content for m in model.calls[-1].messages if m.role == "system"]
        assert any("puppy" in text for text in recalled)


_QUICK_BUILD = """
import os, sys
from pathlib import Path
import numpy as np
import model2vec.distill
from model2vec import StaticModel
from tokenizers import Tokenizer
from keel._assets import minilm_dir
from keel.memory import StaticEmbedder, distill_minilm

tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
# The distillation itself is not under test here (the module's fixture runs it for real).
model2vec.distill.distill = lambda **options: StaticModel(
    vectors=np.ones((tokenizer.get_vocab_size(), 32), dtype=np.float32), tokenizer=tokenizer
)
save = StaticModel.save_pretrained

def killed_mid_write(self, path):
    save(self, path)
    (Path(path) / "model.safetensors").write_bytes(b"partial")
    os._exit(9)  # the process dies: no cleanup runs

if sys.argv[2] == "kill":
    StaticModel.save_pretrained = killed_mid_write
embedder = StaticEmbedder(cache_dir=Path(sys.argv[1]), dimension=32)
print(embedder.dimension, embedder.embed(["a puppy"]).shape)
"""


def test_a_build_killed_mid_write_is_never_taken_for_a_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    models = tmp_path / "models"
    build = [sys.executable, "-c", _QUICK_BUILD, str(models)]
    killed = subprocess.run([*build, "kill"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == 9, killed.stderr
    # What the dead build wrote is not a model: the next embedder builds it again.
    assert not (models / f"{STATIC_MINILM}-32").exists()
    again = subprocess.run([*build, "ok"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["32", "(1,", "32)"]
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == [
        f"{STATIC_MINILM}-32"
    ]


def test_bad_specs_and_folders_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dimension must be 1 to 16000"):
        embedder_from_spec("local:minilm-static/wide")
    with pytest.raises(ConfigError, match="needs a folder"):
        embedder_from_spec("model2vec:")
    with pytest.raises(ConfigError, match="not a model2vec folder"):
        embedder_from_spec(f"model2vec:{tmp_path}")
