"""Corpus: parsing, BM25 scores against rank_bm25, top-k order, save/load, bad input."""

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

import brag
from brag import BM25_VARIANTS, Corpus, Passage, tokenize


def reference_scores(texts, query, analyzer):
    """rank_bm25 over the tokens a corpus's analyzer gives its passages and queries."""
    ref = BM25Okapi([tokenize(t, analyzer) for t in texts], epsilon=0)
    return ref.get_scores(tokenize(query, analyzer))


def kept_scores(corpus, query):
    """Scores in input order, for every kept passage."""
    return corpus.scores(query)


WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "Ñandú",
    "straße",
    "東京",
    "x1",
    "2024",
]


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=25), min_size=2, max_size=40),
    query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=6),
)
def test_scores_equal_rank_bm25_okapi_on_random_corpora(docs, query):
    texts = [" ".join(d) for d in docs]
    q = " ".join(query)
    corpus = Corpus(texts)
    np.testing.assert_allclose(
        kept_scores(corpus, q), reference_scores(texts, q, corpus.analyzer), rtol=1e-5, atol=1e-6
    )


def test_scores_and_top_k_equal_rank_bm25_on_a_real_corpus(shared_data):
    rows = json.loads((shared_data / "2wikimultihopqa" / "2wikimultihopqa_corpus.json").read_text())
    questions = json.loads((shared_data / "2wikimultihopqa" / "2wikimultihopqa.json").read_text())
    texts = [f"{r['title']}\n{r['text']}" for r in rows]
    corpus = Corpus(rows)
    assert corpus.analyzer == brag.Analyzer("en", by_script=False)  # English, Latin script
    ref = BM25Okapi([tokenize(t, corpus.analyzer) for t in texts], epsilon=0)
    for item in random.Random(7).sample(questions, 25):
        q = item["question"]
        expected = ref.get_scores(tokenize(q, corpus.analyzer))
        np.testing.assert_allclose(corpus.scores(q), expected, rtol=1e-5, atol=1e-5)
        hits = corpus.search(q, 10)
        ref_top = np.sort(expected)[::-1][:10]
        np.testing.assert_allclose([s for _, s in hits], ref_top, rtol=1e-5)
        # Each returned id has the reference score at its rank (ties may reorder equal scores).
        np.testing.assert_allclose([expected[i] for i, _ in hits], ref_top, rtol=1e-5)


def test_accepts_strings_dicts_and_json_and_keeps_input_ids():
    rows = [
        {"title": "A", "text": "apples grow on trees"},
        {"title": "", "text": "  "},
        {"title": "C", "text": "cherries are red fruit"},
        "dates are sweet",
    ]
    for source in (rows, json.dumps(rows)):
        corpus = Corpus(source)
        assert corpus.dropped == 1 and len(corpus) == 3
        assert [i for i, _ in corpus.search("cherries", 2)] == [2, 0]
        assert corpus[2] == Passage("C", "cherries are red fruit")
        assert corpus[2].render() == "C\ncherries are red fruit"
    plain = Corpus(["one fish", "", "two fish", "red bird"])
    assert plain.dropped == 1 and plain.ids.tolist() == [0, 2, 3]
    assert plain[3].render() == "red bird"


def test_search_orders_best_first_and_breaks_ties_by_input_order():
    corpus = Corpus(["cat dog", "dog", "cat", "cat", "bird fish", "fish", "eel", "owl"])
    hits = corpus.search("cat", 5)
    assert [i for i, _ in hits] == [2, 3, 0, 1, 4]
    assert [s > 0 for _, s in hits] == [True, True, True, False, False]
    assert hits[0][1] == hits[1][1] > hits[2][1]
    # No match at all: the window is still filled, in input order, with zero scores.
    assert corpus.search("zebra", 3) == [(0, 0.0), (1, 0.0), (2, 0.0)]
    assert corpus.search("the of and", 2) == [(0, 0.0), (1, 0.0)]
    assert len(corpus.search("cat", 100)) == 8


def test_tokenize_handles_unicode_and_punctuation():
    assert tokenize("Straße, CAFÉ—naïve! (2024) 東京") == ["strasse", "café", "naïve", "2024", "東京"]
    assert tokenize("The... of, and!") == []


