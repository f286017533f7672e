"""Weak-retrieval gate: AUC, Youden, redundancy pruning, orientation, missing signals, the
signals on planted corpora, and the gate-aware controller."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import PRIORS, ScriptedLLM, last_block

import brag
import calibrate
from brag import BRAG, Corpus, Gate, GateSignal
from bragkit import calibrate_cli


def test_auc_matches_hand_computed_cases():
    # Positives 0.35 and 0.8 against negatives 0.1 and 0.4: 3 of 4 pairs ordered right.
    assert calibrate.auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    # Ties count half: (1 v 1) 0.5 + (1 v 2) 0 + (2 v 1) 1 + (2 v 2) 0.5 = 2 of 4.
    assert calibrate.auc([1, 1, 2, 2], [False, True, False, True]) == pytest.approx(0.5)
    assert calibrate.auc([3, 2, 1], [True, False, False]) == 1.0
    with pytest.raises(ValueError, match="both"):
        calibrate.auc([1, 2], [True, True])


def test_youden_and_target_recall_on_known_data():
    oriented = [0, 1, 2, 3, 4, 5]
    weak = [True, True, True, False, False, False]
    assert calibrate.youden(oriented, weak) == (2.0, 1.0, 0.0)
    noisy = [0, 1, 3, 2, 4, 5]
    threshold, tpr, fpr = calibrate.youden(noisy, weak)
    assert (threshold, tpr, fpr) in [(1.0, 2 / 3, 0.0), (3.0, 1.0, 1 / 3)]
    assert calibrate.threshold_for_recall(noisy, weak, 1.0) == (3.0, 1.0, 1 / 3)


def constructed_rows(n: int = 400, seed: int = 0):
    """a separates (weak -> low), b copies a, c separates the other way, d is noise, e is absent
    half the time."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        weak = rng.random() < 0.4
        a = rng.gauss(0 if weak else 1.5, 1)
        c = rng.gauss(1.2 if weak else 0, 1)
        signals = {"a": a, "b": 2 * a + rng.gauss(0, 0.01), "c": c, "d": rng.gauss(0, 1)}
        if rng.random() < 0.5:
            signals["e"] = rng.gauss(0, 1)
        rows.append((signals, weak))
    return rows


def test_fit_gate_prunes_redundancy_orients_and_combines():
    gate = calibrate.fit_gate(constructed_rows())
    kept = {s["name"]: s for s in gate["signals"]}
    assert set(kept) == {"a", "c"}  # b duplicates a; d and e do not separate
    assert "corr" in gate["dropped"]["b"] and "separation" in gate["dropped"]["d"]
    assert kept["a"]["orientation"] == 1.0 and kept["c"]["orientation"] == -1.0
    assert gate["auc"]["a"] < 0.3 and gate["auc"]["c"] > 0.7
    assert 0 < gate["fpr"] < gate["tpr"] <= 1
    assert gate["logistic"]["features"] == ["a", "c"]
    assert gate["logistic"]["auc_calibration"] > max(1 - gate["auc"]["a"], gate["auc"]["c"])
    calibration = brag.load_calibration({**brag.load_calibration().to_dict(), "gate": gate})
    assert [s.name for s in calibration.gate.signals] == ["a", "c"]


def test_missing_signals_are_skipped_not_zero():
    gate = Gate(
        (GateSignal("dense_max_score", 1.0, 0.5, 0.3), GateSignal("evidence_coverage", 1.0, 0.6, 0.3))
    )
    assert gate.fires({}) is None
    assert gate.fires({"evidence_coverage": 0.9}) is False
    assert gate.fires({"evidence_coverage": 0.5}) is True
    assert gate.fires({"evidence_coverage": 0.9, "dense_max_score": 0.4}) is True


