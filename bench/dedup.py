"""Ingestion dedup on real corpora with planted duplicates, per embedder, against SemHash.

For HotpotQA and MuSiQue (from BRAG_DATA_DIR), 10 % of the passages get an exact copy and
another 10 % a near copy (one word dropped, one punctuation mark changed) appended under the same
title. Each embedder embeds everything and runs phase 1 (exact, blocked pairwise, per document);
SemHash (``semhash.SemHash``, given the same model2vec static model, threshold 0.90) deduplicates
the same records in the same run. Recall is the share of planted copies removed; precision the
share of removed segments that were planted.

    python bench/dedup.py [--share 0.1] [--embedders hashing model2vec minilm]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from brag import DedupConfig, HashingEmbedder, Passage, dedup_ingestion
from bragkit import embedders, storage
from bragkit.storage import data_dir

CORPORA = {
    "HotpotQA": "hotpotqa/hotpotqa_ircot500_corpus.json",
    "MuSiQue": "musique/musique_migres200_corpus.json",
}


def near_copy(text: str, rng: random.Random) -> str:
    """One word dropped and one punctuation mark changed: what a re-crawl or an edit leaves."""
    words = text.split()
    if len(words) > 4:
        del words[rng.randrange(1, len(words))]
    out = " ".join(words)
    return out.replace(".", ";", 1) if "." in out else out + "."


def plant(rows: list[dict], share: float, seed: int = 0) -> tuple[list[Passage], dict[int, int]]:
    """The corpus plus planted copies; returns passages and {planted id: source id}."""
    rng = random.Random(seed)
    passages = [Passage(r["title"], r["text"]) for r in rows]
    chosen = rng.sample(range(len(rows)), int(2 * share * len(rows)))
    planted: dict[int, int] = {}
    for n, source in enumerate(chosen):
        text = rows[source]["text"] if n % 2 == 0 else near_copy(rows[source]["text"], rng)
        planted[len(passages)] = source
        passages.append(Passage(rows[source]["title"], text))
    return passages, planted


def score(removed: set[int], planted: dict[int, int]) -> tuple[float, float]:
    hits = len(removed & set(planted))
    recall = hits / len(planted) if planted else 1.0
    precision = hits / len(removed) if removed else 1.0
    return recall, precision


def run_ours(name: str, passages: list[Passage], planted: dict[int, int]) -> dict:
    embedder = HashingEmbedder() if name == "hashing" else embedders.make_embedder(name)
    t0 = time.perf_counter()
    vectors = embedder.embed([p.render() for p in passages])
    t1 = time.perf_counter()
    result = dedup_ingestion(passages, vectors, DedupConfig())
    t2 = time.perf_counter()
    removed = set(result.exact_duplicates) | set(result.near_duplicates)
    original = removed - set(planted)
    recall, precision = score(removed, planted)
    return {
        "method": f"BRAG phase 1 · {embedder.name}",
        "removed": len(removed),
        "original_removed": len(original),
        "recall": recall,
        "precision": precision,
        "embed_s": t1 - t0,
        "dedup_s": t2 - t1,
    }


def run_semhash(passages: list[Passage], planted: dict[int, int]) -> dict:
    from model2vec import StaticModel
    from semhash import SemHash

    model = StaticModel.from_pretrained(str(storage.package_dir("static_model") / "model"))
    records = [{"id": str(i), "text": p.render()} for i, p in enumerate(passages)]
    t0 = time.perf_counter()
    semhash = SemHash.from_records(records, columns=["text"], model=model)
    result = semhash.self_deduplicate(threshold=0.90)
    t1 = time.perf_counter()
    kept = {int(r["id"]) for r in result.selected}
    removed = set(range(len(passages))) - kept
    recall, precision = score(removed, planted)
    return {
        "method": "SemHash 0.5 · same model2vec model",
        "removed": len(removed),
        "original_removed": len(removed - set(planted)),
        "recall": recall,
        "precision": precision,
        "embed_s": None,
        "dedup_s": t1 - t0,
    }


def one_large_document() -> list[str]:
    """Phase 1 on one document of 10,000 segments: its time and its largest block in memory."""
    import numpy as np

    rng = np.random.default_rng(0)
    big = rng.normal(size=(10_000, 64)).astype(np.float32)
    big /= np.linalg.norm(big, axis=1, keepdims=True)
    one_document = [Passage("one document", f"segment {i}") for i in range(len(big))]
    t0 = time.perf_counter()
    result = dedup_ingestion(one_document, big, DedupConfig())
    seconds = time.perf_counter() - t0
    block_mb = DedupConfig().block_size * len(big) * 4 / 2**20
    return [
        f"One document of 10,000 segments (random 64-d unit vectors): exact phase 1 in {seconds:.1f} s, "
        f"{len(result.kept):,} kept; the largest similarity block is {block_mb:.0f} MB "
        f"(block_size {DedupConfig().block_size} x 10,000 float32) instead of "
        f"{len(big) ** 2 * 4 / 2**20:.0f} MB for the full matrix.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, default=0.1, help="share planted as exact and as near copies")
    parser.add_argument("--embedders", nargs="+", default=["hashing", "model2vec", "minilm"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dedup.md")
    args = parser.parse_args()
    root = data_dir()
    if root is None:
        raise SystemExit("set BRAG_DATA_DIR to the shared evaluation data")

    lines = [
        "# Ingestion deduplication: planted duplicates, per embedder, against SemHash",
        "",
        f"Command: `python bench/dedup.py --share {args.share} --embedders {' '.join(args.embedders)}`",
        f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}. "
        "Threshold 0.90 everywhere.",
        f"Planted: {args.share:.0%} of the passages copied exactly and {args.share:.0%} near-copied "
        "(one word dropped, one punctuation mark changed), each under its source's title (same document).",
        "",
    ]
    for corpus_name, rel in CORPORA.items():
        rows = json.loads((root / rel).read_text())
        passages, planted = plant(rows, args.share)
        results = [run_ours(name, passages, planted) for name in args.embedders if embedders.available(name)]
        results.append(run_semhash(passages, planted))
        lines += [
            f"## {corpus_name} ({len(rows):,} passages + {len(planted):,} planted = {len(passages):,})",
            "",
            "| method | removed | of which original passages | planted recall | precision "
            "| embed s | dedup s | total s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            embed = f"{r['embed_s']:.1f}" if r["embed_s"] is not None else "(inside)"
            total = r["dedup_s"] + (r["embed_s"] or 0)
            lines.append(
                f"| {r['method']} | {r['removed']:,} | {r['original_removed']:,} | {r['recall']:.3f} "
                f"| {r['precision']:.3f} | {embed} | {r['dedup_s']:.2f} | {total:.1f} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
    lines += one_large_document()
    lines += [
        "BRAG's phase 1 compares every pair inside a document exactly (blocked matrix products) and never",
        "across documents; SemHash searches the whole corpus with an approximate (usearch) index, so it",
        "also removes cross-document near copies. Precision counts every removed original passage as an",
        "error, so it is a lower bound: MuSiQue holds several revisions of some paragraphs under one title",
        "(of five removed pairs inspected, four were revisions of one paragraph, cosine 0.95–1.00, and one",
        "two different paragraphs of one article, 0.91). Targets: recall ≥ 0.95 at precision ≥ 0.95 with",
        "model2vec, and wall time within 2× of SemHash.",
    ]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
