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


def cost(steps: list[dict[str, Any]], upto: int | None = None) -> tuple[int, int]:
    """(LLM calls, tokens) of the first ``upto`` actions of a report."""
    acted = [s for s in steps if s["action"]][:upto]
    calls = sum(s["cost"]["llm_calls"] for s in acted)
    tokens = sum(s["cost"]["prompt_tokens"] + s["cost"]["completion_tokens"] for s in acted)
    return calls, tokens


def run_dataset(ds: Dataset, root: Path, llm: brag.LLM, n: int, k: int, m: int) -> dict[str, Any]:
    items = calibrate.read_labelled(root / ds.questions)[ds.test_start : ds.test_start + n]
    corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
    cal = brag.load_calibration(ROOT / "data" / ds.calibration)
    rows: dict[str, list[tuple[float, float, int, int]]] = {}
    overhead = []
    for item in items:
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
        hop = not r1_answer or verdict is True
        adaptive = (both, cost(report["steps"])) if hop else (r1_answer, cost(report["steps"], 1))
        rows.setdefault("Adaptive / CRAG", []).append((*score(adaptive[0], item.gold), *adaptive[1]))
        for lam in LAMBDAS:
            answer, report = brag.BRAG(llm, calibration=cal, lam=lam, k=k, m=m).run(item.question, corpus)
            rows.setdefault(f"BRAG λ={lam}", []).append((*score(answer, item.gold), *cost(report["steps"])))
            if report["totals"]["wall_time_s"] > 0:
                overhead.append(report["totals"]["policy_us"] / 1e6 / report["totals"]["wall_time_s"])
    return {"name": ds.name, "ids": [i.id for i in items], "rows": rows, "overhead": overhead}


def bootstrap_ci(a: np.ndarray, b: np.ndarray, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap 95 % CI of mean(a - b)."""
    rng = np.random.default_rng(seed)
    diff = a - b
    idx = rng.integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[idx].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def table(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    summary = {
        method: tuple(np.mean([r[i] for r in values]) for i in range(4)) for method, values in rows.items()
    }
    best = max(BASELINES, key=lambda b: (summary[b][0], -summary[b][2]))
    lines = [
        f"## {result['name']} ({len(result['ids'])} test questions)",
        "",
        "| method | Acc | F1 | LLM calls | tokens | Δ Acc vs best baseline (95 % CI) |",
        "|---|---|---|---|---|---|",
    ]
    for method, (acc, f1, calls, tokens) in summary.items():
        ci = ""
        if method.startswith("BRAG"):
            a = np.array([r[0] for r in rows[method]])
            b = np.array([r[0] for r in rows[best]])
            low, high = bootstrap_ci(a, b)
            ci = f"{acc - summary[best][0]:+.3f} ({low:+.3f}, {high:+.3f})"
        lines.append(f"| {method} | {acc:.3f} | {f1:.3f} | {calls:.2f} | {tokens:.0f} | {ci} |")
    lines += ["", f"Best baseline: {best}. Test ids: {', '.join(result['ids'])}.", ""]
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        rows = result["rows"]
        mean = {k: (np.mean([r[2] for r in v]), np.mean([r[0] for r in v])) for k, v in rows.items()}
        for baseline in BASELINES:
            ax.scatter(*mean[baseline], label=baseline)
        curve = [mean[f"BRAG λ={lam}"] for lam in LAMBDAS]
        ax.plot([c[0] for c in curve], [c[1] for c in curve], "k-o", label="BRAG (λ sweep)")
        for lam, (x, y) in zip(LAMBDAS, curve, strict=True):
            ax.annotate(f"λ={lam}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
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
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--data", type=Path, default=None, help="data directory (default BRAG_DATA_DIR)")
    args = parser.parse_args(argv)
    root = args.data or brag.data_dir()
    if root is None:
        print("run: set BRAG_DATA_DIR to the shared evaluation data", file=sys.stderr)
        return 2
    mode = "replay" if args.replay else "read-write"
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
        lines += table(result)
        if result["overhead"]:
            lines.append(
                f"Controller time / run time, median over BRAG runs: {np.median(result['overhead']):.2e}."
            )
            lines.append("")
    (args.out / "benchmark.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(results, args.out / "benchmark.png")
    (args.out / "benchmark.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "overhead"} for r in results]), encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