PASSAGES = [
    {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
    {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect born in Bergen in 1961."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway."},
    {"title": "Fjord", "text": "A fjord is a long narrow inlet."},
    *[{"title": f"Filler {i}", "text": f"Filler passage {i} about weather and tides."} for i in range(20)],
]
HARD = "Is the Glass Tower older than the architect born in Bergen in 1961?"  # needs two passages
EASY = "Who designed the Glass Tower in Oslo?"
COVERAGE_GATE = Gate((GateSignal("evidence_coverage", 1.0, 0.75, 0.3),), k=1)


def test_signals_and_the_gate_on_a_planted_deep_passage():
    corpus = Corpus(PASSAGES)
    hard_window = [i for i, _ in corpus.search(HARD, 1)]
    easy_window = [i for i, _ in corpus.search(EASY, 1)]
    hard = brag.window_signals(HARD, corpus, hard_window, 1)
    easy = brag.window_signals(EASY, corpus, easy_window, 1)
    assert easy["evidence_coverage"] == 1.0 and hard["evidence_coverage"] < 0.75
    assert COVERAGE_GATE.fires(hard) is True and COVERAGE_GATE.fires(easy) is False
    expected = {
        "max_score",
        "top_gap",
        "score_variance",
        "salient_terms",
        "evidence_coverage",
        "top1_coverage",
    }
    assert set(hard) == expected  # no embedder: no dense signal
    assert brag.window_signals("the of and", corpus, hard_window, 1)["salient_terms"] == 0.0
    assert "evidence_coverage" not in brag.window_signals("the of and", corpus, hard_window, 1)
    dense = Corpus(PASSAGES, embedder=brag.HashingEmbedder())
    with_dense = brag.window_signals(HARD, dense, hard_window, 1)
    assert {"dense_max_score", "dense_score_variance", "retriever_divergence"} <= set(with_dense)
    assert 0.0 <= with_dense["retriever_divergence"] <= 1.0


class Delegating:
    """A retriever of its own class that serves a Corpus's passages through the protocol alone."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus

    def retrieve(self, query, k=5):
        found = self.corpus.retrieve(query, k)
        return brag.Retrieval(found.hits, found.removed, found.considered)  # top hits only

    def __getitem__(self, passage_id):
        return self.corpus[passage_id]

    def __len__(self):
        return len(self.corpus)

    def document_share(self, token):
        return self.corpus.document_share(token)

    def novel(self, candidates, read):
        return self.corpus.novel(candidates, read)

    def stats(self):
        return {}

    def fingerprint(self):
        return "delegating"


class DelegatingScorer(Delegating):
    """The same, and the optional scoring protocol too."""

    def scores(self, query):
        return self.corpus.scores(query)

    def dense_scores(self, query):
        return self.corpus.dense_scores(query)


def test_a_retriever_that_scores_every_passage_gives_the_gate_what_a_corpus_gives():
    corpus = Corpus(PASSAGES, embedder=brag.HashingEmbedder())
    window = [i for i, _ in corpus.search(HARD, 2)]
    own = brag.window_signals(HARD, corpus, window, 2)
    scorer, plain = DelegatingScorer(corpus), Delegating(corpus)
    assert isinstance(scorer, brag.ScoringRetriever) and not isinstance(plain, brag.ScoringRetriever)
    assert brag.window_signals(HARD, scorer, window, 2) == own  # full scores and the dense signals
    top_only = brag.window_signals(HARD, plain, window, 2, plain.retrieve(HARD, 2))
    assert "retriever_divergence" in own and "retriever_divergence" not in top_only
    # Without every passage's score, height and spread come from the top hits alone.
    assert top_only["max_score"] == pytest.approx(max(s for _, s in plain.retrieve(HARD, 2).hits))


def gated_calibration() -> dict:
    cal = brag.load_calibration(PRIORS).to_dict()
    cal["actions"]["R1"] = {
        "q": 0.9,
        "rho": {"a": 9.0, "b": 1.0},
        "weak": {"q": 0.6, "rho": {"a": 3.0, "b": 7.0}},
    }
    cal["gate"] = {"k": 1, "signals": [{"name": "evidence_coverage", "orientation": 1, "threshold": 0.75}]}
    return cal


def reader(prompt: str) -> str:
    block = last_block(prompt)
    if "Lina Berg is" in block:
        return "Answer: no\nFollow-up query: Lina Berg"
    return "Answer: yes\nFollow-up query: Lina Berg birth year"


@pytest.mark.parametrize(("question", "weak"), [(EASY, False), (HARD, True)])
def test_a_weak_window_lowers_r1_and_escalates(question, weak):
    llm = ScriptedLLM(read=reader, closed_book=lambda p, n: ["no"] * n)
    _, report = BRAG(llm, calibration=gated_calibration(), k=1, lam=0.2, cost="calls").run(
        question, Corpus(PASSAGES)
    )
    first = report["steps"][0]
    assert report["gate"]["R1"]["weak"] is weak and "evidence_coverage" in report["gate"]["R1"]["signals"]
    rates = brag.load_calibration(gated_calibration()).rates()
    assert first["rates"]["R1"] == pytest.approx(rates["R1_weak" if weak else "R1"])
    actions = [s["action"] for s in report["steps"] if s["action"]]
    if weak:
        assert rates["R1_weak"] < rates["R1"]
        assert actions != ["R1"] and ("CB" in actions or "R2" in actions)  # escalates
    else:
        assert actions == ["R1"]  # a strong window: one read is enough
    assert json.loads(json.dumps(report)) == report


def test_gate_cli_needs_no_llm(shared_data, tmp_path):
    out = tmp_path / "gate.json"
    code = calibrate_cli.main(
        [
            "gate",
            "--questions",
            str(shared_data / "musique/musique_migres200.json"),
            "--corpus",
            str(shared_data / "musique/musique_migres200_corpus.json"),
            "--split",
            "0:60",
            "--out",
            str(out),
        ]
    )
    gate = json.loads(out.read_text())
    assert code == 0 and gate["n"] == 60 and 0 < gate["weak_rate"] < 1
    assert set(gate["auc"]) >= {"max_score", "top_gap", "score_variance", "evidence_coverage"}
    assert all(np.isfinite(v) for v in gate["auc"].values())


def test_a_long_question_looks_up_at_most_max_term_lookups_shares():
    # Each document_share can be a query to the retriever (Milvus counts it).
    corpus = Corpus([f"Passage {i} about the river number {i} and its town." for i in range(200)])
    asked: list[str] = []

    class Counting:
        def __len__(self) -> int:
            return len(corpus)

        def document_share(self, token: str) -> float:
            asked.append(token)
            return corpus.document_share(token)

    question = " ".join(f"word{i}" for i in range(500))
    brag._salient_terms(question, Counting())
    assert len(asked) == brag.MAX_TERM_LOOKUPS == len(set(asked))
    asked.clear()
    brag._salient_terms("Which town lies on river number 7?", Counting())
    assert sorted(asked) == sorted(set(brag.tokenize("Which town lies on river number 7?")))


def test_absent_share_counts_the_question_terms_no_passage_holds_not_its_grammar():
    english = brag.Corpus(["The Glass Tower in Oslo was designed by Lina Berg.", "Oslo is in Norway."])
    assert brag.absent_share("Who designed the Glass Tower?", english) == 0.0
    assert brag.absent_share(
        "Which Kubernetes operator was designed by Lina Berg?", english
    ) == pytest.approx(2 / 5)
    japanese = brag.Corpus(
        ["設定ファイルは /etc/foo.conf に保存されます。", "ネットワークの設定も同じです。"]
    )
    # どこ, すか (kana-only) and ルは (across scripts) are the question's grammar, not its subject.
    assert brag.absent_share("設定ファイルはどこに保存されますか？", japanese) == 0.0
    assert brag.absent_share("Kubernetesクラスタの設定方法は？", japanese) > 0.5
    chinese = brag.Corpus(["配置文件保存在 /etc/bar.conf 中。", "系统启动时读取这个文件。"])
    assert brag.absent_share("配置文件保存在哪里？", chinese) == 0.0  # 哪里 asks; it is not absent content
    assert brag.absent_share("who and which?", english) == 0.0  # only grammar: nothing to be absent


def test_an_inflected_word_of_the_question_is_held_and_a_name_the_documents_lack_is_not():
    italian = brag.Corpus(
        [
            "Per configurare la rete si modifica il file /etc/network/interfaces e si riavvia il servizio.",
            "Il comando ifup attiva l'interfaccia; il comando ifdown la disattiva quando serve.",
        ]
    )
    assert brag.absent_share("Come si configurano le interfacce di rete?", italian) == 0.0
    assert brag.absent_share("Come si configura una rete wireguard?", italian) > 0.0
    # A short word or a name is held only as it is written ("ifupx" is not "ifup").
    assert brag.absent_share("Il comando ifupx?", italian) == pytest.approx(0.5)
    exact = Delegating(italian)  # the protocol alone: whole tokens, no look-up of a word's start
    exact.analyzer = italian.analyzer
    assert brag.absent_share("Come si configurano le interfacce di rete?", exact) > 0.0
    spanish = brag.Corpus(["Para actualizar los paquetes se ejecuta apt upgrade después de apt update."])
    assert brag.absent_share("¿Cómo se actualizan los paquetes?", spanish) == 0.0
    assert brag.absent_share("¿Cómo se actualizan los paquetes con synaptic?", spanish) > 0.0
