"""Choose the controller by cross-validated replay on the calibration questions only.

Calibration runs every action on every labelled question (R1, two second hops, CB) through the
response cache, so any policy can be replayed on those questions with no LLM. For each dataset
the calibration questions are split into folds; for each fold a calibration is fitted on the
other folds (``calibrate.calibrate`` in replay mode) and every controller variant runs at every
λ on the held-out fold. The fixed strategies (CB, R1, R1 then R2, and reading up to three times
until an answer) are scored on the same questions. The test splits of ``bench/run.py`` are
never touched.

    python bench/controller.py --model local --folds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from harness import data_dir_or_exit
from run import DATASETS, LAMBDAS, bootstrap_ci

import brag
import calibrate
from bragkit import llms

DEFAULT_LAM = next(f.default for f in dataclasses.fields(brag.BRAG) if f.name == "lam")


@dataclass(frozen=True)
class Variant:
    """One way of weighing votes and hopping (docs/method.md)."""

    name: str
    rule: str
    second_hop: str
    policy: str
    hops: int
    min_calls: int = 0  # 1: the first call is made whatever its price (BRAG's default)
    cost: str = "calls"  # the unit actions are priced in (BRAG(cost=...))


VARIANTS = (
    Variant("SPEC as written", "spec", "independent", "rate", 1),
    Variant("floored", "floored", "independent", "rate", 1),
    Variant("floored + conditional R2", "floored", "conditional", "rate", 1),
    Variant("+ lookahead", "floored", "conditional", "lookahead", 1),
    Variant("+ lookahead, 2 hops", "floored", "conditional", "lookahead", 2),
    Variant("+ one call at least", "floored", "conditional", "lookahead", 2, min_calls=1),
    Variant("+ priced in tokens", "floored", "conditional", "lookahead", 2, min_calls=1, cost="tokens"),
    Variant("+ priced in seconds", "floored", "conditional", "lookahead", 2, min_calls=1, cost="seconds"),
)
HOPS = 2  # the second hops calibration ran on every question (bench/calibrate_all.sh)
FIXED = ("CB", "R1", "R1 → R2", "reads until an answer (≤ 3)")


@dataclass
class Row:
    """One method on one question: right (EM), calls, and whether one of its own reads was right."""

    right: bool
    calls: int
    overruled: bool = False
    seconds: float = 0.0  # LLM seconds, as measured when the calls were made


def folds(n: int, k: int) -> list[list[int]]:
    """``k`` contiguous folds of ``range(n)``, so rows appended fold by fold stay in file order."""
    edges = np.linspace(0, n, k + 1).astype(int)
    return [list(range(edges[i], edges[i + 1])) for i in range(k)]


def fixed_rows(item: calibrate.Labelled, report: dict[str, Any]) -> dict[str, Row]:
    """The fixed strategies, read off one run of R1, the hops and CB (each call made once)."""
    steps = [s for s in report["steps"] if s["action"]]
    read_steps = [s for s in steps if s["action"] in ("R1", "R2")]
    reads = [s["observation"]["answer"] for s in read_steps]
    took = [s["cost"]["llm_seconds"] for s in read_steps]
    cb_step = next(s for s in steps if s["action"] == "CB")
    first = next((i for i, a in enumerate(reads) if a), len(reads) - 1)
    two = reads[1] if len(reads) > 1 else reads[0]

    def em(answer: str) -> bool:
        return brag.exact_match(answer, item.gold)

    return {
        "CB": Row(em(cb_step["observation"]["answer"]), 1, seconds=cb_step["cost"]["llm_seconds"]),
        "R1": Row(em(reads[0]), 1, seconds=took[0]),
        "R1 → R2": Row(em(two), min(2, len(reads)), seconds=sum(took[:2])),
        "reads until an answer (≤ 3)": Row(em(reads[first]), first + 1, seconds=sum(took[: first + 1])),
    }


def brag_row(item: calibrate.Labelled, answer: str, report: dict[str, Any]) -> Row:
    reads = [s["observation"].get("answer") for s in report["steps"] if s["action"] in ("R1", "R2")]
    right = brag.exact_match(answer, item.gold)
    own = any(a and brag.exact_match(a, item.gold) for a in reads)
    return Row(right, report["totals"]["llm_calls"], own and not right, report["totals"]["llm_seconds"])


def run_dataset(key: str, root: Path, llm: brag.LLM, n: int, k_folds: int) -> dict[str, Any]:
    ds = DATASETS[key]
    items = calibrate.read_labelled(root / ds.questions)[:n]
    corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
    rows: dict[str, list[Row]] = {}
    schedule = brag.BRAG(llm, hops=HOPS, lam=0.0)  # the calibration's own schedule, replayed
    for item in items:
        _, report = schedule.run(item.question, corpus, actions=["R1", *["R2"] * HOPS, "CB"])
        for method, row in fixed_rows(item, report).items():
            rows.setdefault(method, []).append(row)
    for fold in folds(len(items), k_folds):
        train = [items[i] for i in range(len(items)) if i not in fold]
        fits = {  # the benchmarks' evidence variant (bench/calibrate_all.sh)
            hops: calibrate.calibrate(train, corpus, llm, hops=hops, evidence="levels")
            for hops in {v.hops for v in VARIANTS}
        }
        for variant in VARIANTS:
            for lam in LAMBDAS:
                controller = brag.BRAG(
                    llm,
                    calibration=fits[variant.hops],
                    lam=lam,
                    rule=variant.rule,
                    second_hop=variant.second_hop,
                    policy=variant.policy,
                    hops=variant.hops,
                    min_calls=variant.min_calls,
                    cost=variant.cost,
                )
                for i in fold:
                    answer, report = controller.run(items[i].question, corpus)
                    rows.setdefault(f"{variant.name} λ={lam}", []).append(brag_row(items[i], answer, report))
    return {"name": ds.name, "n": len(items), "rows": rows}


def summary(rows: list[Row]) -> tuple[float, float, int]:
    return (
        float(np.mean([r.right for r in rows])),
        float(np.mean([r.calls for r in rows])),
        sum(r.overruled for r in rows),
    )


def seconds(rows: list[Row]) -> float:
    return float(np.mean([r.seconds for r in rows]))


def table(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    lines = [
        f"## {result['name']} ({result['n']} calibration questions, cross-validated)",
        "",
        "| method | λ | Acc (EM) | LLM calls | LLM s | wrong though one of its reads was right |",
        "|---|---|---|---|---|---|",
    ]
    for method in FIXED:
        acc, calls, _ = summary(rows[method])
        lines.append(f"| {method} | | {acc:.3f} | {calls:.2f} | {seconds(rows[method]):.2f} | |")
    for variant in VARIANTS:
        for lam in LAMBDAS:
            name = f"{variant.name} λ={lam}"
            acc, calls, overruled = summary(rows[name])
            took = seconds(rows[name])
            lines.append(f"| {variant.name} | {lam} | {acc:.3f} | {calls:.2f} | {took:.2f} | {overruled} |")
    return [*lines, ""]


def verdict(result: dict[str, Any], variant: Variant) -> list[str]:
    """Issue 23's target A on the calibration questions, for ``variant`` at the default λ.

    Within 0.01 of the best fixed strategy's accuracy (CB, R1 or R1 → R2; ties: fewer LLM
    seconds) at no more than 1.1 times its LLM seconds.
    """
    rows = result["rows"]
    fixed = {m: (summary(rows[m])[0], seconds(rows[m])) for m in ("CB", "R1", "R1 → R2")}
    best = max(fixed, key=lambda m: (fixed[m][0], -fixed[m][1]))
    acc, took = fixed[best]
    lam = DEFAULT_LAM
    mine = rows[f"{variant.name} λ={lam}"]
    my_acc, my_took = summary(mine)[0], seconds(mine)
    met = my_acc >= acc - 0.01 and my_took <= 1.1 * took
    a = np.array([r.right for r in mine], dtype=float)
    b = np.array([r.right for r in rows[best]], dtype=float)
    low, high = bootstrap_ci(a, b)
    return [
        f"**{result['name']}, {variant.name}: target A {'met' if met else 'not met'}.** Best fixed "
        f"strategy: {best} ({acc:.3f} at {took:.2f} LLM s). BRAG at the default λ={lam}: {my_acc:.3f} "
        f"at {my_took:.2f} LLM s ({my_took / took:.2f}×); Δ Acc {my_acc - acc:+.3f} (paired bootstrap "
        f"95 % CI {low:+.3f}, {high:+.3f}).",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local", help="the make_llm spec the calibration ran with")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--n", type=int, default=60, help="calibration questions per dataset")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument(
        "--choose",
        nargs="+",
        default=["+ one call at least", "+ priced in tokens", "+ priced in seconds"],
        help="the variants the verdicts are for",
    )
    parser.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "llm.sqlite"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "controller.md")
    args = parser.parse_args(argv)
    root = data_dir_or_exit("controller")
    llm = llms.CachedLLM(llms.make_llm(args.model), args.cache, mode="replay")
    chosen = [v for v in VARIANTS if v.name in args.choose]
    lines = [
        "# Controller variants by cross-validated replay on the calibration questions",
        "",
        f"Command: `python bench/controller.py --model {args.model} --n {args.n} --folds {args.folds}` "
        "(every response replayed from the cache; no LLM, no test question).",
        f"Model: `{llm.name}`. Each fold's calibration is fitted on the other folds.",
        "",
    ]
    results = []
    for key in args.datasets:
        result = run_dataset(key, root, llm, args.n, args.folds)
        results.append(result)
        lines += table(result)
    lines += ["## Verdicts", ""]
    for variant in chosen:
        for result in results:
            lines += verdict(result, variant)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
