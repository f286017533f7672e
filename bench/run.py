"""BRAG against the baselines on HotpotQA, 2WikiMultihopQA and MuSiQue, reproducible by replay.

Every method uses the same LLM, prompts, k and m, through one response cache, so each distinct
LLM request is made once across methods; ``--replay`` recomputes every number from the cache
with no LLM. Test questions come after each dataset's calibration split (see ``DATASETS``), and
BRAG uses the calibration shipped for the model (``brag.shipped_calibration``).

    python bench/run.py --model local                # fills bench/cache/llm.sqlite
    python bench/run.py --model local --replay       # the same tables, no LLM

Methods: closed-book (CB, one call); vanilla RAG (R1); IRCoT / self-ask style (R1 then R2);
adaptive / CRAG style (R2 only when R1 says NONE or the gate calls R1's window weak); IRCoT-style
iteration (read, then hop with the latest follow-up query, until the model answers, at most four
reads); the best of those fixed strategies as chosen on the calibration split; and BRAG at each
lambda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import brag
import calibrate
from bragkit import (
    llms,
    storage,
)
from bragkit import milvus as milvus_corpus

LAMBDAS = (0.01, 0.02, 0.05, 0.1, 0.2)
DEFAULT_LAMBDA = 0.05
FIXED = ("Closed-book", "Vanilla RAG", "IRCoT / self-ask", "Adaptive / CRAG", "IRCoT, up to 4 reads")
BEST_FIXED = "Best fixed (chosen on calibration)"
BASELINES = (*FIXED, BEST_FIXED)
# Hollow markers of falling size, so baselines that land on the same point stay visible.
MARKERS = {
    "Closed-book": ("o", 170, "C0"),
    "Vanilla RAG": ("s", 130, "C1"),
    "IRCoT / self-ask": ("^", 100, "C2"),
    "Adaptive / CRAG": ("D", 70, "C3"),
    "IRCoT, up to 4 reads": ("v", 45, "C4"),
    BEST_FIXED: ("*", 25, "C5"),
}


@dataclass(frozen=True)
class Dataset:
    """A question file, its corpus, and its splits: calibration first, then the test questions."""

    name: str
    questions: str
    corpus: str
    calibration_size: int  # the calibration split is [0, calibration_size)
    test_size: int | None  # None: every question after the calibration split


DATASETS = {
    "hotpotqa": Dataset(
        "HotpotQA", "hotpotqa/hotpotqa_ircot500.json", "hotpotqa/hotpotqa_ircot500_corpus.json", 60, 200
    ),
    "2wiki": Dataset(
        "2WikiMultihopQA",
        "2wikimultihopqa/2wikimultihopqa.json",
        "2wikimultihopqa/2wikimultihopqa_corpus.json",
        60,
        200,
    ),
    "musique": Dataset(
        "MuSiQue", "musique/musique_migres200.json", "musique/musique_migres200_corpus.json", 60, None
    ),
}

Row = tuple[float, float, int, int, float]  # EM, F1, LLM calls, tokens, LLM seconds


def score(answer: str, gold: tuple[str, ...]) -> tuple[float, float]:
    """(exact match with any gold, best token F1)."""
    em = float(brag.exact_match(answer, gold))
    return em, max(brag.token_f1(answer, g) for g in gold) if answer else 0.0


def cost(steps: list[dict[str, Any]], upto: int | None = None) -> tuple[int, int, float]:
    """(LLM calls, tokens, LLM seconds as measured when made) of a report's first ``upto`` actions."""
    acted = [s for s in steps if "cost" in s][:upto]
    calls = sum(s["cost"]["llm_calls"] for s in acted)
    tokens = sum(s["cost"]["prompt_tokens"] + s["cost"]["completion_tokens"] for s in acted)
    return calls, tokens, round(sum(s["cost"]["llm_seconds"] for s in acted), 6)


def reads_until_answer(
    controller: brag.BRAG, question: str, corpus: brag.Corpus
) -> tuple[str, dict[str, Any]]:
    """IRCoT-style iteration: read, hop with the latest follow-up query, stop at the first answer.

    At most four reads; a read after the answer is never made (the run is stopped there).
    """
    report: dict[str, Any] = {}
    for _, report in controller.stream(question, corpus, actions=["R1", "R2", "R2", "R2"]):
        done = [s for s in report["steps"] if "observation" in s]
        if done and done[-1]["observation"].get("answer"):
            return done[-1]["observation"]["answer"], report
    reads = [s["observation"].get("answer", "") for s in report.get("steps", []) if "observation" in s]
    return (reads[-1] if reads else ""), report


