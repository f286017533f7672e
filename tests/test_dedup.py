"""Deduplication (SPEC section 2): the examples, every invariant, hybrid RRF, real embedders."""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brag import (
    Corpus,
    DedupConfig,
    HashingEmbedder,
    Passage,
    dedup_ingestion,
    dedup_ranked,
    reciprocal_rank_fusion,
)


class StubEmbedder:
    """Fixed vectors per text, so every similarity is the one a test states."""

    name = "stub"

    def __init__(self, table: dict[str, list[float]], dim: int = 4) -> None:
        self.table, self.dim = table, dim

    def embed(self, texts):
        rows = []
        for text in texts:
            key = next((k for k in self.table if k in text), None)
            vector = np.array(self.table[key] if key else np.eye(self.dim)[-1], dtype=np.float32)
            rows.append(vector / np.linalg.norm(vector))
        return np.stack(rows)


def unit(*xs: float) -> list[float]:
    return list(xs)


A = "Machine learning models require training data"
B = "ML systems need data for training"
C = "Training data is essential for ML"
# cos(A, B) = 0.92, cos(A, C) = 0.91, cos(B, C) ~ 0.84: each below A only through A.
SPEC_VECTORS = {
    A: unit(1.0, 0.0, 0.0, 0.0),
    B: unit(0.92, math.sqrt(1 - 0.92**2), 0.0, 0.0),
    C: unit(0.91, -0.2, math.sqrt(1 - 0.91**2 - 0.04), 0.0),
}


def ingest(texts, config=None, salience=None, doc="doc1"):
    config = config or DedupConfig()
    passages = [Passage("", t, doc, (salience or [1.0] * len(texts))[i]) for i, t in enumerate(texts)]
    vectors = StubEmbedder(SPEC_VECTORS).embed(texts)
    return dedup_ingestion(passages, vectors, config)


def test_spec_near_duplicates_keep_a_with_a_linear_boost_of_030():
    result = ingest([A, B, C], DedupConfig(boost_mode="linear"), salience=[0.5, 0.5, 0.5])
    assert result.kept == [0]
    assert result.near_duplicates == {1: 0, 2: 0} and not result.exact_duplicates
    assert result.boosts[0] == pytest.approx(0.30)
    assert result.salience[0] == pytest.approx(0.80)


def test_spec_logarithmic_boost_and_the_cap():
    result = ingest([A, B, C], DedupConfig(), salience=[0.5, 0.5, 0.5])
    assert result.boosts[0] == pytest.approx(0.15 * math.log2(3))
    assert DedupConfig().boost(1) == pytest.approx(0.15)
    assert DedupConfig(log_base=4).boost(3) == pytest.approx(0.15)
    capped = ingest([A, B, C], DedupConfig(boost_mode="linear"), salience=[0.9, 0.9, 0.9])
    assert capped.boosts[0] == pytest.approx(0.30) and capped.salience[0] == 1.0


def test_spec_exact_copies_keep_one_with_no_boost():
    text = "Contact us at support@example.com"
    result = dedup_ingestion([Passage("", text, "d"), Passage("", text, "d")], None)
    assert result.kept == [0] and result.exact_duplicates == {1: 0} and result.boosts == {}


def test_salience_filter_and_sort_by_salience():
    # Sorted by salience: C first (kept), then B (cos 0.76 with C: kept), then A, which matches
    # both (0.91 with C, 0.92 with B) and folds into the more similar one, B.
    result = ingest([A, B, C, "noise"], salience=[0.5, 0.6, 0.9, 0.01])
    assert result.below_salience == [3]
    assert result.kept == [1, 2] and result.near_duplicates == {0: 1}
    assert result.boosts == {1: pytest.approx(0.15)}


def test_no_dedup_across_documents_at_ingestion():
    passages = [Passage("", A, "doc1"), Passage("", B, "doc2"), Passage("", A, "doc2")]
    vectors = StubEmbedder(SPEC_VECTORS).embed([p.text for p in passages])
    result = dedup_ingestion(passages, vectors)
    assert result.kept == [0, 1] and result.near_duplicates == {2: 1}


