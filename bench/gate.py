"""Weak-retrieval gate: calibrate on one half of each dataset, report on the held-out half.

A window is the BM25 top-5 the LLM reads; it is weak when a needed passage (a supporting
paragraph, or a relevant SciFact abstract) is outside it. Signals: the BM25 family and evidence
coverage from ``brag.window_signals``, plus dense signals from the model2vec static model
(``dense_*``, ``retriever_divergence`` against BM25) and ``dense_agreement`` between model2vec
and the hashing embedder (when model2vec is installed; else hashing alone, without agreement).

    python bench/gate.py
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import calibrate
from brag import Corpus, HashingEmbedder, topk_overlap, window_signals
from bragkit import embedders
from bragkit.storage import data_dir

K = 5
SOURCE_NOTE = {
    "MuSiQue": "best cheap signal 0.73 (agreement at chance)",
    "SciFact": "spread / height 0.75–0.76",
}


def multihop(questions: str, corpus: str) -> Callable[[Path], tuple[list, list[dict]]]:
    def load(root: Path) -> tuple[list, list[dict]]:
        items = [i for i in calibrate.read_labelled(root / questions) if i.supporting]
        rows = json.loads((root / corpus).read_text())
        return [(i.question, set(i.supporting), "title") for i in items], rows

    return load


def scifact(root: Path) -> tuple[list, list[dict]]:
    docs = [
        json.loads(line) for line in (root / "scifact/corpus.jsonl").read_text().splitlines() if line.strip()
    ]
    queries = {}
    for line in (root / "scifact/queries.jsonl").read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            queries[q["_id"]] = q["text"]
    needed: dict[str, set[str]] = {}
    for line in (root / "scifact/qrels/test.tsv").read_text().splitlines()[1:]:
        qid, doc, _ = line.strip().split("\t")
        needed.setdefault(qid, set()).add(doc)
    rows = [{"title": d["title"], "text": d["text"], "doc_id": d["_id"]} for d in docs]
    return [(queries[q], docs_needed, "doc_id") for q, docs_needed in needed.items()], rows


DATASETS = {
    "HotpotQA": multihop("hotpotqa/hotpotqa_ircot500.json", "hotpotqa/hotpotqa_ircot500_corpus.json"),
    "2WikiMultihopQA": multihop(
        "2wikimultihopqa/2wikimultihopqa_migres164.json",
        "2wikimultihopqa/2wikimultihopqa_migres164_corpus.json",
    ),
    "MuSiQue": multihop("musique/musique_migres200.json", "musique/musique_migres200_corpus.json"),
    "SciFact": scifact,
}


def signal_rows(questions: list, rows: list[dict]) -> list[tuple[dict[str, float], bool]]:
    corpus = Corpus(rows)  # BM25 windows, as the app and the benchmark read them
    texts = [corpus[int(i)].render() for i in corpus.ids]
    dense_main = (
        embedders.make_embedder("model2vec") if embedders.available("model2vec") else HashingEmbedder()
    )
    dense_other = HashingEmbedder() if embedders.available("model2vec") else None
    main = dense_main.embed(texts)
    other = dense_other.embed(texts) if dense_other is not None else None
    out = []
    for question, needed, key in questions:
        window = [i for i, _ in corpus.search(question, K)]
        signals = window_signals(question, corpus, window, K)
        q_main = main @ dense_main.embed([question])[0]
        top = np.sort(q_main)[::-1][:K]
        signals["dense_max_score"] = float(top[0])
        signals["dense_score_variance"] = float(np.var(top))
        signals["retriever_divergence"] = 1.0 - topk_overlap(corpus.scores(question), q_main, K)
        if other is not None:
            signals["dense_agreement"] = topk_overlap(q_main, other @ dense_other.embed([question])[0], K)
        found = {getattr(corpus[i], key) for i in window}
        out.append((signals, not needed <= found))
    return out


def gate_rule(signals: list[dict]) -> str:
    """A fitted gate's rule in words, e.g. ``evidence_coverage ≤ 0.5 or max_score ≤ 3.1``."""
    return (
        " or ".join(
            f"{s['name']} {'≤' if s['orientation'] > 0 else '≥'} {s['orientation'] * s['threshold']:.3g}"
            for s in signals
        )
        or "(no signal reached separation 0.65)"
    )


