"""Large corpora: index time, peak memory, size on disk, load time and query latency.

Synthetic corpora of 100k, 1M and 3M passages whose words follow a Zipf law (as words in text
do), written as JSON Lines; each is indexed by ``python -m brag index`` in a process of its own
(its peak resident memory is the indexing's, reading the file included); then a fresh process
loads it memory-mapped, cold (the page cache dropped first, where the machine allows it), and
runs queries at k = 5, its peak resident memory covering the load and the queries.

    python bench/scale.py --sizes 100000 1000000 3000000 --queries 200
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import peak_rss_mb

VOCABULARY = 300_000
ZIPF = 1.15  # the exponent of the word-rank distribution


def passages(n: int, seed: int = 0) -> list[str]:
    """``n`` passages of 30 to 90 words drawn from a Zipf law over ``VOCABULARY`` words."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(30, 91, size=n)  # words per passage
    ranks = rng.zipf(ZIPF, size=int(lengths.sum())) % VOCABULARY
    words = np.char.add("w", ranks.astype(str))
    return [" ".join(chunk) for chunk in np.split(words, np.cumsum(lengths)[:-1])]


def queries(count: int, seed: int = 1) -> list[str]:
    """Questions of 5 to 12 words, drawn like the passages' words (common and rare mixed)."""
    rng = np.random.default_rng(seed)
    return [
        " ".join(f"w{r % VOCABULARY}" for r in rng.zipf(ZIPF, size=rng.integers(5, 13))) for _ in range(count)
    ]


def write_collection(n: int, path: Path) -> dict:
    """The synthetic collection as JSON Lines, written in chunks (to keep this process small)."""
    with path.open("w", encoding="utf-8") as out:
        for start in range(0, n, 100_000):
            chunk = passages(min(100_000, n - start), seed=start)
            out.write("".join(json.dumps({"title": "", "text": t}) + "\n" for t in chunk))
    return {"collection_mb": path.stat().st_size / 1e6}


def index(docs: Path, out: Path) -> dict:
    """``python -m brag index`` in this process: its time, and this process's peak memory."""
    from bragkit import cli

    started = time.perf_counter()
    if cli.main(["index", str(docs), str(out)]) != 0:
        raise SystemExit("indexing failed")
    return {"index_s": time.perf_counter() - started, "index_rss_mb": peak_rss_mb()}


def serve(out: Path, count: int) -> dict:
    """A cold start: import brag, load the index, answer a first query; then timed queries."""
    started = time.perf_counter()
    import brag

    corpus = brag.Corpus.load(out)
    corpus.search("w1 w2", 5)  # the first query touches the vocabulary and the arrays
    load_s = time.perf_counter() - started
    times = []
    for query in queries(count):
        t0 = time.perf_counter()
        corpus.search(query, 5)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1000
    return {
        "load_s": load_s,
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "serve_rss_mb": peak_rss_mb(),
        "passages": len(corpus),
    }


def drop_page_cache() -> bool:
    """Ask the kernel to drop its page cache (needs root); False where it cannot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def child(step: str, n: int, folder: Path, count: int) -> dict:
    """One step in a fresh process, so its peak memory is that step's alone."""
    command = [sys.executable, __file__, "--step", step, "--size", str(n), "--dir", str(folder)]
    result = subprocess.run([*command, "--queries", str(count)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict], args: argparse.Namespace, cold: bool) -> list[str]:
    load = "cold: the page cache dropped first" if cold else "warm (the page cache could not be dropped)"
    lines = [
        "# Large corpora: indexing, memory, disk, load and query time",
        "",
        f"Command: `python bench/scale.py --sizes {' '.join(map(str, args.sizes))} --queries {args.queries}`",
        f"Machine: {platform.machine()}, 2 cores, 24 GB, Python {platform.python_version()}, the `okapi` "
        f"variant. Passages of 30 to 90 words drawn from a Zipf law (exponent {ZIPF}) over "
        f"{VOCABULARY:,} words, as JSON Lines; queries of 5 to 12 such words. Index: `python -m brag "
        "index docs.jsonl out/` in a process of its own, reading the file included. Load: a fresh "
        f"process imports brag and opens the folder with `Corpus.load` (memory-mapped), {load}, up to "
        "the end of its first query; then the queries, one at a time, at k = 5.",
        "",
        "| passages | JSONL (MB) | index s | peak RSS indexing (MB) | on disk (MB) | load s (cold, mmap) "
        "| query p50 ms | query p95 ms | peak RSS load + queries (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r['n']:,}",
            f"{r['collection_mb']:.0f}",
            f"{r['index_s']:.0f}",
            f"{r['index_rss_mb']:.0f}",
        ]
        cells += [f"{r['disk_mb']:.0f}", f"{r['load_s']:.2f}", f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}"]
        lines.append("| " + " | ".join([*cells, f"{r['serve_rss_mb']:.0f}"]) + " |")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        growth = {
            key: f"{last[key] / first[key]:.1f}×"
            for key in ("index_s", "index_rss_mb", "disk_mb", "load_s", "p50_ms", "p95_ms", "serve_rss_mb")
        }
        lines += [
            "",
            f"Growth from {first['n']:,} to {last['n']:,} passages ({last['n'] / first['n']:.0f}× the "
            f"passages): index time {growth['index_s']}, indexing memory {growth['index_rss_mb']}, disk "
            f"{growth['disk_mb']}, load {growth['load_s']}, query p50 {growth['p50_ms']}, p95 "
            f"{growth['p95_ms']}, serving memory {growth['serve_rss_mb']}.",
        ]
    for r in rows:
        if r["n"] == 1_000_000:
            verdicts = [
                f"load under 2 s: {r['load_s']:.2f} s ({'met' if r['load_s'] < 2 else 'not met'})",
                f"query p50 under 10 ms: {r['p50_ms']:.2f} ms ({'met' if r['p50_ms'] < 10 else 'not met'})",
                f"peak RSS during queries under 2 GB: {r['serve_rss_mb']:.0f} MB "
                f"({'met' if r['serve_rss_mb'] < 2048 else 'not met'})",
            ]
            lines += ["", "Targets at 1M passages: " + "; ".join(verdicts) + "."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 3_000_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--step", choices=["write", "index", "serve"], help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.md")
    args = parser.parse_args()
    if args.step:  # one step, in a process of its own
        steps = {
            "write": lambda: write_collection(args.size, args.dir / "docs.jsonl"),
            "index": lambda: index(args.dir / "docs.jsonl", args.dir / "index"),
            "serve": lambda: serve(args.dir / "index", args.queries),
        }
        print(json.dumps(steps[args.step]()))
        return

    rows, cold = [], True
    for n in args.sizes:
        folder = Path(tempfile.mkdtemp(prefix=f"brag-scale-{n}-"))
        try:
            row = {
                "n": n,
                **child("write", n, folder, args.queries),
                **child("index", n, folder, args.queries),
            }
            row["disk_mb"] = sum(f.stat().st_size for f in (folder / "index").rglob("*") if f.is_file()) / 1e6
            cold &= drop_page_cache()
            row.update(child("serve", n, folder, args.queries))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = table(rows, args, cold)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