def test_config_loads_from_the_deduplication_json_section():
    seed = {
        "DocSummarizer": {
            "Deduplication": {
                "Ingestion": {
                    "Enabled": True,
                    "SimilarityThreshold": 0.88,
                    "SalienceThreshold": 0.05,
                    "EnableSalienceBoost": True,
                    "BoostPerNearDuplicate": 0.2,
                    "MaxSalienceBoost": 1.0,
                    "BoostDecayMode": "Linear",
                    "LogBase": 2.0,
                },
                "Retrieval": {"Enabled": False, "SimilarityThreshold": 0.95, "MinRelevanceScore": 0.25},
            }
        }
    }
    config = DedupConfig.from_json(seed)
    assert config.similarity_threshold == 0.88 and config.boost_mode == "linear"
    assert config.boost_per_near_duplicate == 0.2 and not config.retrieval_enabled
    assert config.retrieval_similarity_threshold == 0.95 and config.min_relevance_score == 0.25
    assert DedupConfig.from_json('{"Ingestion": {}}') == DedupConfig()
    with pytest.raises(ValueError, match="boost_mode"):
        DedupConfig.from_json('{"Ingestion": {"BoostDecayMode": "Cubic"}}')
    with pytest.raises(ValueError, match="malformed JSON"):
        DedupConfig.from_json("{")


# ---------------------------------------------------------------------------------- invariants

BASES = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)


@st.composite
def documents(draw):
    n = draw(st.integers(1, 40))
    docs = draw(st.lists(st.sampled_from(["d1", "d2", "d3"]), min_size=n, max_size=n))
    base = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    noise = draw(st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n))
    salience = draw(st.lists(st.sampled_from([0.0, 0.3, 0.7, 1.0]), min_size=n, max_size=n))
    copies = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    rng = np.random.default_rng(n)
    vectors = BASES[base] + np.array(noise, dtype=np.float32)[:, None] * rng.normal(size=(n, 8)).astype(
        np.float32
    )
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    texts = [
        f"text {b}" if copy_ else f"text {b} {i}"
        for i, (b, copy_) in enumerate(zip(base, copies, strict=True))
    ]
    for i in range(n):  # identical texts must carry identical embeddings
        first = texts.index(texts[i])
        vectors[i] = vectors[first]
    passages = [Passage("", t, d, s) for t, d, s in zip(texts, docs, salience, strict=True)]
    return passages, vectors


@settings(max_examples=150, deadline=None)
@given(documents(), st.sampled_from([1, 3, 1024]))
def test_ingestion_invariants(case, block_size):
    passages, vectors = case
    before_p, before_v = copy.deepcopy(passages), vectors.copy()
    config = DedupConfig(block_size=block_size)
    result = dedup_ingestion(passages, vectors, config)
    # Inputs unmodified; deterministic; blocking does not change the answer.
    assert passages == before_p and np.array_equal(vectors, before_v)
    assert dedup_ingestion(passages, vectors, config) == result
    assert dedup_ingestion(passages, vectors, DedupConfig(block_size=4096)) == result
    # Order preserved: kept ids in input order.
    assert result.kept == sorted(result.kept)
    removed = {**result.exact_duplicates, **result.near_duplicates}
    # Every input is accounted for exactly once.
    assert sorted(result.kept + result.below_salience + list(removed)) == list(range(len(passages)))
    for gone, kept in removed.items():
        assert kept in result.kept  # a representative always stays ...
        assert passages[gone].doc_id == passages[kept].doc_id  # ... in the same document
    for doc in {p.doc_id for p in passages if p.salience >= config.salience_threshold}:
        assert any(passages[i].doc_id == doc for i in result.kept)
    for i in result.kept:
        assert passages[i].salience <= result.salience[i] <= max(config.max_salience, passages[i].salience)


