"""Every action and the next-ranked read (RN) on every labelled set of real manuals.

What ``bench/second_look.py`` fits and replays: each set's answerable and unanswerable
questions observed with R1, R2, CB, RT, RS and RN, at the settings every set was observed
with before (``bench/confidence_observe.py``), so every call but the next-ranked read's is a
hit in ``bench/cache/selftest.sqlite``; into ``bench/results/second_look/<set>.{real,unanswerable}.jsonl``.

    python bench/second_look_observe.py --docs DIR [--set NAME ...] [--replay]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe
import selftest as observed
from harness import documents_parser

import calibrate
from bragkit.llms import CachedLLM, make_llm

OUT = ROOT / "bench" / "results" / "second_look"
ACTIONS = (*confidence_observe.ACTIONS, "RN")


def outcomes_path(name: str, part: str) -> Path:
    return OUT / f"{name}.{part}.jsonl"


def read_outcomes(name: str, part: str) -> list[calibrate.Outcome]:
    path = outcomes_path(name, part)
    return list(calibrate.read_progress(path, name).values()) if path.is_file() else []


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--set", action="append", help="only these sets (default: every one)")
    parser.add_argument("--replay", action="store_true", help="no LLM: every call must be in the cache")
    args = parser.parse_args()
    llm = CachedLLM(make_llm("local"), observed.CACHE, mode="replay" if args.replay else "read-write")
    controller = calibrate.observer(llm, ACTIONS, None, confidence_observe.SETTINGS)
    OUT.mkdir(parents=True, exist_ok=True)
    for _ in confidence_observe.observe_sets(args.docs, args.set, controller, outcomes_path):
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
