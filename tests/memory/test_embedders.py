from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from keel.errors import ConfigError, ModelError
from keel.memory import (
    Memory,
    OnnxEmbedder,
    OpenAIEmbedder,
    Scope,
    SentenceTransformerEmbedder,
    embedder_from_spec,
)
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.testing import ScriptedModel


def _vector(text: str, dimension: int) -> list[float]:
    rng = np.random.default_rng(sum(text.encode()))
    return [float(x) for x in rng.normal(size=dimension)]


class _Handler(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(
            {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
        )
        if body["model"] == "broken":
            self.send_response(400)
            payload = {"error": {"message": "bad model", "type": "invalid_request_error"}}
        else:
            self.send_response(200)
            inputs = body["input"]
            payload = {
                "object": "list",
                "model": body["model"],
                "data": [
                    {"object": "embedding", "index": i, "embedding": _vector(t, 8)}
                    for i, t in reversed(list(enumerate(inputs)))
                ],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
        data = json.dumps(payload).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def embeddings_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_compatible_endpoint_over_real_http(embeddings_url: str, tmp_path: Path) -> None:
    embedder = OpenAIEmbedder(
        "toy-embed", dimension=8, base_url=embeddings_url, api_key="k1", batch_size=2
    )
    vectors = embedder.embed(["alpha", "beta", "gamma"])
    assert vectors.shape == (3, 8)
    expected = np.asarray(_vector("beta", 8), dtype=np.float32)
    assert np.allclose(vectors[1], expected / np.linalg.norm(expected), atol=1e-6)
    assert [r["path"] for r in _Handler.requests] == ["/v1/embeddings", "/v1/embeddings"]
    assert _Handler.requests[0]["auth"] == "Bearer k1"
    mem = Memory(SQLiteMemoryStore(SQLiteDatabase(tmp_path / "o.db")), embedder=embedder)
    scope = Scope(tenant_id="t", user_id="u")
    record = mem.add("gamma", scope=scope)
    mem.flush()
    assert mem.get(scope, record.id).embedding_model == "toy-embed"  # type: ignore[union-attr]
    mem.close()


def test_openai_endpoint_errors_are_translated(embeddings_url: str) -> None:
    embedder = OpenAIEmbedder("broken", dimension=8, base_url=embeddings_url, max_retries=0)
    with pytest.raises(ModelError, match="embeddings request failed"):
        embedder.embed(["x"])
    wrong = OpenAIEmbedder("toy", dimension=16, base_url=embeddings_url)
    with pytest.raises(ModelError, match="dimension"):
        wrong.embed(["x"])


def test_embedder_specs(embeddings_url: str) -> None:
    assert embedder_from_spec("hashing:64").dimension == 64
    spec = embedder_from_spec(f"openai-compatible:toy/8@{embeddings_url}")
    assert spec.name == "toy" and spec.embed(["a"]).shape == (1, 8)
    with pytest.raises(ConfigError):
        embedder_from_spec("openai:no-dimension")
    with pytest.raises(ConfigError):
        embedder_from_spec("nope:thing")


@pytest.mark.slow
def test_minilm_finds_meaning_not_just_words(minilm: OnnxEmbedder, tmp_path: Path) -> None:
    assert minilm.name == "all-MiniLM-L6-v2" and minilm.dimension == 384
    mem = Memory(SQLiteMemoryStore(SQLiteDatabase(tmp_path / "s.db")), embedder=minilm)
    scope = Scope(tenant_id="t", user_id="u")
    dog = mem.add("I adopted a puppy from the shelter last week", scope=scope)
    mem.add("The quarterly tax filing is due in April", scope=scope)
    mem.add("My favourite colour is teal", scope=scope)
    mem.flush()
    hits = mem.search("Do I have any pets?", scope=scope, k=1)
    assert hits[0].record.id == dog.id and hits[0].keyword_rank is None
    mem.close()


def test_local_specs_choose_the_onnx_runtime(tmp_path: Path) -> None:
    default = embedder_from_spec("local:all-minilm-l6-v2")
    assert isinstance(default, OnnxEmbedder) and default.name == "all-MiniLM-L6-v2"
    assert default.dimension == 384
    assert isinstance(embedder_from_spec("sentence-transformers:"), SentenceTransformerEmbedder)
    with pytest.raises(ConfigError, match=r"no readable config\.json"):
        embedder_from_spec(f"local:{tmp_path}")


def _write_bert_folder(folder: Path, *, pooling: str, model_type: str = "bert") -> None:
    """A small random BERT saved by transformers, with MiniLM's tokenizer."""
    import shutil

    from transformers import BertConfig, BertModel

    from keel._assets import minilm_dir

    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    BertModel(config).eval().save_pretrained(folder)
    if model_type != "bert":
        raw = json.loads((folder / "config.json").read_text())
        raw["model_type"] = model_type
        (folder / "config.json").write_text(json.dumps(raw))
    shutil.copy(minilm_dir() / "tokenizer.json", folder / "tokenizer.json")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True})
    )


@pytest.mark.slow
def test_onnx_graph_matches_transformers_on_another_bert_shape(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, BertModel

    _write_bert_folder(tmp_path, pooling="cls_token")
    embedder = OnnxEmbedder(tmp_path)
    assert embedder.dimension == 64 and embedder.config.pooling == "cls"
    texts = ["a short one", "a rather longer sentence with quite a few more words in it", "x"]
    reference_model = BertModel.from_pretrained(tmp_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        cls = reference_model(**batch).last_hidden_state[:, 0].numpy()
    cls /= np.linalg.norm(cls, axis=1, keepdims=True)
    assert np.allclose(embedder.embed(texts), cls, atol=1e-5)


def test_unsupported_models_are_named_config_errors(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    roberta = tmp_path / "roberta"
    _write_bert_folder(roberta, pooling="mean_tokens", model_type="roberta")
    with pytest.raises(ConfigError, match="not BERT"):
        OnnxEmbedder(roberta)
    max_pooled = tmp_path / "max"
    _write_bert_folder(max_pooled, pooling="max_tokens")
    with pytest.raises(ConfigError, match="pooling"):
        OnnxEmbedder(max_pooled)


@pytest.mark.slow
def test_onnx_minilm_gives_the_sentence_transformers_vectors(minilm: OnnxEmbedder) -> None:
    reference = SentenceTransformerEmbedder()
    texts = [
        "My flight to Lisbon leaves on the 3rd of March",
        "",
        "émigré café naïve — 東京 🚀",
        "word " * 400,  # longer than the 256-token limit: truncated the same way
        "Do I have any pets?",
        *[f"note {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(40)],
    ]
    ours = minilm.embed(texts)
    theirs = reference.embed(texts)
    assert ours.shape == theirs.shape == (len(texts), 384)
    cosine = (ours * theirs).sum(axis=1)
    assert float(cosine.min()) > 0.99999
    # Batching and length sorting never reorder the output rows.
    assert np.allclose(minilm.embed(texts[2:3])[0], ours[2], atol=1e-5)


@pytest.mark.parametrize(
    "spec", ["hashing:0", "hashing:99999999999", "local:minilm-static/0", "openai:small/0"]
)
def test_an_embedder_dimension_out_of_range_stops_the_agent_opening(
    spec: str, tmp_path: Path
) -> None:
    # hashing:0 opened, and every turn then failed on a division by zero in the embedder.
    settings = load_settings(data_dir=tmp_path, embedder=spec, pii_vault=False)
    with pytest.raises(ConfigError, match=r"dimension must be 1 to 16000"):
        Agent.open(settings, model=ScriptedModel(["ok"]), system_prompt="You help.")
