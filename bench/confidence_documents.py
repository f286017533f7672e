"""P(correct) per answer, and a later call where it pays, on every labelled set of real manuals.

Each set of the documents fit (``bench/docs/sets.json`` and ``sets_more.json``), observed with
every action and the sampled focused read (``python bench/confidence_observe.py --docs DIR``),
is answered with everything fitted on the *other* sets:

- the documents fit as this issue fits it (each read's vote its own reliability from an evidence
  curve, the dependence of reads of the same passage, the sampled read) and as it was fitted
  before (two evidence levels of four features; ``calibrate.EVIDENCE_VARIANTS``);
- each refitted on the set's own self-test questions, where the set has a self-test;
- the set's own labels (cross-validated: the ceiling), under both;
- each read alone.

Every run is the controller over the cached LLM responses; a call no observation made (a
second hop after the focused read, say) is made once and cached, and ``--replay`` then runs
with no LLM at all. The curve's refit strength is chosen per set on the other sets' self-tests.

    python bench/confidence_documents.py --docs DIR [--replay]
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe as observations
import documents_fit as documents
import selftest as observed
from harness import documents_parser, write_keeping

import brag
import calibrate
from bragkit import fits
from bragkit.llms import CachedLLM, make_llm

RESULTS = ROOT / "bench" / "results" / "confidence_documents.md"
DETAILS = ROOT / "bench" / "results" / "confidence_documents" / "results.json"
M, HOPS = 5, fits.SELF_TEST_HOPS
LAM = observed.LAM  # the app's default price of a call
CURVE_STRENGTHS = (1.0, 5.0, 20.0, 100.0, 1e6)  # tried for a self-test's refit of a curve
BEFORE_ACTIONS = ("R1", "R2", "CB", "RT")  # what the documents fit observed before the sampled read
FIXED = ("RT", "R1", "RS", "CB")


DocumentSet = documents.DocumentSet  # each set's corpus, questions, outcomes and self-test


def keep_of(evidence: str) -> tuple[str, ...]:
    """The actions a variant's fit sees: before this issue's, the documents fit had no sampled read."""
    return BEFORE_ACTIONS if evidence == "levels" else (*BEFORE_ACTIONS, "RS")


def documents_fit(llm: brag.LLM, sets: list[DocumentSet], evidence: str) -> brag.Calibration:
    """The documents fit over ``sets`` (``evidence``: the variant), with its found model."""
    kept = [replace(s, real=observations.with_actions(s.real, keep_of(evidence))) for s in sets]
    return brag.load_calibration(documents.documents_fit(llm, kept, evidence=evidence))


def refitted(
    base: brag.Calibration, outcomes: list[calibrate.Outcome], curve_strength: float
) -> brag.Calibration:
    fitted = calibrate.self_test_fit(base, outcomes, corpus="bench", hops=HOPS, curve_strength=curve_strength)
    return brag.load_calibration(fitted)


def curve_strengths(
    bases: dict[str, brag.Calibration], sets: list[DocumentSet]
) -> tuple[dict[str, float], dict]:
    """Per set, the curve refit strength whose refits fit the *other* sets' real questions best."""
    tested = [s for s in sets if s.self_test]
    losses = {
        k: {s.name: observed.loss(refitted(bases[s.name], s.self_test, k), s.real) for s in tested}
        for k in CURVE_STRENGTHS
    }
    chosen = {}
    for s in sets:
        others = {k: np.mean([v for n, v in by.items() if n != s.name] or [0.0]) for k, by in losses.items()}
        chosen[s.name] = float(min(others, key=others.get))
    return chosen, {str(k): float(np.mean(list(v.values()))) if v else None for k, v in losses.items()}


# ------------------------------------------------------------------------------------------
# Runs and scores
# ------------------------------------------------------------------------------------------


def scores(answerable: list[dict], unanswerable: list[dict] | None = None) -> dict[str, Any]:
    """Accuracy, AUROC, ECE, Brier, distinct P, guesses, cost, later calls; unanswerable flagged."""
    result = observed.scored(answerable)
    if "p" in answerable[0]:
        result["distinct_p"] = len({round(r["p"], 4) for r in answerable})
        result["first_counts"] = {a: sum(r["actions"][:1] == [a] for r in answerable) for a in FIXED}
    if unanswerable:
        flagged = [(not r["found"]) or r["guess"] for r in unanswerable]
        result["unanswerable_unflagged"] = float(np.mean([not f for f in flagged]))
    return result