def test_save_and_load_round_trip_memory_mapped(tmp_path):
    rows = [
        {"title": f"T{i}", "text": f"passage number {i} about topic {i % 3} · ünïcode"} for i in range(50)
    ]
    rows[5]["text"] = rows[5]["title"] = ""
    rows[9] = f"an untitled passage number 9 with {'many ' * 50}words"
    corpus = Corpus(rows)
    corpus.save(tmp_path / "idx", name="Mine")
    loaded = Corpus.load(tmp_path / "idx")
    assert loaded.name == "Mine"
    assert isinstance(loaded.ids, np.memmap) and isinstance(
        loaded._scoring, np.memmap
    )  # nothing read up front
    assert loaded.ids.tolist() == corpus.ids.tolist() and loaded.dropped == 1 and len(loaded) == 49
    for q in ["topic 1", "passage number 7", "nothing here", "ünïcode", "untitled"]:
        assert loaded.search(q, 5) == corpus.search(q, 5)
    assert all(loaded[i] == corpus[i] for i in corpus.ids.tolist())
    assert loaded.stats() == corpus.stats() and loaded.fingerprint() == corpus.fingerprint()
    assert loaded.ingestion == corpus.ingestion
    with pytest.raises(KeyError):
        loaded[5]  # the empty passage was dropped
    with pytest.raises(ValueError, match="not a saved BRAG corpus"):
        Corpus.load(tmp_path / "missing")
    (tmp_path / "idx" / "brag_corpus.json").unlink()  # as if the save had been interrupted
    with pytest.raises(ValueError, match="not a saved BRAG corpus"):
        Corpus.load(tmp_path / "idx")


def test_a_corpus_file_is_indexed_once_and_then_memory_mapped(tmp_path):
    source = tmp_path / "corpus.json"
    source.write_text(json.dumps([{"title": f"T{i}", "text": f"text {i} about rivers"} for i in range(30)]))
    first = brag.cached_corpus(source, "My Corpus", cache=tmp_path / "cache")
    (folder,) = (tmp_path / "cache" / "corpora").iterdir()
    assert folder.name.startswith("my-corpus-") and isinstance(first.ids, np.memmap)
    stamp = (folder / "brag_corpus.json").stat().st_mtime_ns
    again = brag.cached_corpus(source, "My Corpus", cache=tmp_path / "cache")
    assert (folder / "brag_corpus.json").stat().st_mtime_ns == stamp  # not indexed again
    assert again.search("rivers 7", 3) == first.search("rivers 7", 3)
    source.write_text(json.dumps(["a changed file about lakes", "and another"]))
    changed = brag.cached_corpus(source, "My Corpus", cache=tmp_path / "cache")
    assert len(changed) == 2 and len(list((tmp_path / "cache" / "corpora").iterdir())) == 2
    other = brag.cached_corpus(source, "My Corpus", cache=tmp_path / "cache", k1=1.2)
    assert other.k1 == 1.2 and len(list((tmp_path / "cache" / "corpora").iterdir())) == 3


@pytest.mark.parametrize("variant", sorted(BM25_VARIANTS))
@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.sampled_from(WORDS), min_size=0, max_size=12), min_size=1, max_size=25),
    query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=4),
)
def test_the_numpy_index_scores_exactly_like_bm25s_own(variant, docs, query):
    """brag.bm25_index (numpy, for large corpora) against bm25s.BM25.index (the reference)."""
    import bm25s

    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(w, len(vocab)) for doc in docs for w in doc]
    if not vocab:
        return
    ours = brag.bm25_index(
        np.array(ids, dtype=np.int32), np.array([len(d) for d in docs]), vocab, variant, 1.5, 0.75
    )
    method, idf_method = BM25_VARIANTS[variant]
    reference = bm25s.BM25(k1=1.5, b=0.75, method=method, idf_method=idf_method)
    reference.index(docs, show_progress=False)
    known = [w for w in query if w in vocab]
    expected = reference.get_scores(known) if known else np.zeros(len(docs))
    got = ours.get_scores_from_ids([vocab[w] for w in known]) if known else np.zeros(len(docs))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", sorted(BM25_VARIANTS))
def test_every_named_variant_ranks_the_matching_passage_first(variant):
    corpus = Corpus(["red apples and green pears", "blue sky", "green grass", "blue whale"], variant=variant)
    assert corpus.search("apples pears", 1)[0][0] == 0


