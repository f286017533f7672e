"""Median time of one controller step between LLM calls, no LLM.

A step is what the runner does between two LLM calls: add the vote just observed to the
posterior (``Beliefs.add``), read the posterior (``Beliefs.probabilities``), and choose the next
action or stop (``error_probability`` + ``choose_action``; the information rates are fixed per
calibration). States are drawn like real runs: 1-6 candidates, up to 4 votes of types R1, R2 and
CB_g, with the actions already taken removed from the available set.

    python bench/decision_overhead.py [--states 20000] [--rounds 7]
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

from brag import (
    ACTIONS,
    Beliefs,
    Vote,
    VoteModel,
    choose_action,
    error_probability,
    load_calibration,
)

State = tuple[Beliefs, Vote, int, list[str]]


def random_votes(rng: random.Random, m: int) -> tuple[list[Vote], int, list[str]]:
    n_candidates = rng.randint(1, 6)
    sources = rng.sample(["R1", "R2", "CB"], rng.randint(1, 3))
    votes = []
    for source in sources:
        name = f"CB_{rng.randint(1, m)}" if source == "CB" else source
        votes.append(Vote(name, rng.randrange(n_candidates)))
    while len(votes) < rng.randint(len(votes), 4):  # repeated uses (max_uses > 1)
        votes.append(Vote("R1", rng.randrange(n_candidates)))
    available = [a for a in ACTIONS if a not in sources]
    return votes, n_candidates, available


def prepare(model: VoteModel, drawn: list[tuple[list[Vote], int, list[str]]]) -> list[State]:
    """Posterior states holding every vote but the last, which the timed step adds."""
    states = []
    for votes, n, available in drawn:
        beliefs = model.beliefs()
        for vote in votes[:-1]:
            beliefs.add(vote)
        states.append((beliefs, votes[-1], n, available))
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    default_out = Path(__file__).parent / "results" / "decision_overhead.md"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()

    cal = load_calibration()
    model = VoteModel(cal.source_priors(cal.m), cal.eta)
    rate_per_cost = cal.rates()  # every action costs one call
    rng = random.Random(0)
    drawn = [random_votes(rng, cal.m) for _ in range(args.states)]
    timer = time.perf_counter_ns

    # This machine's speed drifts between runs, so time several rounds and report the median round.
    round_medians, all_samples = [], []
    for _ in range(args.rounds + 1):  # the first round warms up and is not counted
        samples = []
        for beliefs, vote, n, available in prepare(model, drawn):
            t0 = timer()
            beliefs.add(vote)
            probs, _ = beliefs.probabilities(n)
            choose_action(error_probability(probs), rate_per_cost, available, 0.05)
            samples.append((timer() - t0) / 1000)
        round_medians.append(statistics.median(samples))
        all_samples += samples
    round_medians, all_samples = round_medians[1:], all_samples[len(drawn) :]
    overhead = [-(timer() - timer()) for _ in range(10000)]
    clock_us = statistics.median(overhead) / 1000
    median = statistics.median(round_medians)
    fastest = min(round_medians)
    p95 = statistics.quantiles(all_samples, n=20)[-1]
    command = "python bench/decision_overhead.py"
    if (args.states, args.rounds) != (20000, 7):
        command += f" --states {args.states} --rounds {args.rounds}"
    text = f"""# Decision overhead

Command: `{command}`
Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}

| states × rounds | median µs / step (median round) | fastest round | p95 µs | timer µs | original | target |
|---|---|---|---|---|---|---|
| {len(drawn)} × {args.rounds} | {median:.2f} | {fastest:.2f} | {p95:.2f} | {clock_us:.3f} | ~13 | ≤ 5 |

Round medians (µs): {", ".join(f"{m:.2f}" for m in round_medians)}

A step is everything the controller does between two LLM calls: `Beliefs.add` (the vote just
observed), `Beliefs.probabilities`, `error_probability` and `choose_action`. States: 1–6
candidates, up to 4 votes of types R1, R2 and CB_g, seeded (`random.Random(0)`).
"""
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
