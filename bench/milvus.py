"""Milvus (Lite) against the bm25s Corpus: agreement, the gate, BRAG's answers, and scale.

- **Agreement.** HotpotQA's corpus in both; on the benchmark's 200 test questions, the top-5
  overlap (shared titles / 5) and recall@2 and @5 of the supporting passages (by title).
- **Gate.** The shipped HotpotQA gate's verdict on each question's bm25s window, from bm25s's
  scores and from Milvus's (the same passages, looked up in Milvus by their key).
- **BRAG.** The first ``--brag`` test questions over each retriever with the embedded model
  through the benchmark's cache (Milvus's windows differ, so some calls are live): accuracy and
  calls.
- **Scale.** ``bench/scale.py``'s synthetic passages into Milvus Lite at ``--sizes``: ingest
  time, peak RSS of the process (Milvus Lite runs inside it), disk, query p50 / p95 over
  ``QUERIES`` queries, and the median cost of one uncached ``document_share``.

    python bench/milvus.py [--brag 100] [--sizes 100000 1000000] [--replay]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import data_dir_or_exit, peak_rss_mb, write_keeping

import brag
import calibrate
from bragkit import milvus as mc

K = 5
QUERIES = 100  # per size: a query takes seconds at a million passages in Milvus Lite
TERMS = ("w1", "w2", "w7", "w50", "w77", "w400", "w777", "w3000", "w12000", "w20000")


def agreement(items: list[dict], questions: list[dict], milvus: mc.MilvusCorpus) -> tuple[list[str], Any]:
    reference = brag.Corpus(items)
    overlap, recall = [], {("bm25s", 2): [], ("bm25s", 5): [], ("milvus", 2): [], ("milvus", 5): []}
    # HotpotQA's own fit holds its gate (the pooled fit the controller runs on has none).
    gate = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-hotpotqa.json").gate
    verdicts, signal_seconds, new_terms = [], [], []
    for q in questions:
        supporting = {p["title"] for p in q["paragraphs"] if p.get("is_supporting")}
        mine = milvus.retrieve(q["question"], K)
        theirs = reference.retrieve(q["question"], K)
        titles = {
            "milvus": [milvus[i].title for i, _ in mine.hits],
            "bm25s": [reference[i].title for i, _ in theirs.hits],
        }
        overlap.append(len(set(titles["milvus"]) & set(titles["bm25s"])) / K)
        for engine, ranked in titles.items():
            for depth in (2, 5):
                recall[engine, depth].append(len(supporting & set(ranked[:depth])) / len(supporting))
        window = [i for i, _ in theirs.hits]
        same = [mc.passage_id(reference[i]) for i in window]
        a = gate.fires(brag.window_signals(q["question"], reference, window, gate.k, theirs))
        terms, started = len(milvus._shares), time.perf_counter()
        b = gate.fires(brag.window_signals(q["question"], milvus, same, gate.k, mine))
        signal_seconds.append(time.perf_counter() - started)
        new_terms.append(len(milvus._shares) - terms)
        verdicts.append((a, b))
    mean = statistics.fmean
    rows = [
        "| retriever | recall@2 | recall@5 |",
        "|---|---|---|",
        *(f"| {e} | {mean(recall[e, 2]):.3f} | {mean(recall[e, 5]):.3f} |" for e in ("bm25s", "milvus")),
        "",
        f"Top-5 overlap (shared titles / 5), mean over {len(questions)} questions: **{mean(overlap):.3f}**.",
        "",
        f"Gate (the shipped HotpotQA gate, on each bm25s window): verdicts agree on "
        f"**{sum(a == b for a, b in verdicts)} of {len(verdicts)}** windows "
        f"({mean(a == b for a, b in verdicts):.3f}); weak by bm25s scores {sum(a for a, _ in verdicts)}, "
        f"by Milvus scores {sum(b for _, b in verdicts)}.",
        "",
        f"The gate's signals over Milvus took a median {1000 * statistics.median(signal_seconds):.0f} ms "
        f"per window (p95 {1000 * statistics.quantiles(signal_seconds, n=20)[-1]:.0f} ms), nearly all of "
        f"it `document_share`: {sum(new_terms)} text-match counts for terms not yet cached, "
        f"{statistics.fmean(new_terms):.1f} per window, "
        f"{1000 * sum(signal_seconds) / max(1, sum(new_terms)):.0f} ms each on average.",
    ]
    return rows, (mean(recall["bm25s", 5]), mean(recall["milvus", 5]), mean(overlap), verdicts)


def brag_runs(
    items: list[dict], questions: list[dict], milvus: mc.MilvusCorpus, n: int, mode: str
) -> list[str]:
    from bragkit import llms

    # Through the benchmark's cache: a window bm25s also gave is a cache hit; others are live calls,
    # stored, so a second run replays.
    llm = llms.CachedLLM(llms.make_llm("local"), ROOT / "bench" / "cache" / "llm.sqlite", mode=mode)
    reference = brag.Corpus(items)
    cal = brag.shipped_calibration(llm.name, "HotpotQA")
    rows = [
        "| retriever | questions | Acc (EM) | LLM calls / question | calls not in the cache before |",
        "|---|---|---|---|---|",
    ]
    labelled = calibrate.read_labelled(questions[:n])
    for name, corpus in (("bm25s", reference), ("milvus", milvus)):
        right, calls, misses = 0, 0, llm.misses
        for item in labelled:
            answer, report = brag.BRAG(llm, calibration=cal).run(item.question, corpus)
            right += brag.exact_match(answer, item.gold)
            calls += report["totals"]["llm_calls"]
        rows.append(f"| {name} | {n} | {right / n:.3f} | {calls / n:.2f} | {llm.misses - misses} |")
        print(rows[-1], flush=True)
    llm.close()
    return rows


def scale_child(n: int, folder: str, queue: Any) -> None:
    from scale import passages, queries

    uri = str(Path(folder) / "scale.db")
    texts = passages(n)
    client = mc.connect(uri)
    started = time.perf_counter()
    mc.ingest([{"title": "", "text": t} for t in texts], client, "scale", batch=2000)
    ingest_s = time.perf_counter() - started
    rss = peak_rss_mb()
    corpus = mc.MilvusCorpus(uri, "scale", client=client)
    corpus.retrieve("w1 w2", K)  # the first search loads the index: not a query's cost
    times = []
    for q in queries(QUERIES):
        t0 = time.perf_counter()
        corpus.retrieve(q, K)
        times.append((time.perf_counter() - t0) * 1000)
    shares = []
    for term in TERMS:
        t0 = time.perf_counter()
        corpus.document_share(term)
        shares.append((time.perf_counter() - t0) * 1000)
    disk = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 1e6
    q = statistics.quantiles(times, n=20)
    queue.put((n, ingest_s, rss, disk, statistics.median(times), q[-1], statistics.median(shares)))


def scale(sizes: list[int]) -> list[str]:
    context = multiprocessing.get_context("spawn")
    rows = [
        "| passages | ingest s | peak RSS (MB) | on disk (MB) | query p50 ms | query p95 ms "
        "| document_share p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        with tempfile.TemporaryDirectory() as folder:
            queue = context.Queue()
            process = context.Process(target=scale_child, args=(n, folder, queue))
            process.start()
            n, ingest_s, rss, disk, p50, p95, share = queue.get(timeout=7200)
            process.join()
        rows.append(
            f"| {n:,} | {ingest_s:.0f} | {rss:.0f} | {disk:.0f} | {p50:.0f} | {p95:.0f} | {share:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--brag", type=int, default=100, help="test questions BRAG answers over each retriever"
    )
    parser.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    parser.add_argument("--replay", action="store_true", help="BRAG's calls only from the cache")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "milvus.md")
    args = parser.parse_args()
    root = data_dir_or_exit("milvus")
    items = json.loads((root / "hotpotqa/hotpotqa_ircot500_corpus.json").read_text(encoding="utf-8"))
    questions = json.loads((root / "hotpotqa/hotpotqa_ircot500.json").read_text(encoding="utf-8"))[60:260]
    command = "python bench/milvus.py" + (f" --brag {args.brag}" if args.brag != 100 else "")
    command += f" --sizes {' '.join(map(str, args.sizes))}" if args.sizes != [100_000, 1_000_000] else ""
    command += " --replay" if args.replay else ""
    lines = ["# Milvus Lite against the bm25s Corpus", "", f"Command: `{command}`", ""]
    with tempfile.TemporaryDirectory() as folder:
        uri = str(Path(folder) / "hotpotqa.db")
        client = mc.connect(uri)
        started = time.perf_counter()
        counts = mc.ingest(items, client, "hotpotqa")
        lines += [
            f"HotpotQA's corpus: {counts['passages']:,} passages, {counts['kept']:,} kept after ingestion "
            f"dedup, ingested into Milvus Lite in {time.perf_counter() - started:.1f} s.",
            "",
            f"## Agreement on the {len(questions)} test questions",
            "",
        ]
        milvus = mc.MilvusCorpus(uri, "hotpotqa", client=client)
        rows, _ = agreement(items, questions, milvus)
        lines += rows
        if args.brag:
            lines += ["", f"## BRAG over each retriever ({args.brag} test questions, embedded model)", ""]
            lines += brag_runs(items, questions, milvus, args.brag, "replay" if args.replay else "read-write")
        client.close()
    if args.sizes:
        lines += ["", "## Scale (bench/scale.py's synthetic passages, Milvus Lite)", "", *scale(args.sizes)]
    lines.append("")
    write_keeping(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
