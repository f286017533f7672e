"""Every action, the sampled focused read (RS) among them, on every labelled set of real manuals.

What ``bench/confidence_documents.py`` fits and replays: each set's answerable and unanswerable
questions observed with R1, R2, CB, RT and RS (the settings every set was observed with before,
so every call but the sampled read's is a hit in ``bench/cache/selftest.sqlite``), into
``bench/results/confidence_documents/<set>.{real,unanswerable}.jsonl``; and each set's
self-test questions (kept in ``<set>.pairs.json`` beside its earlier self-test) with the
actions a self-test runs, from the cache it was run on, into ``<set>.selftest.jsonl``.

    python bench/confidence_observe.py --docs DIR [--set NAME ...] [--replay]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import selftest as observed
from harness import documents_parser

import calibrate
from bragkit import fits
from bragkit.llms import CachedLLM, make_llm

OUT = ROOT / "bench" / "results" / "confidence_documents"
ACTIONS = ("R1", "R2", "CB", "RT", "RS")
SETTINGS = {"lam": 0.0, "k": 5, "m": 5, "seed": 0, "hops": fits.SELF_TEST_HOPS}


def observer(llm: object) -> object:
    return calibrate.observer(llm, ACTIONS, None, SETTINGS)


def outcomes_path(name: str, part: str) -> Path:
    return OUT / f"{name}.{part}.jsonl"


def with_actions(outcomes: list[calibrate.Outcome], keep: Sequence[str]) -> list[calibrate.Outcome]:
    """Outcomes with only the ``keep`` actions, as a run that observed only those would have them."""

    def only(values: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if k in keep}

    return [
        replace(
            o,
            answers=only(o.answers),
            correct=only(o.correct),
            agreement=only(o.agreement),
            weak=only(o.weak),
            hops=only(o.hops),
            usage=only(o.usage),
            evidence=only(o.evidence),
        )
        for o in outcomes
    ]


def read_outcomes(name: str, part: str) -> list[calibrate.Outcome]:
    path = outcomes_path(name, part)
    return list(calibrate.read_progress(path, name).values()) if path.is_file() else []


def self_test_items(name: str) -> tuple[list[calibrate.Labelled], Path] | None:
    """The set's self-test questions and the cache its actions ran on, or None without one."""
    for folder, cache in (
        (ROOT / "bench" / "results" / "self_tests", ROOT / "bench" / "cache" / "self_tests.sqlite"),
        (observed.OUT, observed.CACHE),
    ):
        pairs = folder / f"{name}.pairs.json"
        if pairs.is_file():
            found = json.loads(pairs.read_text(encoding="utf-8"))["pairs"]
            items = [
                calibrate.Labelled(f"self-{i}", p["question"], (p["answer"],)) for i, p in enumerate(found)
            ]
            return items, cache
    return None


def observe_self_test(name: str, corpus: object, mode: str) -> None:
    found = self_test_items(name)
    if found is None:
        return
    items, cache = found
    llm = CachedLLM(make_llm("local"), cache, mode=mode)
    controller = calibrate.observer(llm, observed.PLAN_ACTIONS, None, SETTINGS)
    calibrate.observe(items, corpus, controller, progress_path=outcomes_path(name, "selftest"), progress=name)
    print(f"{name}: {len(items)} self-test questions", flush=True)


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--set", action="append", help="only these sets (default: every one)")
    parser.add_argument("--replay", action="store_true", help="no LLM: every call must be in the cache")
    args = parser.parse_args()
    llm = CachedLLM(make_llm("local"), observed.CACHE, mode="replay" if args.replay else "read-write")
    OUT.mkdir(parents=True, exist_ok=True)
    for name, corpus in observe_sets(args.docs, args.set, observer(llm), outcomes_path):
        observe_self_test(name, corpus, "replay" if args.replay else "read-write")
    return 0


def observe_sets(
    docs: Path, only: list[str] | None, controller: object, path_of: Callable[[str, str], Path]
) -> Iterator[tuple[str, object]]:
    """Each set's answerable and unanswerable questions observed into ``path_of(set, part)``, set by set."""
    for entry, corpus in observed.every_set(docs, only):
        name = entry["name"]
        for part, items in (
            ("real", observed.questions_of(entry)),
            ("unanswerable", observed.unanswerable_of(entry)),
        ):
            started = time.monotonic()
            calibrate.observe(items, corpus, controller, progress_path=path_of(name, part), progress=name)
            print(f"{name}: {len(items)} {part} in {time.monotonic() - started:.0f} s", flush=True)
        yield name, corpus


if __name__ == "__main__":
    raise SystemExit(main())