CURVE_L2S = (1.0, 5.0, 20.0, 50.0)  # a labelled fit's pull of a curve's weights toward 0, tried
BENCHMARKS = ("hotpotqa", "2wikimultihopqa", "musique")


def variant_losses(families: dict[str, dict[str, list[calibrate.Outcome]]]) -> dict[str, dict[str, float]]:
    """Per family of sets, each evidence variant's vote log-loss on every set fitted on the others.

    ``levels`` and ``curve`` at each ``CURVE_L2S`` (set for the measurement as the module's
    constant, which :func:`calibrate.fit_evidence_levels` reads when it fits).
    """
    variants = {"levels": ("levels", calibrate.CURVE_L2)}
    variants |= {f"curve, L2 {l2:g}": ("curve", l2) for l2 in CURVE_L2S}
    shipped = calibrate.CURVE_L2
    results: dict[str, dict[str, float]] = {}
    try:
        for family, sets in families.items():
            hops = HOPS if family == "documents" else brag.DEFAULT_HOPS
            for label, (evidence, l2) in variants.items():
                calibrate.CURVE_L2 = l2
                losses = []
                for name, held in sets.items():
                    train = [o for other, found in sets.items() if other != name for o in found]
                    fitted = {**calibrate.fit(train, M, hops, evidence), "version": 1}
                    losses.append(
                        float(np.mean(calibrate.vote_losses(brag.load_calibration(fitted), held, hops)))
                    )
                results.setdefault(family, {})[label] = float(np.mean(losses))
    finally:
        calibrate.CURVE_L2 = shipped
    return results


def benchmark_outcomes() -> dict[str, list[calibrate.Outcome]]:
    """The benchmarks' calibration outcomes, kept beside their shipped fits."""
    return {
        name: calibrate.read_outcomes(brag.CALIBRATIONS_DIR / f"qwen2.5-coder-0.5b-{name}.json")
        for name in BENCHMARKS
    }


def held_out(llm: brag.LLM, sets: list[DocumentSet]) -> dict[str, Any]:
    """Every set scored with everything fitted without it."""
    variants = {"after": "curve", "before": "levels"}
    bases = {
        v: {s.name: documents_fit(llm, [o for o in sets if o.name != s.name], ev) for s in sets}
        for v, ev in variants.items()
    }
    chosen, losses = curve_strengths(bases["after"], sets)
    results: dict[str, Any] = {"curve_strength": chosen, "curve_losses": losses, "sets": {}}
    for s in sets:
        found: dict[str, Any] = {}
        for v, evidence in variants.items():
            base = bases[v][s.name]
            found[f"documents fit ({v})"] = scores(*documents.runs(llm, base, s))
            if s.self_test:
                own = refitted(base, s.self_test, chosen[s.name])
                found[f"own self-test fit ({v})"] = scores(observed.run_rows(llm, own, s.items, s.corpus))
            real = observations.with_actions(s.real, keep_of(evidence))
            own_labels = observed.own_labels(llm, base, s.items, real, s.corpus, calibrate.SELF_TEST_STRENGTH)
            found[f"own labels, CV ({v})"] = scores(own_labels)
        for label in FIXED:
            found[f"{label} alone"] = scores(observed.fixed_rows(s.real, label))
        results["sets"][s.name] = {"entry": s.entry, "scores": found, "n": len(s.items)}
    results["sampled_read_cost"] = sampled_read_cost(sets)
    manuals = {s.name: calibrate.without_gate(s.real) for s in sets}
    results["variant_losses"] = variant_losses({"documents": manuals, "benchmarks": benchmark_outcomes()})
    return results


def sampled_read_cost(sets: list[DocumentSet]) -> dict[str, Any]:
    """The sampled read's cost against the focused read's, per question: medians over every set.

    Tokens as recorded (a worker before this issue counted the shared prompt once per sample)
    and with the prompt counted once, as the worker counts it now and an API bills it.
    """
    rt = [o.usage["RT"][0] for s in sets for o in s.real if o.usage.get("RT")]
    rs = [o.usage["RS"][0] for s in sets for o in s.real if o.usage.get("RS")]

    def median(rows: list[dict], key: Any) -> float:
        return float(np.median([key(u) for u in rows]))

    return {
        "n": len(rs),
        "RT": {
            "seconds": median(rt, lambda u: u["llm_seconds"]),
            "tokens": median(rt, lambda u: u["prompt_tokens"] + u["completion_tokens"]),
        },
        "RS": {
            "seconds": median(rs, lambda u: u["llm_seconds"]),
            "tokens_recorded": median(rs, lambda u: u["prompt_tokens"] + u["completion_tokens"]),
            "tokens": median(
                rs, lambda u: u["prompt_tokens"] / max(1, u["requests"]) + u["completion_tokens"]
            ),
        },
    }


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------