@settings(max_examples=150, deadline=None)
@given(documents(), st.integers(1, 10))
def test_post_ranking_invariants(case, k):
    passages, vectors = case
    ranked = [(i, 1.0 / (1 + i)) for i in range(len(passages))]
    table = {i: vectors[i] for i in range(len(passages))}
    before = vectors.copy()
    kept, removed = dedup_ranked(ranked, table, DedupConfig(), k)
    assert np.array_equal(vectors, before)
    assert [i for i, _ in kept] == sorted(i for i, _ in kept)  # rank order never changes
    assert len(kept) == min(k, len(passages) - len(removed)) or len(kept) == k
    assert kept and kept[0] == ranked[0]  # the best result always stays
    for gone in removed:
        assert max(float(vectors[gone] @ vectors[i]) for i, _ in kept if i < gone) >= 0.90
    for a, _ in kept:
        for b, _ in kept:
            assert a == b or float(vectors[a] @ vectors[b]) < 0.90
    assert dedup_ranked(ranked, table, DedupConfig(), k) == (kept, removed)


def test_min_relevance_is_relative_to_the_top_score_and_k_cuts():
    ranked = [(0, 1.0), (1, 0.5), (2, 0.2), (3, 0.1)]
    kept, _ = dedup_ranked(ranked, None, DedupConfig(min_relevance_score=0.25), None)
    assert [i for i, _ in kept] == [0, 1]
    kept, _ = dedup_ranked(ranked, None, DedupConfig(), 3)
    assert [i for i, _ in kept] == [0, 1, 2]


# ---------------------------------------------------------------------------------- hybrid RRF


def test_rrf_scores_and_ties():
    fused = reciprocal_rank_fusion([[3, 1, 2], [1, 3]], k=60)
    assert fused[1] == pytest.approx(1 / 62 + 1 / 61) and fused[2] == pytest.approx(1 / 63)
    assert fused[1] == fused[3]


def test_a_dense_only_relevant_passage_enters_the_top_k():
    passages = [
        {"title": "Vehicle tax", "text": "Vehicle owners pay a yearly road tax."},
        {"title": "Boats", "text": "A boat floats on water."},
        {"title": "Paint", "text": "The lanes are painted white."},
        {"title": "Cars", "text": "An automobile has four wheels and an engine."},  # no query word
    ]
    embedder = StubEmbedder(
        {
            "automobile": unit(1, 0, 0, 0),
            "tax": unit(0, 1, 0, 0),
            "boat": unit(0, 0, 1, 0),
            "lanes": unit(0, 0, 0.7, 0.7),
            "vehicle motor": unit(1, 0.1, 0, 0),
        }
    )
    query = "vehicle motor"
    assert [i for i, _ in Corpus(passages).search(query, 2)] == [0, 1]  # BM25: the match, then filler
    hits = Corpus(passages, embedder=embedder).search(query, 2)
    assert [i for i, _ in hits] == [0, 3]  # RRF: the dense-only passage is second
    assert all(0 < s <= 1 for _, s in hits)


def test_rrf_ties_break_by_input_order():
    passages = [f"identical words here {i}" for i in range(6)]
    embedder = StubEmbedder({"identical": unit(1, 0, 0, 0)})
    corpus = Corpus(passages, embedder=embedder, dedup=DedupConfig(retrieval_enabled=False))
    ids = [i for i, _ in corpus.search("identical words", 4)]
    assert ids == sorted(ids)


