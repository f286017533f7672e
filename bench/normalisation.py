"""CPU and memory per MB of pasted text: English, Han, and the character NFKC expands most.

BRAG reads text in Unicode NFKC form, where U+FDFA (ﷺ) becomes 18 characters. Each case
indexes the text (``brag.Corpus``) and answers one question over it through ``BRAG.stream``,
as ``/brag`` does (a report after every step), with a scripted reader that answers a word of
the top passage; then it asks the app's own checks (``serving.inputs.check_documents``) what
they would do with the same text. Every case runs in a fresh process, once for this checkout
and once for ``--before`` (another checkout: the code before a change), alternating.

    python bench/normalisation.py --before /tmp/old --mb 1 5 [--passage-bytes 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "normalisation.md"
_WORDS = (
    "Bergen keeps the records of every flood since the bridge was built in stone by the guild of "
    "masons who came from the south past the old mill where the river flows north"
).split()
_HAN = "東京大阪名古屋設計者電波塔完成年月日本語文書検索質問答案資料説明内容方法結果"


def text_of(kind: str, megabytes: float, passage_bytes: int) -> str:
    """About ``megabytes`` MB (UTF-8) of pasted documents of one ``kind``, a line per passage."""
    unit = {"english": " ".join(_WORDS) + ". ", "han": _HAN + "。", "fdfa": "\ufdfa"}[kind]
    line = unit * max(1, passage_bytes // len(unit.encode()))
    lines = max(1, round(megabytes * 1_000_000 / len(line.encode())))
    return "\n".join(line for _ in range(lines))


class TopWordReader:
    """Reads answer the first word of the top passage; closed-book says NONE."""

    name = "scripted"

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        """One reply per call: the word for a read, NONE for each closed-book sample."""
        import brag

        prompt = messages[-1]["content"]
        body = prompt.rsplit("Passages:\n", 1)[-1]
        word = body.split("] ", 1)[-1].split()[0][:12] if "] " in body else "NONE"
        texts = [f"Answer: {word}\nFollow-up query: {word} records"] if n == 1 else ["NONE"] * n
        return brag.Completion(texts, 100, 7)


def one_case(kind: str, megabytes: float, passage_bytes: int) -> dict[str, float | str]:
    """Index, answer, check: CPU seconds and peak-RSS growth of each, in this process."""
    import brag
    from bragkit.serving.inputs import check_documents
    from bragkit.serving.limits import Limits, RequestRefused

    text = text_of(kind, megabytes, passage_bytes)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, rss0 = usage.ru_utime + usage.ru_stime, usage.ru_maxrss

    def since() -> tuple[float, float]:
        now = resource.getrusage(resource.RUSAGE_SELF)
        return now.ru_utime + now.ru_stime - cpu0, (now.ru_maxrss - rss0) / 1024

    started = time.perf_counter()
    try:
        check_documents(text, Limits(documents_bytes=5_000_000))
        verdict = "accepted"
    except RequestRefused as err:
        verdict = "refused: " + str(err)[:90]
    check_cpu, _ = since()
    corpus = brag.Corpus(text.splitlines())
    index_cpu, index_rss = since()
    steps = list(brag.BRAG(TopWordReader()).stream("Which records does the town keep?", corpus))
    reports, report = len(steps), steps[-1][1]
    run_cpu, rss = since()
    return {
        "kind": kind,
        "mb": len(text.encode()) / 1e6,
        "check": verdict,
        "check_cpu": round(check_cpu, 3),
        "index_cpu": round(index_cpu - check_cpu, 3),
        "run_cpu": round(run_cpu - index_cpu, 3),
        "rss_mb": round(rss, 1),
        "index_rss_mb": round(index_rss, 1),
        "reports": reports,
        "wall": round(time.perf_counter() - started, 3),
        "answered": str(report["answer"])[:20],
    }


def measure(code: Path, kind: str, megabytes: float, passage_bytes: int) -> dict[str, float | str]:
    """``one_case`` in a fresh process that imports ``code``'s brag (and this checkout's bench)."""
    command = [sys.executable, __file__, "one", kind, str(megabytes), "--code", str(code)]
    command += ["--passage-bytes", str(passage_bytes)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[str, dict, dict]]) -> list[str]:
    lines = [
        "| text | MB | code | app's check | check CPU s | index CPU s | run CPU s | CPU s / MB | "
        "peak RSS +MB | reports |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, before, after in rows:
        for name, r in (("before", before), ("after", after)):
            total = r["index_cpu"] + r["run_cpu"]
            lines.append(
                f"| {label} | {r['mb']:.2f} | {name} | {r['check']} | {r['check_cpu']:.3f} | "
                f"{r['index_cpu']:.2f} | {r['run_cpu']:.2f} | {total / r['mb']:.2f} | {r['rss_mb']:.0f} | "
                f"{r['reports']} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "one"])
    parser.add_argument("kind", nargs="?")
    parser.add_argument("size", nargs="?", type=float)
    parser.add_argument("--before", type=Path, help="the checkout to compare with (the code before)")
    parser.add_argument("--code", type=Path, default=ROOT, help="(internal) the checkout a case imports")
    parser.add_argument("--mb", type=float, nargs="+", default=[1.0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per case and code")
    parser.add_argument("--passage-bytes", type=int, default=1_000_000, help="bytes of each pasted line")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.what == "one":
        sys.path[:0] = [str(args.code), str(ROOT)]  # the measured brag first, this serving after
        print(json.dumps(one_case(args.kind, args.size, args.passage_bytes)))
        return
    if args.before is None:
        parser.error("--before CHECKOUT: the code to compare with")
    rows = []
    for kind in ("english", "han", "fdfa"):
        for megabytes in args.mb:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(args.runs):  # alternating, so both codes see the same machine
                runs["before"].append(measure(args.before, kind, megabytes, args.passage_bytes))
                runs["after"].append(measure(ROOT, kind, megabytes, args.passage_bytes))
            rows.append((kind, *(median_run(runs[code]) for code in ("before", "after"))))
            print(rows[-1], flush=True)
    write(args, rows)


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the runs; the text fields of the first."""
    numbers = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in numbers}}


def write(args: argparse.Namespace, rows: list) -> None:
    sizes = " ".join(f"{mb:g}" for mb in args.mb)
    command = (
        f"python bench/normalisation.py --before {args.before} --mb {sizes} "
        f"--passage-bytes {args.passage_bytes}"
    )
    text = [
        "# Work per MB of pasted text, before and after (issue 41)",
        "",
        f"Command: `{command} --runs {args.runs}` (medians of {args.runs} fresh processes per case and "
        f"code, alternating). Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}.",
        "",
        f"Each case pastes lines of about {args.passage_bytes:,} bytes (one passage each): English "
        "words; Han characters with a full stop; or U+FDFA alone, which NFKC turns into 18 "
        "characters. *app's check* is what `serving.inputs.check_documents` says of the text (the "
        "server refuses before indexing); the rest is the library path with no server limit: "
        "`brag.Corpus` (index), then `BRAG.stream` over it with a reader that answers the top "
        "passage's first word (run: every report, each with its support check, evidence and "
        "quote). *Before* = the checkout given as "
        "`--before`; peak RSS is the growth of the process's peak over the case.",
        "",
        *table(rows),
    ]
    args.out.write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))


if __name__ == "__main__":
    main()
