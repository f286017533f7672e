"""Median time of one controller decision, timed exactly as ``_Run.loop`` makes it, no LLM.

A decision is ``_Run._decide``: fold in the vote just observed (``Beliefs.add``), read the
posterior, score every available action (the one-vote lookahead's ``expected_gain``, or SPEC's
``P_err · D / c`` for ``policy="rate"``) and choose. The runner times each decision itself and
reports it per step as ``policy_us``; this script collects those over ``--runs`` runs of the
app's first Demo question, over the Demo corpus, with the calibration the embedded model gets
on HotpotQA and a scripted LLM whose replies vary from run to run (so the posterior states
do). λ = 0, so a run goes on as long as some action has any expected gain. Actions are priced
in BRAG's default unit (tokens), and the lookahead also in SPEC's calls, which open with a read
instead of closed-book and so reach other states.

    python bench/decision_overhead.py [--runs 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import write_keeping

import brag

ANSWERS = ["Bergen", "Oslo", "NONE", "Lina Berg", "Trondheim"]
TARGET_US = 13.0  # the seed's reported decision time
TARGET_RATIO = 1.5  # issue 33: the lookahead's decision at most this many times the rate policy's


class VariedLLM:
    """Replies that depend on the run and the call, so the runs reach different posteriors."""

    name = "scripted"

    def __init__(self, run: int) -> None:
        self.run, self.calls = run, 0

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        """A read names one of ANSWERS; closed-book samples spread over them."""
        self.calls += 1
        pick = (self.run * 7 + self.calls * 3) % len(ANSWERS)
        if messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS:
            texts = [ANSWERS[(pick + i * (self.run % 3)) % len(ANSWERS)] for i in range(n)]
        else:
            texts = [f"Answer: {ANSWERS[pick]}\nFollow-up query: Lina Berg birthplace"]
        return brag.Completion(texts, 100, 5 * n)


NOTES = "## Notes"  # what follows this heading in the results file is kept when it is rewritten
SETTINGS = (("lookahead", brag.DEFAULT_COST_UNIT), ("lookahead", "calls"), ("rate", brag.DEFAULT_COST_UNIT))


def decision_times(
    policy: str, cost: str, runs: int, corpus: brag.Corpus, calibration: brag.Calibration
) -> list[float]:
    question = "Where was the architect of the Glass Tower born?"
    times = []
    for run in range(runs):
        controller = brag.BRAG(VariedLLM(run), calibration=calibration, lam=0.0, policy=policy, cost=cost)
        _, report = controller.run(question, corpus)
        times += [step["policy_us"] for step in report["steps"]]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decision_overhead.md")
    args = parser.parse_args()
    corpus = brag.Corpus((ROOT / "data" / "demo_corpus.json").read_text(encoding="utf-8"))
    calibration = brag.shipped_calibration("local:qwen2.5-coder-0.5b-instruct-q4_k_m:chat", "HotpotQA")
    rows = []
    for policy, cost in SETTINGS:
        decision_times(policy, cost, 20, corpus, calibration)  # warm-up
        # This machine's speed drifts, so several rounds; the median round is reported.
        rounds = [decision_times(policy, cost, args.runs, corpus, calibration) for _ in range(args.rounds)]
        medians = [statistics.median(r) for r in rounds]
        every = [t for r in rounds for t in r]
        rows.append(
            (
                f"{policy}, priced in {cost}",
                len(rounds[0]),
                statistics.median(medians),
                min(medians),
                statistics.quantiles(every, n=20)[-1],
                medians,
            )
        )
    command = "python bench/decision_overhead.py"
    if (args.runs, args.rounds) != (300, 5):
        command += f" --runs {args.runs} --rounds {args.rounds}"
    lines = [
        "# Decision overhead",
        "",
        f"Command: `{command}`",
        f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}",
        "",
        "| policy | decisions per round | median µs per decision (median round) | fastest round | p95 µs "
        "| target |",
        "|---|---|---|---|---|---|",
    ]
    for policy, count, median, fastest, p95, _ in rows:
        target = (
            f"≤ {TARGET_US:g}: {'met' if median <= TARGET_US else 'missed'}"
            if policy.startswith("lookahead")
            else ""
        )
        lines.append(f"| {policy} | {count} | {median:.2f} | {fastest:.2f} | {p95:.2f} | {target} |")
    rate = next(median for policy, _, median, *_ in rows if policy.startswith("rate"))
    lookahead = next(median for policy, _, median, *_ in rows if policy.startswith("lookahead"))
    ratio = lookahead / rate
    lines += [
        "",
        f"Lookahead / rate, priced in {brag.DEFAULT_COST_UNIT}, in this run: {ratio:.2f}× "
        f"(target ≤ {TARGET_RATIO:g}×: {'met' if ratio <= TARGET_RATIO else 'missed'}).",
    ]
    lines += [""] + [f"Round medians, {p} (µs): {', '.join(f'{m:.2f}' for m in ms)}" for p, *_, ms in rows]
    lines += ["", __doc__.split("\n\n")[1].replace("\n", " ").strip(), ""]
    write_keeping(args.out, lines, NOTES)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