@pytest.mark.parametrize(
    ("passages", "message"),
    [
        ([], "corpus is empty"),
        (["", "   "], "corpus is empty"),
        ('["a", ', "malformed JSON"),
        ('{"title": "x"}', "expected a list"),
        ([1, 2], "passages[0]"),
        ([{"title": "x", "text": 5}], "passages[0]"),
        (42, "expected a list"),
    ],
)
def test_bad_passages_are_clear_value_errors(passages, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        Corpus(passages)


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown BM25 variant"):
        Corpus(["a b"], variant="bm26")


class WordOverlap:
    """A retriever that is not a Corpus: scores passages by shared words, top hits only.

    It stands for an external search service behind the Retriever protocol.
    """

    def __init__(self, texts: list[str]) -> None:
        self.passages = [Passage("", t) for t in texts]

    def retrieve(self, query: str, k: int = 5) -> brag.Retrieval:
        words = set(brag.tokenize(query))
        scored = [(i, float(len(words & set(brag.tokenize(p.text))))) for i, p in enumerate(self.passages)]
        hits = sorted(scored, key=lambda h: (-h[1], h[0]))[:k]
        return brag.Retrieval(hits, [], len(hits))  # no score for every passage: bm25 stays None

    def __getitem__(self, passage_id: int) -> Passage:
        return self.passages[passage_id]

    def __len__(self) -> int:
        return len(self.passages)

    def document_share(self, token: str) -> float:
        return sum(token in brag.tokenize(p.text) for p in self.passages) / len(self.passages)

    def novel(self, candidates, read):
        return list(candidates)

    def stats(self):
        return {"passages": len(self.passages)}

    def fingerprint(self) -> str:
        return str(hash(tuple(p.text for p in self.passages)))


def test_another_retriever_slots_in_behind_the_protocol():
    from conftest import PRIORS, ScriptedLLM, last_block

    retriever = WordOverlap(
        ["The Glass Tower was designed by Lina Berg.", "Lina Berg was born in Bergen.", "Oslo is a city."]
    )
    assert isinstance(retriever, brag.Retriever) and isinstance(Corpus(["x y"]), brag.Retriever)

    def reader(prompt: str) -> str:
        if "born in Bergen" in last_block(prompt):
            return "Answer: Bergen\nFollow-up query: Lina Berg"
        return "Answer: NONE\nFollow-up query: Lina Berg born"

    gate = {"k": 1, "signals": [{"name": "max_score", "orientation": 1, "threshold": 0.5, "auc": 0.7}]}
    calibration = {**brag.load_calibration(PRIORS).to_dict(), "gate": gate}
    controller = brag.BRAG(ScriptedLLM(read=reader), calibration=calibration, k=1, hops=2, lam=0.0)
    answer, report = controller.run("Where was the designer of the Glass Tower born?", retriever)
    assert answer == "Bergen"
    signals = report["gate"]["R1"]["signals"]  # from the top hits' scores and the passages' words
    assert signals["max_score"] == 2.0 and "evidence_coverage" in signals
    with pytest.raises(ValueError, match="Corpus or another Retriever"):
        controller.run("Where?", ["not", "a", "retriever"])


class WithoutFingerprint(WordOverlap):
    fingerprint = None  # a search service that cannot say what it holds


def test_calibration_refuses_a_retriever_without_a_fingerprint_and_names_it():
    from conftest import ScriptedLLM

    import calibrate

    llm, texts = ScriptedLLM(read=lambda p: "Answer: Bergen"), ["Lina Berg was born in Bergen."]
    with pytest.raises(ValueError, match=r"Retriever, got WithoutFingerprint \(it lacks fingerprint\)"):
        calibrate.progress_key(llm, WithoutFingerprint(texts), 5, 5, 2, 0, 0.8)
    keys = {calibrate.progress_key(llm, WordOverlap(t), 5, 5, 2, 0, 0.8) for t in (texts, texts, ["Oslo."])}
    assert len(keys) == 2  # the same passages, the same key


def test_a_cached_corpus_with_an_embedder_is_indexed_once_and_loaded_with_it(tmp_path):
    source = tmp_path / "docs.json"
    source.write_text(
        json.dumps([{"title": "A", "text": "alpha rivers"}, {"title": "B", "text": "beta lakes"}])
    )
    embedder = brag.HashingEmbedder(dim=64)
    first = brag.cached_corpus(source, cache=tmp_path / "cache", embedder=embedder)
    again = brag.cached_corpus(source, cache=tmp_path / "cache", embedder=embedder)
    assert first.embedder is embedder and again.embedder is embedder and again.embeddings is not None
    assert len(list((tmp_path / "cache" / "corpora").iterdir())) == 1  # the second call loaded it
    plain = brag.cached_corpus(source, cache=tmp_path / "cache")
    assert plain.embedder is None and len(list((tmp_path / "cache" / "corpora").iterdir())) == 2