COLUMNS = (
    "accuracy",
    "auroc",
    "ece",
    "brier",
    "distinct_p",
    "guess_right",
    "sure_right",
    "calls",
    "tokens",
    "seconds",
    "wrong_first",
    "later_after_wrong",
    "fixed",
    "broke",
)
_f = observed._f


def set_table(name: str, found: dict[str, Any]) -> list[str]:
    entry = found["entry"]
    lines = [
        f"### {name} ({entry.get('format')}, {entry.get('language')}; {found['n']} questions)",
        "",
        "| fit | " + " | ".join(COLUMNS) + " | first read (RT/R1/RS/CB) | unanswerable unflagged |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for label, sc in found["scores"].items():
        first = sc.get("first_counts")
        first_text = "/".join(str(first[a]) for a in FIXED) if first else ""
        cells = [_f(sc.get(c)) for c in COLUMNS]
        lines.append(
            f"| {label} | "
            + " | ".join(cells)
            + f" | {first_text} | {_f(sc.get('unanswerable_unflagged'))} |"
        )
    return [*lines, ""]


def pooled(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per fit, accuracy and tokens pooled over the sets (question-weighted), and the later calls."""
    out: dict[str, dict[str, float]] = {}
    for found in results["sets"].values():
        n = found["n"]
        for label, sc in found["scores"].items():
            row = out.setdefault(
                label,
                {
                    "n": 0,
                    "right": 0.0,
                    "tokens": 0.0,
                    "wrong_first": 0,
                    "later": 0,
                    "fixed": 0,
                    "broke": 0,
                    "sets": 0,
                },
            )
            row["n"] += n
            row["sets"] += 1
            row["right"] += sc["accuracy"] * n
            row["tokens"] += sc["tokens"] * n
            for key, src in (
                ("wrong_first", "wrong_first"),
                ("later", "later_after_wrong"),
                ("fixed", "fixed"),
                ("broke", "broke"),
            ):
                row[key] += sc.get(src) or 0
    return out


def targets(results: dict[str, Any]) -> list[str]:
    """Each target of the issue against the held-out documents fit."""
    lines = ["## Targets (documents fit, after; every set held out)", ""]
    label = "documents fit (after)"
    per_set = [(name, f["scores"][label]) for name, f in results["sets"].items()]
    lines.append("| set | AUROC ≥ 0.80 | ECE ≤ 0.10 | distinct P ≥ 5 |")
    lines.append("|---|---|---|---|")
    for name, sc in per_set:
        lines.append(f"| {name} | {_f(sc['auroc'])} | {_f(sc['ece'])} | {sc['distinct_p']} |")
    table = pooled(results)
    brag_row = table[label]
    best = max((f"{a} alone" for a in FIXED), key=lambda k: table[k]["right"] / table[k]["n"])
    acc = brag_row["right"] / brag_row["n"]
    best_acc = table[best]["right"] / table[best]["n"]
    tokens_ratio = brag_row["tokens"] / table[best]["tokens"]
    lines += [
        "",
        f"- Pooled accuracy {acc:.3f} against the best fixed read ({best}) {best_acc:.3f}: "
        f"{100 * (acc - best_acc):+.1f} points (target +3), at {tokens_ratio:.2f}× its tokens "
        "(target ≤ 1.5×).",
    ]
    wrong, later, fixed, broke = (brag_row[k] for k in ("wrong_first", "later", "fixed", "broke"))
    first_right = brag_row["n"] - wrong  # right first reads: every question whose first read was not wrong
    lines.append(
        f"- Wrong first reads: {wrong:.0f}; a later call after {later:.0f} "
        f"({later / max(1, wrong):.2f}, target ≥ 0.5); fixed {fixed:.0f} "
        f"({fixed / max(1, wrong):.2f}, target ≥ 0.33); right first reads broken {broke:.0f} of "
        f"{first_right:.0f} ({broke / max(1, first_right):.3f}, target ≤ 0.05)."
    )
    before = table["documents fit (before)"]
    lines.append(
        "- Before this issue (same runs, two evidence levels): pooled accuracy "
        f"{before['right'] / before['n']:.3f}, tokens {before['tokens'] / before['n']:.0f} a question; "
        f"after: tokens {brag_row['tokens'] / brag_row['n']:.0f}."
    )
    return [*lines, ""]


def variant_table(results: dict[str, Any]) -> list[str]:
    losses = results["variant_losses"]
    labels = list(next(iter(losses.values())))
    lines = [
        "## Evidence variants: vote log-loss, each set fitted on the others",
        "",
        "The documents sets one manual out at a time; the benchmarks one dataset out at a time "
        "(their calibration splits). Lower is better.",
        "",
        "| family | " + " | ".join(labels) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for family, by in losses.items():
        lines.append(f"| {family} | " + " | ".join(f"{by[label]:.4f}" for label in labels) + " |")
    return [*lines, ""]


def pooled_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Pooled over the sets",
        "",
        "| fit | sets | n | accuracy | tokens a question | wrong first | later | fixed | broke |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in pooled(results).items():
        lines.append(
            f"| {label} | {row['sets']} | {row['n']} | {row['right'] / row['n']:.3f} | "
            f"{row['tokens'] / row['n']:.0f} | "
            f"{row['wrong_first']:.0f} | {row['later']:.0f} | {row['fixed']:.0f} | {row['broke']:.0f} |"
        )
    return [*lines, ""]


def mean_table(results: dict[str, Any]) -> list[str]:
    labels = list(next(iter(results["sets"].values()))["scores"])
    lines = [
        "## Mean over the sets",
        "",
        "| fit | AUROC | ECE | Brier | distinct P |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        found = [f["scores"][label] for f in results["sets"].values() if label in f["scores"]]
        if "auroc" not in found[0]:
            continue
        aurocs = [sc["auroc"] for sc in found if sc.get("auroc") is not None]
        lines.append(
            f"| {label} | {np.mean(aurocs):.3f} | {np.mean([sc['ece'] for sc in found]):.3f} | "
            f"{np.mean([sc['brier'] for sc in found]):.3f} | "
            f"{np.mean([sc['distinct_p'] for sc in found]):.1f} |"
        )
    return [*lines, ""]


def markdown(results: dict[str, Any], command: str) -> list[str]:
    cost = results["sampled_read_cost"]
    lines = [
        "# P(correct) per answer, and a later call where it pays, on real manuals",
        "",
        f"`{command}` (replays `bench/cache/selftest.sqlite`; the outcomes are observed by "
        "`python bench/confidence_observe.py --docs DIR`). Every set is answered with everything "
        "fitted on the other sets, at λ = " + f"{LAM:g}" + ". *after*: this issue's documents fit "
        "(each read's vote its own reliability from an evidence curve, the dependence of reads of the "
        "same passage, the first read priced per question, the sampled read RS); *before*: the same "
        "outcomes fitted as before it (two evidence levels of four features; no RS).",
        "",
        "Curve refit strength per held-out set (chosen on the other sets' self-tests): "
        f"{results['curve_strength']}; "
        f"mean loss by strength: {results['curve_losses']}.",
        "",
        f"The sampled read's cost, median per question over {cost['n']} questions: RS "
        f"{cost['RS']['seconds']:.2f} s, {cost['RS']['tokens']:.0f} tokens with its shared prompt counted "
        f"once ({cost['RS']['tokens_recorded']:.0f} as recorded, the prompt counted per sample); RT "
        f"{cost['RT']['seconds']:.2f} s, {cost['RT']['tokens']:.0f} tokens.",
        "",
        *targets(results),
        *variant_table(results),
        *pooled_table(results),
        *mean_table(results),
        "## Per set",
        "",
        "`wrong_first`: questions whose first read was wrong; `later_after_wrong`: of them, those "
        "where a later call ran; `fixed`: of them, answered right in the end; `broke`: a right first "
        "read whose final answer is wrong. `guess_right`/`sure_right`: accuracy of answers shown as "
        "a guess and of the rest.",
        "",
    ]
    for name, found in results["sets"].items():
        lines += set_table(name, found)
    return lines


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--replay", action="store_true", help="from the cache alone (no LLM)")
    args = parser.parse_args()
    llm = CachedLLM(make_llm("local"), observed.CACHE, mode="replay" if args.replay else "read-write")
    sets = documents.document_sets(args.docs)
    results = held_out(llm, sets)
    DETAILS.write_text(
        json.dumps(results, indent=1, ensure_ascii=False, default=float) + "\n", encoding="utf-8"
    )
    command = "python bench/confidence_documents.py --docs DIR" + (" --replay" if args.replay else "")
    write_keeping(RESULTS, markdown(results, command))
    print(RESULTS.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
