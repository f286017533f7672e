"""BRAG against four baselines on HotpotQA, 2WikiMultihopQA and MuSiQue, reproducible by replay.

Every method uses the same LLM, prompts, k and m, through one response cache, so each distinct
LLM request is made once across methods; ``--replay`` recomputes every number from the cache
with no LLM. Test questions come after each dataset's calibration split (see ``DATASETS``).

    python bench/run.py --model local --n 100                # fills bench/cache/llm.sqlite
    python bench/run.py --model local --n 100 --replay       # the same tables, no LLM

Methods: closed-book (CB, one call), vanilla RAG (R1), IRCoT / self-ask style (R1 then R2),
adaptive / CRAG style (R2 only when R1 says NONE or the gate calls R1's window weak), and BRAG
at each lambda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import brag  # noqa: E402
import calibrate  # noqa: E402
import llms  # noqa: E402

LAMBDAS = (0.01, 0.02, 0.05, 0.1, 0.2)
BASELINES = ("Closed-book", "Vanilla RAG", "IRCoT / self-ask", "Adaptive / CRAG")
# Hollow markers of falling size, so baselines that land on the same point stay visible.
MARKERS = {
    "Closed-book": ("o", 150, "C0"),
    "Vanilla RAG": ("s", 100, "C1"),
    "IRCoT / self-ask": ("^", 70, "C2"),
    "Adaptive / CRAG": ("D", 35, "C3"),
}


@dataclass(frozen=True)
class Dataset:
    """A question file, its corpus, where its test split starts, and its calibration."""

    name: str
    questions: str
    corpus: str
    test_start: int  # the calibration split is [0, test_start)
    calibration: str


DATASETS = {
    "hotpotqa": Dataset(
        "HotpotQA",
        "hotpotqa/hotpotqa_ircot500.json",
        "hotpotqa/hotpotqa_ircot500_corpus.json",
        60,
        "calibration.json",
    ),
    "2wiki": Dataset(
        "2WikiMultihopQA",
        "2wikimultihopqa/2wikimultihopqa.json",
        "2wikimultihopqa/2wikimultihopqa_corpus.json",
        40,
        "calibration_2wikimultihopqa.json",
    ),
    "musique": Dataset(
        "MuSiQue",
        "musique/musique_migres200.json",
        "musique/musique_migres200_corpus.json",
        40,
        "calibration_musique.json",
    ),
}


def score(answer: str, gold: tuple[str, ...]) -> tuple[float, float]:
    """(exact match with any gold, best token F1)."""
    em = float(brag.exact_match(answer, gold))
    return em, max(brag.token_f1(answer, g) for g in gold) if answer else 0.0


def cost(steps: list[dict[str, Any]], upto: int | None = None) -> tuple[int, int, float]:
    """(LLM calls, tokens, LLM seconds as measured when made) of a report's first ``upto`` actions."""
    acted = [s for s in steps if s["action"]][:upto]
    calls = sum(s["cost"]["llm_calls"] for s in acted)
    tokens = sum(s["cost"]["prompt_tokens"] + s["cost"]["completion_tokens"] for s in acted)
    return calls, tokens, round(sum(s["cost"]["llm_seconds"] for s in acted), 6)


