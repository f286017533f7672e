"""Add the embedded model's token log-probabilities to the responses already in the cache.

The cache was filled before responses kept log-probabilities. This re-issues each greedy read
that a method's runs need (``--actions``) on the chosen splits, through ``CachedLLM`` in
``backfill`` mode: a stored response gets the log-probabilities only when the new texts equal
the stored ones, so every replayed answer stays what it was.

    python bench/backfill.py --actions R1 --splits calibration,test
    python bench/backfill.py --actions R1,R2,R2 --splits calibration
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import DATASETS

import brag
import calibrate
from bragkit import (
    llms,
    storage,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", default="R1", help="the schedule run on each question")
    parser.add_argument("--splits", default="calibration,test")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "llm.sqlite"))
    args = parser.parse_args()
    root = storage.data_dir()
    assert root is not None, "no evaluation data: set BRAG_DATA_DIR"
    llm = llms.CachedLLM(llms.make_llm("local"), args.cache, mode="backfill")
    schedule = args.actions.split(",")
    started = time.perf_counter()
    for key in args.datasets.split(","):
        ds = DATASETS[key]
        items = calibrate.read_labelled(root / ds.questions)
        corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
        controller = brag.BRAG(llm, calibration=brag.shipped_calibration(llm.name, ds.name), lam=0.0, hops=3)
        chosen = []
        if "calibration" in args.splits:
            chosen += items[: ds.calibration_size]
        if "test" in args.splits:
            chosen += items[ds.calibration_size :][: ds.test_size]
        for number, item in enumerate(chosen, 1):
            controller.run(item.question, corpus, actions=schedule)
            print(
                f"{ds.name} {number}/{len(chosen)} backfilled {llm.backfilled} mismatched {llm.mismatched} "
                f"new {llm.misses} t={time.perf_counter() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    print(f"backfilled {llm.backfilled}, texts differed {llm.mismatched}, new responses {llm.misses}")


if __name__ == "__main__":
    main()