def fixed_rows(
    item: calibrate.Labelled, corpus: brag.Corpus, fixed: brag.BRAG
) -> tuple[dict[str, Row], dict[str, Any], bool | None]:
    """Every fixed strategy on one question; also the R1-then-R2 report and the gate's verdict."""
    rows: dict[str, Row] = {}
    answer, report = fixed.run(item.question, corpus, actions=["CB"])
    rows["Closed-book"] = (*score(answer, item.gold), *cost(report["steps"]))
    _, both = fixed.run(item.question, corpus, actions=["R1", "R2"])
    r1_answer = both["steps"][0]["observation"]["answer"]
    rows["Vanilla RAG"] = (*score(r1_answer, item.gold), *cost(both["steps"], 1))
    rows["IRCoT / self-ask"] = (*score(both["answer"], item.gold), *cost(both["steps"]))
    verdict = (both["gate"].get("R1") or {}).get("weak")  # None without a calibrated gate
    hop = not r1_answer or verdict is True
    adaptive = (both["answer"], cost(both["steps"])) if hop else (r1_answer, cost(both["steps"], 1))
    rows["Adaptive / CRAG"] = (*score(adaptive[0], item.gold), *adaptive[1])
    answer, report = reads_until_answer(fixed, item.question, corpus)
    rows["IRCoT, up to 4 reads"] = (*score(answer, item.gold), *cost(report["steps"]))
    return rows, both, verdict


def in_parallel(work: Any, items: list[Any], workers: int) -> list[Any]:
    """``[work(item) for item in items]``, ``workers`` at a time, results in the items' order."""
    if workers <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(work, items))


def best_fixed_on_calibration(
    items: list[calibrate.Labelled], corpus: brag.Corpus, fixed: brag.BRAG, workers: int = 1
) -> tuple[str, dict[str, float]]:
    """The fixed strategy with the best accuracy on the calibration split (fewer calls break ties)."""
    rows: dict[str, list[Row]] = {}
    for found in in_parallel(lambda item: fixed_rows(item, corpus, fixed)[0], items, workers):
        for method, row in found.items():
            rows.setdefault(method, []).append(row)
    mean = {
        m: (float(np.mean([r[0] for r in v])), float(np.mean([r[2] for r in v]))) for m, v in rows.items()
    }
    best = max(FIXED, key=lambda m: (mean[m][0], -mean[m][1]))
    return best, {m: round(acc, 4) for m, (acc, _) in mean.items()}


def run_question(
    item: calibrate.Labelled, corpus: brag.Corpus, fixed: brag.BRAG, controllers: dict[float, brag.BRAG]
) -> dict[str, Any]:
    """Every method on one question, and what the diagnostics need."""
    baseline, both, verdict = fixed_rows(item, corpus, fixed)
    r1_em = score(both["steps"][0]["observation"]["answer"], item.gold)[0]
    out: dict[str, Any] = {"rows": baseline, "evidence": evidence(item, both, verdict, r1_em), "brag": {}}
    for lam, controller in controllers.items():
        answer, report = controller.run(item.question, corpus)
        reads = [s["observation"].get("answer") for s in report["steps"] if s["action"] in ("R1", "R2")]
        right = any(a and brag.exact_match(a, item.gold) for a in reads)
        out["brag"][lam] = {
            "row": (*score(answer, item.gold), *cost(report["steps"])),
            "first": report["steps"][0]["action"] or "stop",
            "overruled": int(right and not brag.exact_match(answer, item.gold)),
            "totals": report["totals"],
        }
    return out


