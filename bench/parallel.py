"""Parallel calibration against an endpoint: wall time at 1, 4, 16 and 32 workers.

A loopback OpenAI-compatible endpoint with a fixed latency per request runs in its own process
(``tests/openai_server.py``); ``calibrate.calibrate`` runs R1, R2 and CB on every labelled
question with ``workers`` questions at once, with no response cache, so every call reaches the
endpoint. Each level must produce the same calibration as one worker (checked).

    python bench/parallel.py --questions 64 --latency 0.2 --levels 1 4 16 32
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import brag
import calibrate
from bragkit import llms

FIELDS = ("eta", "actions", "counts", "diagnostics", "gate")


class Counted:
    """An LLM that counts its calls (from any thread)."""

    def __init__(self, llm: brag.LLM) -> None:
        self.llm, self.name, self.calls = llm, llm.name, 0
        self._lock = threading.Lock()

    def complete(self, messages, **kwargs):  # noqa: D102 (brag.LLM)
        with self._lock:
            self.calls += 1
        return self.llm.complete(messages, **kwargs)


def corpus_and_questions(n: int) -> tuple[brag.Corpus, list[calibrate.Labelled]]:
    """A synthetic corpus of people and towns, and ``n`` two-hop questions about it."""
    passages = []
    for i in range(n):
        passages.append({"title": f"Tower {i}", "text": f"Tower {i} was designed by Person {i}."})
        passages.append({"title": f"Person {i}", "text": f"Person {i} was born in Town {i}."})
    ask = "Where was the architect of Tower {} born?"
    items = [calibrate.Labelled(f"q{i}", ask.format(i), (f"Town {i}",)) for i in range(n)]
    return brag.Corpus(passages), items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per request at the endpoint")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "parallel.md")
    args = parser.parse_args()

    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "openai_server.py"), "--delay", str(args.latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().strip()
        corpus, items = corpus_and_questions(args.questions)
        results, rows, baseline = {}, [], None
        for workers in args.levels:
            llm = Counted(llms.make_llm(url + "#m"))
            started = time.perf_counter()
            result = calibrate.calibrate(items, corpus, llm, workers=workers)
            seconds = time.perf_counter() - started
            results[workers] = result
            baseline = baseline or seconds
            same = all(result[f] == results[args.levels[0]][f] for f in FIELDS)
            cells = [
                workers,
                f"{seconds:.1f}",
                f"{baseline / seconds:.1f}×",
                f"{seconds / len(items) * 1000:.0f}",
            ]
            cells += [f"{llm.calls / len(items):.1f}", "yes" if same else "NO"]
            rows.append("| " + " | ".join(map(str, cells)) + " |")
            print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait()
    text = "\n".join(
        [
            "# Parallel calibration against an endpoint",
            "",
            f"Command: `python bench/parallel.py --questions {args.questions} --latency {args.latency} "
            f"--levels {' '.join(map(str, args.levels))}`",
            f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}. The endpoint is "
            f"`tests/openai_server.py` in its own process, answering every request after {args.latency:g} s; "
            "`calibrate.calibrate` runs R1, R2 and CB on each of the questions with `workers` questions "
            "at once and no response cache.",
            "",
            "| workers | wall s | speed-up | ms per question | LLM calls per question "
            "| same calibration as 1 worker |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "Cost per question is the wall time divided by the questions; the LLM calls per question are",
            "the same at every level (each question's actions stay in order inside one worker).",
        ]
    )
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
