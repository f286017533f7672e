"""Calibrating without gold answers: recovery on the calibration questions, and transfer.

Every response is replayed from ``bench/cache/llm.sqlite`` (no LLM). For each dataset:

- **Recovery.** The 60 calibration questions fitted with their gold answers, and without them
  (EM, ``calibrate.fit``); each source's reliability side by side, with EM's fit from the
  prior and from the two other starts it is checked against, and what ``calibrate`` says.
- **Mixed.** The same questions with gold for only the first 10, 20 or 30.
- **Transfer.** Each half of the benchmark's test split fitted without gold.

    python bench/unlabelled.py [--out bench/results/unlabelled.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import data_dir_or_exit, write_keeping
from run import DATASETS

import brag
import calibrate
from bragkit import llms

HOPS = 2
NOTES = "## Verdicts"
SOURCES = ("R1", "R2_same", "R2_new", "CB_1", "CB_3", "CB_5")


def outcomes_of(
    items: list[calibrate.Labelled], corpus: brag.Corpus, llm: brag.LLM
) -> list[calibrate.Outcome]:
    """Every action on every question, as ``calibrate.calibrate`` runs them (no gate)."""
    controller = brag.BRAG(llm, calibration=brag.load_calibration().to_dict(), lam=0.0, hops=HOPS)
    return calibrate.observe(items, corpus, controller)


def reliabilities(fitted: dict[str, Any]) -> dict[str, float]:
    priors = calibrate._loaded(fitted, 5).source_priors(5)
    return {str(t): a / (a + b) for t, (a, b) in priors.items()}


def attempt(outcomes: list[calibrate.Outcome]) -> tuple[dict[str, float] | None, str]:
    """The fit's reliabilities, or None and calibrate's refusal."""
    try:
        fitted = calibrate.fit(outcomes, 5, HOPS)
    except calibrate.Unidentifiable as err:
        return None, f"refused: {err}"
    return reliabilities(fitted), f"accepted ({fitted['fitted_on']})"


def recovery(name: str, outcomes: list[calibrate.Outcome]) -> list[str]:
    labelled = reliabilities(calibrate.fit(outcomes, 5, HOPS))
    blind = [dataclasses.replace(o, labelled=False) for o in outcomes]
    starts = {"prior": None, **{f"{s:g}": s for s in calibrate.EM_STARTS}}
    em = {k: reliabilities(calibrate.fit_unlabelled(blind, 5, HOPS, s)[0]) for k, s in starts.items()}
    _, verdict = attempt(blind)
    lines = [
        f"### {name}: recovery on the {len(outcomes)} calibration questions",
        "",
        "| source | labelled fit | EM from the prior | EM, every reliability 0.05 at the start | EM, 0.95 |",
        "|---|---|---|---|---|",
    ]
    for source in SOURCES:
        cells = " | ".join(f"{em[k][source]:.2f}" for k in starts)
        lines.append(f"| {source} | {labelled[source]:.2f} | {cells} |")
    lines += ["", f"Without gold, `calibrate` {verdict}", ""]
    lines += ["| gold for the first | result | R1 | CB_5 |", "|---|---|---|---|"]
    for n in (10, 20, 30):
        mixed = [o if i < n else dataclasses.replace(o, labelled=False) for i, o in enumerate(outcomes)]
        fitted, said = attempt(mixed)
        values = f"{fitted['R1']:.2f} | {fitted['CB_5']:.2f}" if fitted else "– | –"
        lines.append(f"| {n} | {said.split(':')[0]}: {said.split(':', 1)[-1].strip()[:160]} | {values} |")
    return [
        *lines,
        f"(labelled fit on all {len(outcomes)}: R1 {labelled['R1']:.2f}, CB_5 {labelled['CB_5']:.2f})",
        "",
    ]


def transfer(name: str, outcomes: list[calibrate.Outcome]) -> list[str]:
    half = len(outcomes) // 2
    lines = [f"### {name}: transfer, each half of the {len(outcomes)} test questions fitted without gold", ""]
    for label, part in (("first half", outcomes[:half]), ("second half", outcomes[half:])):
        _, said = attempt([dataclasses.replace(o, labelled=False) for o in part])
        lines.append(f"- {label} ({len(part)} questions): {said}")
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "unlabelled.md")
    args = parser.parse_args()
    root = data_dir_or_exit("unlabelled")
    llm = llms.CachedLLM(llms.make_llm("local"), ROOT / "bench" / "cache" / "llm.sqlite", mode="replay")
    lines = [
        "# Calibrating without gold answers",
        "",
        "Command: `python bench/unlabelled.py` (every response replayed from the cache; no LLM).",
        f"Model: `{llm.name}`. ρ is each source's fitted reliability (the mean of its Beta).",
        "",
    ]
    for ds in DATASETS.values():
        items = calibrate.read_labelled(root / ds.questions)
        corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
        lines += recovery(ds.name, outcomes_of(items[: ds.calibration_size], corpus, llm))
        test = items[ds.calibration_size :][: ds.test_size]
        try:
            lines += transfer(ds.name, outcomes_of(test, corpus, llm))
        except brag.RunAborted as err:  # the benchmark never ran these schedules in full
            lines += [f"### {ds.name}: transfer not run from the cache ({err})", ""]
        print(f"{ds.name} done", file=sys.stderr)
    write_keeping(args.out, lines, NOTES)  # the written verdicts are kept
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