def tally(
    found: list[dict[str, Any]], best: str
) -> tuple[dict[str, list[Row]], dict[str, Any], dict[str, dict[str, int]], Counter[str], dict[str, int]]:
    """The per-question results summed: rows per method, timing, first actions, hops, overrulings."""
    rows: dict[str, list[Row]] = {}
    overhead: list[float] = []  # controller time / LLM time, per BRAG run that called the LLM
    local_s: list[float] = []  # retrieval, gate and controller time per BRAG run (no LLM)
    unknown = 0  # BRAG runs with a cached call whose latency was never recorded
    first_actions = {str(lam): dict.fromkeys(("R1", "CB", "stop"), 0) for lam in LAMBDAS}
    hops: Counter[str] = Counter()
    overruled = dict.fromkeys(map(str, LAMBDAS), 0)  # BRAG wrong though one of its own reads was right
    for question in found:  # in question order, whatever order they ran in
        for method, row in {**question["rows"], BEST_FIXED: question["rows"][best]}.items():
            rows.setdefault(method, []).append(row)
        hops.update(question["evidence"])
        for lam, run in question["brag"].items():
            rows.setdefault(f"BRAG λ={lam}", []).append(run["row"])
            first_actions[str(lam)][run["first"]] += 1
            overruled[str(lam)] += run["overruled"]
            totals = run["totals"]
            local_s.append(totals["wall_time_s"] - totals["llm_wait_s"])
            unknown += not totals["llm_seconds_known"]
            if totals["llm_seconds_known"] and totals["llm_seconds"] > 0:
                overhead.append(totals["policy_us"] / 1e6 / totals["llm_seconds"])
    timing = {"overhead": overhead, "local_s": local_s, "unknown_latency": unknown}
    return rows, timing, first_actions, hops, overruled


def run_dataset(
    ds: Dataset,
    root: Path,
    llm: brag.LLM,
    n: int | None,
    k: int,
    m: int,
    workers: int = 1,
    cost: str = brag.DEFAULT_COST_UNIT,
    corpus: brag.Retriever | None = None,
) -> dict[str, Any]:
    """One dataset's tables; ``corpus`` (a Milvus collection, say) in place of its corpus file."""
    everything = calibrate.read_labelled(root / ds.questions)
    size = n if n is not None else ds.test_size
    items = everything[ds.calibration_size :][:size]
    if corpus is None:
        corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
    cal = brag.shipped_calibration(brag.llm_name(llm), ds.name)
    fixed = brag.BRAG(llm, calibration=cal, lam=0.0, k=k, m=m, hops=3)
    calibration_items = everything[: ds.calibration_size]
    best, on_calibration = best_fixed_on_calibration(calibration_items, corpus, fixed, workers)
    controllers = {lam: brag.BRAG(llm, calibration=cal, lam=lam, k=k, m=m, cost=cost) for lam in LAMBDAS}
    started = time.perf_counter()

    def one(numbered: tuple[int, calibrate.Labelled]) -> dict[str, Any]:
        number, item = numbered
        print(
            f"{ds.name} {number}/{len(items)} {item.id} t={time.perf_counter() - started:.0f}s",
            file=sys.stderr,
        )
        return run_question(item, corpus, fixed, controllers)

    found = in_parallel(one, list(enumerate(items, 1)), workers)
    rows, timing, first_actions, hops, overruled = tally(found, best)
    rates = {action: round(rate, 4) for action, rate in cal.rates().items()}

    # A vote's likelihood ratio, right answer against one repeated wrong one, as the controller
    # uses it: floored at 1, so no vote counts against the answer it names.
    # Listed as the published tables always have: the reads' flat types, their evidence levels, then samples'.
    def listed(item: tuple[brag.VoteType, Any]) -> tuple[bool, bool]:
        vote_type = item[0]
        return brag.action_named(vote_type.action).kind.fit_shape == "samples", bool(vote_type.level)

    priors = sorted(cal.source_priors(m).items(), key=listed)
    ratios = {str(t): round(max(1.0, a / b / cal.eta), 3) for t, (a, b) in priors}
    return {
        "name": ds.name,
        "ids": [i.id for i in items],
        "rows": rows,
        "best_fixed": {"method": best, "calibration_accuracy": on_calibration},
        "calibration": {k: cal.meta.get(k) for k in ("name", "model", "corpus", "split", "hops")},
        "controller": {
            "rates": rates,
            "eta": round(cal.eta, 4),
            "vote_ratio": ratios,
            "first_actions": first_actions,
            "overruled": overruled,
        },
        "hops": dict(sorted(hops.items())),
        "timing": timing,
    }