def test_corpus_dedups_at_ingestion_and_after_ranking(caplog):
    passages = [
        {"title": "Lebensraum", "text": "Lebensraum was a concept coined by Friedrich Ratzel in 1901."},
        {"title": "Lebensraum", "text": "Lebensraum was a concept coined by Friedrich Ratzel in 1901!"},
        {"title": "Lebensraum", "text": "Lebensraum was a concept coined by Friedrich Ratzel in 1901."},
        {
            "title": "Lebensraum",
            "doc_id": "atlas",
            "text": "Lebensraum was a concept coined by Friedrich Ratzel in 1901.",
        },
        {"title": "Ratzel", "text": "Friedrich Ratzel was a German geographer."},
        {"title": "Other", "text": "Oslo is the capital of Norway."},
    ]
    with caplog.at_level(logging.INFO, logger="brag"):
        corpus = Corpus(passages, embedder=HashingEmbedder())
        found = corpus.retrieve("Who coined Lebensraum?", 3)
    assert corpus.ingestion.exact_duplicates == {2: 0}
    assert corpus.ingestion.near_duplicates == {1: 0}
    assert corpus.ids.tolist() == [0, 3, 4, 5]
    assert "Deduplication: 6 → 4 segments" in caplog.text
    stats = corpus.stats()
    assert stats["dedup_ratio_ingestion"] == pytest.approx(2 / 6) and stats["max_salience_boost"] == 0.15
    assert 3 in found.removed and found.hits[0][0] == 0  # the cross-document copy goes
    assert 3 not in [i for i, _ in found.hits]
    assert "Post-ranking deduplication" in caplog.text
    assert corpus.embeddings.flags.writeable is False


def test_hybrid_corpus_save_and_load(tmp_path):
    passages = [{"title": f"T{i % 3}", "text": f"passage {i} about topic {i % 4}"} for i in range(30)]
    corpus = Corpus(passages, embedder=HashingEmbedder())
    corpus.save(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c", embedder=HashingEmbedder())
    assert loaded.search("topic 2 passage 6", 5) == corpus.search("topic 2 passage 6", 5)
    assert loaded.ingestion == corpus.ingestion
    with pytest.raises(ValueError, match="embedder"):
        Corpus.load(tmp_path / "c")


def test_hashing_embedder_is_deterministic_and_unit_length():
    texts = ["Machine learning needs data", "machine learning needs data!", "Oslo is in Norway", ""]
    e = HashingEmbedder().embed(texts)
    assert e.shape == (4, 2048) and e.dtype == np.float32
    assert np.allclose(np.linalg.norm(e[:3], axis=1), 1.0) and not e[3].any()
    assert np.array_equal(e, HashingEmbedder().embed(texts))
    assert float(e[0] @ e[1]) >= 0.90 > float(e[0] @ e[2])


# ---------------------------------------------------------------------------------- real embedders

PARAPHRASES = [
    ("The Eiffel Tower is located in Paris, France.", "The Eiffel Tower is located in Paris in France."),
    (
        "Marie Curie won the Nobel Prize in Physics in 1903.",
        "In 1903 Marie Curie won the Nobel Prize in Physics.",
    ),
    ("The company was founded in 1998 by two students.", "The company was founded by two students in 1998."),
]
UNRELATED = [
    ("The Eiffel Tower is located in Paris, France.", "Photosynthesis turns sunlight into sugar."),
    ("Marie Curie won the Nobel Prize in Physics in 1903.", "The river flows into the Baltic Sea."),
    ("The company was founded in 1998 by two students.", "Bananas are rich in potassium."),
]


def embedders():
    from bragkit import embedders as module

    out = [pytest.param(HashingEmbedder, id="hashing")]
    for name in ("model2vec", "minilm"):
        available = module.available(name)
        out.append(
            pytest.param(
                lambda n=name: module.make_embedder(n),
                id=name,
                marks=pytest.mark.skipif(not available, reason=f"{name} embedder not installed"),
            )
        )
    return out


@pytest.mark.parametrize("factory", embedders())
def test_real_embedders_separate_paraphrases_from_unrelated_text(factory):
    embedder = factory()
    for pairs, above in ((PARAPHRASES, True), (UNRELATED, False)):
        for left, right in pairs:
            a, b = embedder.embed([left, right])
            similarity = float(a @ b)
            assert (similarity >= 0.90) == above, (embedder.name, left, right, similarity)