def run_dataset(ds: Dataset, root: Path, llm: brag.LLM, n: int, k: int, m: int) -> dict[str, Any]:
    items = calibrate.read_labelled(root / ds.questions)[ds.test_start : ds.test_start + n]
    corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
    cal = brag.load_calibration(ROOT / "data" / ds.calibration)
    rows: dict[str, list[tuple[float, float, int, int, float]]] = {}
    overhead: list[float] = []  # controller time / LLM time, per BRAG run that called the LLM
    local_s: list[float] = []  # retrieval, gate and controller time per BRAG run (no LLM)
    unknown = 0  # BRAG runs with a cached call whose latency was never recorded
    first_actions = {str(lam): dict.fromkeys(("R1", "CB", "stop"), 0) for lam in LAMBDAS}
    hops: Counter[str] = Counter()
    overruled = dict.fromkeys(map(str, LAMBDAS), 0)  # BRAG wrong though one of its own reads was right
    started = time.perf_counter()
    for number, item in enumerate(items, 1):
        print(
            f"{ds.name} {number}/{len(items)} {item.id} t={time.perf_counter() - started:.0f}s",
            file=sys.stderr,
        )
        fixed = brag.BRAG(llm, calibration=cal, lam=0.0, k=k, m=m)
        answer, report = fixed.run(item.question, corpus, actions=["CB"])
        rows.setdefault("Closed-book", []).append((*score(answer, item.gold), *cost(report["steps"])))
        _, report = fixed.run(item.question, corpus, actions=["R1", "R2"])
        r1 = report["steps"][0]["observation"]
        r1_answer = r1["answer"]
        rows.setdefault("Vanilla RAG", []).append((*score(r1_answer, item.gold), *cost(report["steps"], 1)))
        both = report["answer"]
        rows.setdefault("IRCoT / self-ask", []).append((*score(both, item.gold), *cost(report["steps"])))
        verdict = (report["gate"].get("R1") or {}).get("weak")  # None without a calibrated gate
        hops.update(evidence(item, report, verdict, score(r1_answer, item.gold)[0]))
        hop = not r1_answer or verdict is True
        adaptive = (both, cost(report["steps"])) if hop else (r1_answer, cost(report["steps"], 1))
        rows.setdefault("Adaptive / CRAG", []).append((*score(adaptive[0], item.gold), *adaptive[1]))
        for lam in LAMBDAS:
            answer, report = brag.BRAG(llm, calibration=cal, lam=lam, k=k, m=m).run(item.question, corpus)
            rows.setdefault(f"BRAG λ={lam}", []).append((*score(answer, item.gold), *cost(report["steps"])))
            first_actions[str(lam)][report["steps"][0]["action"] or "stop"] += 1
            reads = [s["observation"].get("answer") for s in report["steps"] if s["action"] in ("R1", "R2")]
            right = any(a and brag.exact_match(a, item.gold) for a in reads)
            overruled[str(lam)] += int(right and not brag.exact_match(answer, item.gold))
            totals = report["totals"]
            local_s.append(totals["wall_time_s"] - totals["llm_wait_s"])
            unknown += not totals["llm_seconds_known"]
            if totals["llm_seconds_known"] and totals["llm_seconds"] > 0:
                overhead.append(totals["policy_us"] / 1e6 / totals["llm_seconds"])
    timing = {"overhead": overhead, "local_s": local_s, "unknown_latency": unknown}
    rates = {action: round(rate, 4) for action, rate in cal.rates().items()}
    # A vote's likelihood ratio, right answer against one repeated wrong one: below 1, a vote
    # counts against the answer it names.
    ratios = {t: round(a / b / cal.eta, 3) for t, (a, b) in cal.source_priors(m).items()}
    return {
        "name": ds.name,
        "ids": [i.id for i in items],
        "rows": rows,
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
        "| method | Acc | F1 | LLM calls | tokens | LLM time (s) | Δ Acc vs best baseline (95 % CI) |",
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
    lines += ["", f"Best baseline: {best}. Test ids: {', '.join(result['ids'])}.", ""]
    return lines


def summarise(result: dict[str, Any]) -> dict[str, tuple[float, ...]]:
    """Per method: mean (accuracy, F1, LLM calls, tokens, LLM seconds)."""
    return {m: tuple(float(np.mean([r[i] for r in v])) for i in range(5)) for m, v in result["rows"].items()}


def verdict(result: dict[str, Any]) -> str:
    """Whether some lambda matches the best baseline with fewer calls or beats it at no more calls."""
    summary = summarise(result)
    best = best_baseline(summary)
    acc, calls = summary[best][0], summary[best][2]
    where = f"{best} ({acc:.3f} at {calls:.2f} calls)"
    if acc == 0:
        return f"Not comparable: no baseline answers a question correctly; the best is {where}."

    def on_or_above(point: tuple[float, ...]) -> bool:
        return (point[0] >= acc and point[2] < calls) or (point[0] > acc and point[2] <= calls)

    wins = [lam for lam in LAMBDAS if on_or_above(summary[f"BRAG λ={lam}"])]
    if wins:
        return f"Target met: BRAG at {', '.join(f'λ={lam}' for lam in wins)} is on or above {where}."
    top = max(LAMBDAS, key=lambda lam: (summary[f"BRAG λ={lam}"][0], -summary[f"BRAG λ={lam}"][2]))
    s = summary[f"BRAG λ={top}"]
    return f"Target not met: BRAG's best is {s[0]:.3f} at {s[2]:.2f} calls (λ={top}), below {where}."


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        rows = result["rows"]
        mean = {k: (np.mean([r[2] for r in v]), np.mean([r[0] for r in v])) for k, v in rows.items()}
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
        ax.set_xlabel("LLM calls per question")
        ax.set_ylabel("accuracy (EM)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local", help="any make_llm spec")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--n", type=int, default=100, help="test questions per dataset")
    parser.add_argument("--k", type=int, default=5)
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
    args = parser.parse_args(argv)
    root = args.data or brag.data_dir()
    if root is None:
        print("run: set BRAG_DATA_DIR to the shared evaluation data", file=sys.stderr)
        return 2
    mode = "replay" if args.replay else "retime" if args.retime else "read-write"
    llm = llms.CachedLLM(llms.make_llm(args.model), args.cache, model=args.model, mode=mode)
    results = []
    for key in args.datasets:
        try:
            result = run_dataset(DATASETS[key], root, llm, args.n, args.k, args.m)
        except (brag.RunAborted, llms.LLMError) as err:
            print(f"run: {DATASETS[key].name}: {err}", file=sys.stderr)
            return 2
        results.append(result)
        text = "\n".join(table(result))
        (args.out / f"benchmark_{key}.md").write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)
    command = f"python bench/run.py --model {args.model} --n {args.n} --datasets {' '.join(args.datasets)}"
    lines = [
        "# Benchmark: BRAG against the baselines",
        "",
        f"Command: `{command}` (add `--replay` to reproduce every number from the cache with no LLM).",
        f"Cache: `{Path(args.cache).name}`, k = {args.k}, m = {args.m}.",
        "",
    ]
    for result in results:
        lines += table(result) + controller(result["controller"]) + hop_lines(result["hops"])
        lines += timing(result["timing"])
        lines += [verdict(result), ""]
    (args.out / "benchmark.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(results, args.out / "benchmark.png")
    (args.out / "benchmark.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "timing"} for r in results]), encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