def evidence(
    item: calibrate.Labelled, report: dict[str, Any], weak: bool | None, r1_em: float
) -> Counter[str]:
    """Counts about one R1-then-R2 run: follow-up queries, supporting passages found, the gate."""
    steps = [s for s in report["steps"] if s["action"]]
    r1 = steps[0]["observation"]
    out = Counter(questions=1, fallback_query=int(r1["follow_up_fallback"]), r1_correct=int(r1_em))
    r2 = steps[1]["observation"] if len(steps) > 1 else {}
    out["r2_read"] = int("passages" in r2)
    if weak is not None:
        out["gate_weak"] = int(weak)
        out["r1_correct_on_weak"] = int(weak and r1_em > 0)
    if not item.supporting:
        return out
    r1_titles = [p["title"] for p in r1["passages"]]
    r2_titles = [p["title"] for p in r2.get("passages", [])]
    r1_missing = calibrate.window_is_weak(r1_titles, item.supporting)
    out.update(labelled=1, r1_missing=int(r1_missing))
    out["r2_missing"] = int(calibrate.window_is_weak(r1_titles + r2_titles, item.supporting))
    if weak is not None:
        out["gate_weak_and_missing"] = int(weak and r1_missing)
    return out


def bootstrap_ci(a: np.ndarray, b: np.ndarray, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap 95 % CI of mean(a - b)."""
    rng = np.random.default_rng(seed)
    diff = a - b
    idx = rng.integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[idx].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def best_baseline(summary: dict[str, tuple[float, ...]]) -> str:
    """The most accurate baseline; fewer calls break ties."""
    return max(BASELINES, key=lambda b: (summary[b][0], -summary[b][2]))


def table(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    summary = summarise(result)
    best = best_baseline(summary)
    lines = [
        f"## {result['name']} ({len(result['ids'])} test questions)",
        "",
        "| method | Acc | F1 | LLM calls | tokens | LLM s / question | Δ Acc vs best baseline (95 % CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, (acc, f1, calls, tokens, seconds) in summary.items():
        ci = ""
        if method.startswith("BRAG"):
            a = np.array([r[0] for r in rows[method]])
            b = np.array([r[0] for r in rows[best]])
            low, high = bootstrap_ci(a, b)
            ci = f"{acc - summary[best][0]:+.3f} ({low:+.3f}, {high:+.3f})"
        lines.append(
            f"| {method} | {acc:.3f} | {f1:.3f} | {calls:.2f} | {tokens:.0f} | {seconds:.2f} | {ci} |"
        )
    chosen = result["best_fixed"]
    on_calibration = ", ".join(f"{m} {a:.3f}" for m, a in chosen["calibration_accuracy"].items())
    lines += [
        "",
        f"Best baseline: {best}. {BEST_FIXED}: {chosen['method']} (calibration-split accuracy: "
        f"{on_calibration}). Calibration: `{result['calibration']['name']}`.",
        "",
        f"Test ids: {', '.join(result['ids'])}.",
        "",
    ]
    return lines


def summarise(result: dict[str, Any]) -> dict[str, tuple[float, ...]]:
    """Per method: mean (accuracy, F1, LLM calls, tokens, LLM seconds)."""
    return {m: tuple(float(np.mean([r[i] for r in v])) for i in range(5)) for m, v in result["rows"].items()}


def verdict(result: dict[str, Any]) -> str:
    """The two targets, in words.

    Some lambda at or above the best baseline's accuracy with no more calls; and the default
    lambda not significantly below the best baseline.
    """
    summary = summarise(result)
    best = best_baseline(summary)
    acc, calls = summary[best][0], summary[best][2]
    where = f"{best} ({acc:.3f} at {calls:.2f} calls)"
    if acc == 0:
        return f"Not comparable: no baseline answers a question correctly; the best is {where}."
    wins = [
        lam for lam in LAMBDAS if summary[f"BRAG λ={lam}"][0] >= acc and summary[f"BRAG λ={lam}"][2] <= calls
    ]
    if wins:
        first = f"Target met: BRAG at {', '.join(f'λ={lam}' for lam in wins)} is at or above {where}."
    else:
        top = max(LAMBDAS, key=lambda lam: (summary[f"BRAG λ={lam}"][0], -summary[f"BRAG λ={lam}"][2]))
        s = summary[f"BRAG λ={top}"]
        short = "more calls" if s[0] >= acc else "lower accuracy"
        first = (
            f"Target not met: BRAG's best is {s[0]:.3f} at {s[2]:.2f} calls (λ={top}), {short} than {where}."
        )
    rows = result["rows"]
    a = np.array([r[0] for r in rows[f"BRAG λ={DEFAULT_LAMBDA}"]])
    b = np.array([r[0] for r in rows[best]])
    low, high = bootstrap_ci(a, b)
    second = "met" if high >= 0 else "not met"
    return (
        f"{first} Default λ={DEFAULT_LAMBDA} {second}: Δ Acc {a.mean() - b.mean():+.3f} "
        f"(95 % CI {low:+.3f}, {high:+.3f}) against {best}."
    )


def controller(view: dict[str, Any]) -> list[str]:
    """What the controller saw: the calibration's information rates and its first choices."""
    rates = ", ".join(f"{action} {rate:.4f}" for action, rate in view["rates"].items())
    firsts = "; ".join(
        f"λ={lam}: " + ", ".join(f"{a} {n}" for a, n in counts.items() if n)
        for lam, counts in view["first_actions"].items()
    )
    ratios = ", ".join(f"{t} {r:.2f}" for t, r in view["vote_ratio"].items())
    overruled = ", ".join(f"λ={lam}: {n}" for lam, n in view["overruled"].items())
    return [
        f"Information rates D per call from the calibration (η = {view['eta']}): {rates}.",
        f"Vote likelihood ratio ρ / ((1 − ρ) η) per source (below 1, a vote counts against the answer "
        f"it names): {ratios}.",
        f"BRAG's first action per question: {firsts}.",
        f"BRAG answered wrong although one of its own R1/R2 reads was right: {overruled}.",
        "",
    ]


def hop_lines(h: dict[str, int]) -> list[str]:
    """The R1-then-R2 runs in words: follow-up queries, supporting passages found, the gate."""
    n = h["questions"]
    lines = [
        f"Follow-up queries: the model wrote a usable one for {n - h['fallback_query']} of {n} questions "
        f"(the rest used the non-LLM expansion); R2 read new passages for {h['r2_read']} of {n}.",
    ]
    if h.get("labelled"):
        lines.append(
            f"Supporting passages (by title, {h['labelled']} questions): the R1 window missed one for "
            f"{h['r1_missing']}; R1 + R2 together still missed one for {h['r2_missing']}."
        )
    if "gate_weak" in h:
        weak, strong = h["gate_weak"], n - h["gate_weak"]
        right_strong = h["r1_correct"] - h["r1_correct_on_weak"]
        line = (
            f"Gate: called {weak} of {n} R1 windows weak; R1 was right on {h['r1_correct_on_weak']}/{weak} "
            f"weak and {right_strong}/{strong} strong windows"
        )
        if h.get("labelled"):
            line += f"; {h.get('gate_weak_and_missing', 0)} of its weak calls missed a supporting passage"
        lines.append(line + ".")
    return [*lines, ""]


def timing(timing: dict[str, Any]) -> list[str]:
    """Controller overhead against LLM time, and the time spent outside the LLM."""
    lines = []
    if timing["overhead"]:
        o = np.array(timing["overhead"])
        lines.append(
            f"Controller time / LLM time per BRAG run (LLM time as measured when each call was made): "
            f"median {np.median(o):.2e}, max {o.max():.2e}, over {len(o)} runs."
        )
    if timing["local_s"]:
        lines.append(
            f"Retrieval + gate + controller time per BRAG run (this run): median "
            f"{1000 * np.median(timing['local_s']):.1f} ms."
        )
    if timing["unknown_latency"]:
        lines.append(f"{timing['unknown_latency']} BRAG runs used a cached call with no recorded latency.")
    return [*lines, ""] if lines else []


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against LLM calls (top row) and against LLM seconds (bottom row) per question."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_by = (("LLM calls per question", 2), ("LLM seconds per question", 4))  # row columns
    fig, axes = plt.subplots(len(axes_by), len(results), figsize=(5 * len(results), 8), squeeze=False)
    for row_axes, (label, column) in zip(axes, axes_by, strict=True):
        for ax, result in zip(row_axes, results, strict=True):
            _plot_one(ax, result, label, column)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_one(ax: Any, result: dict[str, Any], xlabel: str, column: int) -> None:
    rows = result["rows"]
    mean = {k: (np.mean([r[column] for r in v]), np.mean([r[0] for r in v])) for k, v in rows.items()}
    for baseline, (marker, size, color) in MARKERS.items():
        ax.scatter(
            *mean[baseline], marker=marker, s=size, facecolors="none", edgecolors=color, label=baseline
        )
    curve = [mean[f"BRAG λ={lam}"] for lam in LAMBDAS]
    ax.plot([c[0] for c in curve], [c[1] for c in curve], "k-", marker=".", label="BRAG (λ sweep)")
    labels: dict[tuple[float, float], list[str]] = {}
    for lam, point in zip(LAMBDAS, curve, strict=True):
        labels.setdefault(point, []).append(str(lam))
    for i, (point, lams) in enumerate(labels.items()):  # alternate below / above: neighbours crowd
        offset = (4, -10 if i % 2 == 0 else 5)
        ax.annotate("λ=" + ", ".join(lams), point, fontsize=7, xytext=offset, textcoords="offset points")
    ax.margins(0.15)
    ax.set_title(result["name"])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (EM)")


def split_sizes(values: list[str]) -> dict[str, int]:
    """``--n 100`` sets every dataset's test size, ``--n musique=80`` one; later values win."""
    sizes: dict[str, int] = {}
    for value in values:
        key, _, count = value.rpartition("=")
        if key and key not in DATASETS:
            raise ValueError(f"--n {value}: no dataset {key!r} (one of {', '.join(DATASETS)})")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--n {value}: the size must be a whole number of at least 1")
        sizes.update(dict.fromkeys([key] if key else DATASETS, int(count)))
    return sizes


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local", help="any make_llm spec")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument(
        "--n",
        nargs="+",
        default=[],
        metavar="N|DATASET=N",
        help="test questions per dataset (default: 200, MuSiQue all left); musique=80 sets one",
    )
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument(
        "--cost", default=brag.DEFAULT_COST_UNIT, choices=brag.COST_UNITS, help="how BRAG prices an action"
    )
    parser.add_argument("--workers", type=int, default=1, help="questions at once (for an endpoint)")
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "llm.sqlite"))
    parser.add_argument("--replay", action="store_true", help="no LLM: every response from the cache")
    parser.add_argument(
        "--retime",
        action="store_true",
        help="re-issue cached calls with no stored latency, once, to time them",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--data", type=Path, default=None, help="data directory (default BRAG_DATA_DIR)")
    milvus_corpus.add_arguments(parser)
    return parser


def write_results(args: argparse.Namespace, model: str, results: list[dict[str, Any]], milvus: bool) -> None:
    """The tables, the timing, the plot and the JSON, each where ``--out`` says."""
    given = f" --n {' '.join(args.n)}" if args.n else ""
    command = f"python bench/run.py --model {args.model}{given} --datasets {' '.join(args.datasets)}"
    if milvus:
        command += f" --milvus {args.milvus} --collection {args.collection}"
    lines = [
        "# Benchmark: BRAG against the baselines",
        "",
        f"Command: `{command}` (add `--replay` to reproduce every number from the cache with no LLM).",
        f"Model: `{model}`. Cache: `{Path(args.cache).name}`, k = {args.k}, m = {args.m}.",
        "",
    ]
    for result in results:
        lines += table(result) + controller(result["controller"]) + hop_lines(result["hops"])
        lines += [verdict(result), ""]
    (args.out / "benchmark.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # Controller and retrieval time are measured afresh on every run, so they live apart from
    # the tables, which a replay reproduces byte for byte.
    timed = [f"# Time outside the LLM, as measured by `{command}{' --replay' if args.replay else ''}`", ""]
    for result in results:
        timed += [f"## {result['name']}", "", *timing(result["timing"])]
    (args.out / "benchmark_timing.md").write_text("\n".join(timed) + "\n", encoding="utf-8")
    plot(results, args.out / "benchmark.png")
    (args.out / "benchmark.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "timing"} for r in results]), encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    try:
        sizes = split_sizes(args.n)
        if (args.milvus or args.collection) and len(args.datasets) != 1:
            raise ValueError("--milvus serves one dataset's corpus: name it with --datasets")
        served = milvus_corpus.from_arguments(args)
    except ValueError as err:
        parser.error(str(err))
    root = args.data or storage.data_dir()
    if root is None:
        print("run: set BRAG_DATA_DIR to the shared evaluation data", file=sys.stderr)
        return 2
    mode = "replay" if args.replay else "retime" if args.retime else "read-write"
    llm = llms.CachedLLM(llms.make_llm(args.model), args.cache, mode=mode)  # keyed by the backend's name
    results = []
    for key in args.datasets:
        try:
            result = run_dataset(
                DATASETS[key], root, llm, sizes.get(key), args.k, args.m, args.workers, args.cost, served
            )
        except (brag.RunAborted, llms.LLMError) as err:
            print(f"run: {DATASETS[key].name}: {err}", file=sys.stderr)
            return 2
        results.append(result)
        text = "\n".join(table(result))
        (args.out / f"benchmark_{key}.md").write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)
    write_results(args, llm.name, results, served is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