def evaluate(name: str, rows: list[tuple[dict[str, float], bool]]) -> list[str]:
    order = np.random.default_rng(0).permutation(len(rows))  # files are ordered (by hop type, say)
    half = len(rows) // 2
    cal, test = [rows[i] for i in order[:half]], [rows[i] for i in order[half:]]
    gate = calibrate.fit_gate(cal, k=K)
    weak = np.array([w for _, w in test])
    names = sorted({n for s, _ in test for n in s})
    test_auc = {}
    for n in names:
        present = [(s[n], w) for s, w in test if n in s]  # a signal may be absent for a window
        test_auc[n] = calibrate.auc([v for v, _ in present], [w for _, w in present])
    kept = calibrate.brag.Gate(
        tuple(
            calibrate.brag.GateSignal(s["name"], s["orientation"], s["threshold"], s["auc"])
            for s in gate["signals"]
        ),
        K,
    )
    fires = np.array([bool(kept.fires(s)) for s, _ in test])

    def held_out_auc(model: dict) -> float:
        complete = [(s, w) for s, w in test if all(f in s for f in model["features"])]
        x = np.array([[s[f] for f in model["features"]] for s, _ in complete])
        return calibrate.auc(calibrate.logistic_scores(model, x), [w for _, w in complete])

    logistic, logistic_all = gate["logistic"], gate["logistic_all_signals"]
    logistic_auc, all_auc = held_out_auc(logistic), held_out_auc(logistic_all)
    best_single = max(names, key=lambda n: max(test_auc[n], 1 - test_auc[n]))
    best_cal = max(gate["auc"], key=lambda n: max(gate["auc"][n], 1 - gate["auc"][n]))
    sep = lambda v: max(v, 1 - v)  # noqa: E731
    lines = [
        f"## {name}",
        "",
        f"Windows: {len(rows)} (calibration {len(cal)}, held-out {len(test)}); weak rate held-out "
        f"{weak.mean():.2f} (calibration {gate['weak_rate']:.2f}).",
        "",
        "| signal | AUC calibration | AUC held-out | separation held-out | kept |",
        "|---|---|---|---|---|",
    ]
    kept_names = {s["name"]: s for s in gate["signals"]}
    for n in names:
        note = "yes" if n in kept_names else gate["dropped"].get(n, "")
        cal_auc = gate["auc"].get(n, float("nan"))
        lines.append(f"| {n} | {cal_auc:.3f} | {test_auc[n]:.3f} | {sep(test_auc[n]):.3f} | {note} |")
    rule = gate_rule(gate["signals"])
    lines += [
        "",
        f"Chosen gate (Youden on calibration): weak when {rule}; held-out TPR {fires[weak].mean():.2f}, "
        f"FPR {fires[~weak].mean():.2f}.",
        f"Logistic combination of {', '.join(logistic['features'])}: held-out AUC {logistic_auc:.3f} "
        f"vs the best single signal on calibration ({best_cal}) {sep(test_auc[best_cal]):.3f} "
        f"and the best on held-out ({best_single}) {sep(test_auc[best_single]):.3f}.",
        f"Logistic combination of all {len(logistic_all['features'])} signals: held-out AUC {all_auc:.3f}.",
    ]
    if name in SOURCE_NOTE:
        lines.append(f"Source note: {SOURCE_NOTE[name]}.")
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gate.md")
    args = parser.parse_args()
    root = data_dir()
    if root is None:
        raise SystemExit("set BRAG_DATA_DIR to the shared evaluation data")
    lines = [
        "# Weak-retrieval gate: held-out evaluation",
        "",
        "Command: `python bench/gate.py`",
        f"Machine: {platform.machine()}, Python {platform.python_version()}. Windows: BM25 top-{K}. "
        "Calibration split: a seeded random half of each question set; held-out: the other half.",
        "AUC is the probability that a weak window scores higher than a strong one; separation is",
        "max(AUC, 1 - AUC).",
        "",
    ]
    for name, load in DATASETS.items():
        questions, rows = load(root)
        lines += evaluate(name, signal_rows(questions, rows))
        print("\n".join(lines[-8:]), flush=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
