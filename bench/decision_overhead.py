"""Median time of one controller decision (posterior + rates + choice), no LLM.

States are drawn like real runs: 1-6 candidates, up to 4 votes from R1, R2 and CB_g, with the
actions already taken removed from the available set.

    python bench/decision_overhead.py [--states 20000] [--out bench/results/decision_overhead.md]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brag import ACTIONS, Vote, VoteModel, choose_action, error_probability, load_calibration


def random_state(rng: random.Random, m: int) -> tuple[list[Vote], int, list[str]]:
    n_candidates = rng.randint(1, 6)
    sources = rng.sample(["R1", "R2", "CB"], rng.randint(1, 3))
    votes = []
    for source in sources[:4]:
        name = f"CB_{rng.randint(1, m)}" if source == "CB" else source
        votes.append(Vote(name, rng.randrange(n_candidates)))
    while len(votes) < rng.randint(len(votes), 4):  # repeated uses (max_uses > 1)
        votes.append(Vote("R1", rng.randrange(n_candidates)))
    available = [a for a in ACTIONS if a not in sources]
    return votes, n_candidates, available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=20000)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "decision_overhead.md"
    )
    args = parser.parse_args()

    cal = load_calibration()
    posterior, rates = VoteModel(cal.source_priors(cal.m), cal.eta), cal.rates()
    costs = {a: 1.0 for a in ACTIONS}
    rng = random.Random(0)
    states = [random_state(rng, cal.m) for _ in range(args.states)]
    timer = time.perf_counter_ns
    for votes, n, available in states[:2000]:  # warm-up
        probs, _ = posterior(votes, n)
        choose_action(error_probability(probs), rates, costs, available, 0.05)
    samples = []
    for votes, n, available in states:
        t0 = timer()
        probs, _ = posterior(votes, n)
        choose_action(error_probability(probs), rates, costs, available, 0.05)
        samples.append((timer() - t0) / 1000)
    overhead = [-(timer() - timer()) for _ in range(10000)]
    clock_us = statistics.median(overhead) / 1000
    median = statistics.median(samples)
    p95 = statistics.quantiles(samples, n=20)[-1]
    command = "python bench/decision_overhead.py" + (
        f" --states {args.states}" if args.states != 20000 else ""
    )
    text = f"""# Decision overhead

Command: `{command}`
Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}

| states | median µs / decision | p95 µs | timer overhead µs | original system | target |
|---|---|---|---|---|---|
| {len(samples)} | {median:.2f} | {p95:.2f} | {clock_us:.3f} | ~13 | ≤ 5 |

A decision is `VoteModel.__call__` (the posterior) + `error_probability` + `choose_action`
(the information rates are fixed per calibration and computed once per BRAG instance).
States: 1–6 candidates, up to 4 votes of types R1, R2 and CB_g, seeded (`random.Random(0)`).
"""
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
