"""Corpus: parsing, BM25 scores against rank_bm25, top-k order, save/load, bad input."""

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from brag import BM25_VARIANTS, Corpus, Passage, tokenize


def reference_scores(texts, query):
    ref = BM25Okapi([tokenize(t) for t in texts], epsilon=0)
    return ref.get_scores(tokenize(query))


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
    np.testing.assert_allclose(kept_scores(corpus, q), reference_scores(texts, q), rtol=1e-5, atol=1e-6)


def test_scores_and_top_k_equal_rank_bm25_on_a_real_corpus(shared_data):
    rows = json.loads((shared_data / "2wikimultihopqa" / "2wikimultihopqa_corpus.json").read_text())
    questions = json.loads((shared_data / "2wikimultihopqa" / "2wikimultihopqa.json").read_text())
    texts = [f"{r['title']}\n{r['text']}" for r in rows]
    corpus = Corpus(rows)
    ref = BM25Okapi([tokenize(t) for t in texts], epsilon=0)
    for item in random.Random(7).sample(questions, 25):
        q = item["question"]
        expected = ref.get_scores(tokenize(q))
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
    assert plain.dropped == 1 and plain.ids == [0, 2, 3]
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


def test_save_and_load_round_trip(tmp_path):
    rows = [{"title": f"T{i}", "text": f"passage number {i} about topic {i % 3}"} for i in range(50)]
    rows[5]["text"] = rows[5]["title"] = ""
    corpus = Corpus(rows)
    corpus.save(tmp_path / "idx")
    loaded = Corpus.load(tmp_path / "idx")
    assert loaded.ids == corpus.ids and loaded.dropped == 1
    for q in ["topic 1", "passage number 7", "nothing here"]:
        assert loaded.search(q, 5) == corpus.search(q, 5)
    assert loaded[7] == corpus[7]
    with pytest.raises(ValueError, match="not a saved BRAG corpus"):
        Corpus.load(tmp_path / "missing")


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
