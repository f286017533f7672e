r"""How well P(correct) tells right answers from wrong ones, by replay of the benchmark cache.

For each dataset's test split (the questions after its calibration split, as in bench/run.py),
BRAG runs at the default λ under each calibration in ``--fits`` and each answer's P(correct)
is scored against exact match: AUROC, ECE (10 equal-width bins), Brier, and how many distinct
values P takes.

    python bench/confidence.py --replay                      # every fit, no LLM
    python bench/confidence.py --replay --fits own --out F   # what the code before issue 33 can run
    python bench/confidence.py --documents bashref.pdf bench/docs/bashref_questions.json \\
        --out bench/results/confidence_documents.json          # a real manual, through the app

Fits: ``own`` the dataset's own shipped fit; ``pooled`` the model's pooled fit; ``loo`` a pooled
fit of the other two datasets' calibration outcomes (leave one dataset out); ``default`` what
``brag.shipped_calibration`` picks for the dataset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # app_server: a real app on a loopback port

from run import DATASETS, DEFAULT_LAMBDA

import brag
import calibrate
from bragkit import (
    llms,
    storage,
)

FITS = ("own", "pooled", "loo", "default")
MODEL_PREFIX = "qwen2.5-coder-0.5b"  # the shipped fits' file names: PREFIX-dataset.json


def ece(p: np.ndarray, right: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error: the mean |accuracy - confidence| over equal-width bins of P."""
    which = np.minimum((p * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.sum() * abs(right[inside].mean() - p[inside].mean())
    return total / len(p)


def scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, mean P, AUROC, ECE, Brier, distinct P values, the guesses, and calls."""
    p = np.array([r["p"] for r in rows])
    right = np.array([r["right"] for r in rows], dtype=float)
    guess = np.array([r["guess"] for r in rows])
    both = 0 < right.sum() < len(right)
    return {
        "n": len(rows),
        "accuracy": round(float(right.mean()), 4),
        "mean_p": round(float(p.mean()), 4),
        "auroc": round(calibrate.auc(p, right > 0), 4) if both else None,
        "ece": round(float(ece(p, right)), 4),
        "brier": round(float(np.mean((p - right) ** 2)), 4),
        "distinct_p": len({round(x, 4) for x in p}),
        "guesses": int(guess.sum()),
        "guess_right": round(float(right[guess].mean()), 4) if guess.any() else None,
        "sure_right": round(float(right[~guess].mean()), 4) if (~guess).any() else None,
        "calls": round(float(np.mean([r["calls"] for r in rows])), 3),
    }


def fit_for(kind: str, key: str, llm_name: str) -> brag.Calibration:
    """The calibration of one kind for one dataset."""
    name = DATASETS[key].name
    shipped = brag.shipped_calibrations()
    if kind == "own":
        return next(
            c for c in shipped.values() if c.meta.get("corpus") == name and c.meta.get("model") == llm_name
        )
    if kind == "pooled":
        return next(c for c in shipped.values() if c.meta.get("corpus") == brag.POOLED)
    if kind == "default":
        return brag.shipped_calibration(llm_name, name, shipped)
    others = [(fit, outcomes) for fit, outcomes in shipped_sets() if fit.get("corpus") != name]
    return brag.load_calibration(calibrate.pool(others, meta={"name": f"pooled without {name}"}))


def shipped_sets() -> list[tuple[dict[str, Any], list[calibrate.Outcome]]]:
    """Each dataset's shipped fit of the embedded model, with the outcomes it was fitted on."""
    paths = sorted(brag.CALIBRATIONS_DIR.glob(f"{MODEL_PREFIX}-*.json"))
    benchmarks = [p for p in paths if p.stem not in (f"{MODEL_PREFIX}-pooled", f"{MODEL_PREFIX}-documents")]
    return [(brag.read_json(path, "calibration"), calibrate.read_outcomes(path)) for path in benchmarks]


def answered(item: calibrate.Labelled, answer: str, report: dict[str, Any]) -> dict[str, Any]:
    """One run's row: P(correct), right or not, the guess label, calls."""
    return {
        "id": item.id,
        "p": report["confidence"]["p_correct"],
        "right": bool(answer) and brag.exact_match(answer, item.gold),
        "guess": report["confidence"]["guess"],
        "calls": report["totals"]["llm_calls"],
    }


def run(key: str, llm: brag.LLM, calibration: brag.Calibration, root: Path) -> list[dict[str, Any]]:
    """BRAG at the default λ on one dataset's test split: P(correct), right or not, calls."""
    ds = DATASETS[key]
    items = calibrate.read_labelled(root / ds.questions)[ds.calibration_size :][: ds.test_size]
    corpus = brag.Corpus((root / ds.corpus).read_text(encoding="utf-8"))
    controller = brag.BRAG(llm, calibration=calibration, lam=DEFAULT_LAMBDA)
    return [answered(item, *controller.run(item.question, corpus)) for item in items]


def ask_the_app(pdf: Path, questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each question through /brag of a real app on the embedded model, the PDF uploaded each time."""
    from app_server import AppProcess
    from gradio_client import Client, handle_file

    rows = []
    with AppProcess({"BRAG_MODEL": "local", "HF_TOKEN": ""}, startup_timeout=300) as app:
        client = Client(app.url, verbose=False)
        for number, item in enumerate(questions, 1):
            inputs = [item["question"], "", "", DEFAULT_LAMBDA, "", "", "auto", "", "tokens", None, None]
            answer, report = client.predict(*inputs, [handle_file(str(pdf))], api_name="/brag")
            steps = [s for s in report["steps"] if s["action"]]
            first = steps[0]["observation"] if steps else {}
            rows.append(
                {
                    "id": item["id"],
                    "answer": answer,
                    "p": report["confidence"]["p_correct"],
                    "right": bool(answer) and brag.exact_match(answer, item["answer"]),
                    "guess": report["confidence"]["guess"],
                    "calls": report["totals"]["llm_calls"],
                    "actions": [s["action"] for s in steps],
                    "first_right": bool(first.get("answer"))
                    and brag.exact_match(first["answer"], item["answer"]),
                    "first_evidence": first.get("evidence"),
                    "first_vote": first.get("vote_type"),
                    "source": (report["confidence"].get("source") or {}).get("passage"),
                    "calibration": report["config"]["calibration"]["status"],
                }
            )
            print(number, rows[-1], file=sys.stderr, flush=True)
    return rows


def documents_fits(pdf: Path, questions: list[dict[str, Any]], cache: str, folds: int = 6) -> dict[str, Any]:
    """What a user who labels these questions gets: their own fit, by cross-validation.

    Every action runs on every question as ``calibrate.py`` runs them (through the cache); then
    in each fold a fit of the other questions' outcomes (alone: ``own``; with the three
    datasets' calibration outcomes: ``pooled with own``) prices BRAG on the held-out ones.
    """
    from bragkit import documents

    corpus = brag.Corpus(documents.read_file(pdf.name, pdf.read_bytes()))
    items = [calibrate.Labelled(q["id"], q["question"], tuple(q["answer"])) for q in questions]
    llm = llms.CachedLLM(llms.make_llm("local"), cache)
    progress = Path(cache).with_name(f"{pdf.stem}.progress.jsonl")
    fitted = calibrate.calibrate(items, corpus, llm, hops=brag.DEFAULT_HOPS, progress_path=progress)
    outcomes = list(calibrate.read_progress(progress, None).values())
    progress.unlink()
    datasets = calibrate.without_gate([o for _, found in shipped_sets() for o in found])
    m, hops = fitted["m"], fitted["hops"]
    rows: dict[str, list[dict[str, Any]]] = {"own": [], "pooled with own": []}
    for fold in range(folds):
        train = [o for i, o in enumerate(outcomes) if i % folds != fold]
        held_out = [item for i, item in enumerate(items) if i % folds == fold]
        for kind, together in (("own", train), ("pooled with own", datasets + train)):
            calibration = calibrate._loaded({**calibrate.fit(together, m, hops), "gate": None}, m)
            controller = brag.BRAG(llm, calibration=calibration, lam=DEFAULT_LAMBDA)
            levels = getattr(calibration.actions["R1"].evidence, "name", "none")
            for item in held_out:
                row = answered(item, *controller.run(item.question, corpus))
                rows[kind].append({**row, "r1_levels": levels})
    return {kind: {**scores(found), "rows": found} for kind, found in rows.items()}


def documents_scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The dataset scores, and how often a second call followed a wrong or a right first read."""
    wrong_first = [r for r in rows if not r["first_right"]]
    right_first = [r for r in rows if r["first_right"]]
    return {
        **scores(rows),
        "second_call_after_wrong_first": [sum(r["calls"] > 1 for r in wrong_first), len(wrong_first)],
        "second_call_after_right_first": [sum(r["calls"] > 1 for r in right_first), len(right_first)],
    }


TARGET_AUROC, TARGET_ECE, TARGET_DISTINCT = 0.75, 0.10, 10
COLUMNS = ("accuracy", "mean_p", "auroc", "ece", "brier", "distinct_p", "guess_right", "sure_right", "calls")


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _row(label: str, result: dict[str, Any]) -> str:
    guesses = f"{result['guesses']}/{result['n']}"
    cells = [_cell(result[c]) for c in COLUMNS]
    return f"| {label} | {' | '.join(cells[:6])} | {guesses} | {' | '.join(cells[6:])} |"


HEADER = [
    "| | accuracy | mean P | AUROC | ECE | Brier | distinct P | guesses | right when a guess "
    "| right otherwise | calls |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def report(results: Path, before: Path, documents: Path | None) -> list[str]:
    """confidence.md: before and after per dataset, every fit, the documents set, the targets."""
    after, old = json.loads(results.read_text()), json.loads(before.read_text())
    lines = ["## Per dataset: the code before issue 33 and now (test splits, λ = 0.05)", "", *HEADER]
    for key in DATASETS:
        if key in old.get("own", {}) and key in after.get("default", {}):
            lines.append(
                _row(f"{DATASETS[key].name}, before ({old['own'][key]['calibration']})", old["own"][key])
            )
            new = after["default"][key]
            lines.append(_row(f"{DATASETS[key].name}, now ({new['calibration']})", new))
    lines += ["", "## Every fit, now", "", *HEADER]
    for kind in FITS:
        for key, result in after.get(kind, {}).items():
            lines.append(_row(f"{DATASETS[key].name}: {kind} ({result['calibration']})", result))
    if documents is not None and documents.exists():
        docs = json.loads(documents.read_text())
        wrong, right = docs["second_call_after_wrong_first"], docs["second_call_after_right_first"]
        lines += [
            "",
            f"## A real manual through /brag: {docs['document']}, {docs['n']} questions "
            f"({docs['questions']})",
            "",
            *HEADER,
            _row("documents set", docs),
            "",
            f"Second call after a wrong first read: {wrong[0]} of {wrong[1]}; after a right one: "
            f"{right[0]} of {right[1]}. Calibration used: {docs['rows'][0]['calibration']}.",
        ]
    return lines


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", default=",".join(FITS))
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--replay", action="store_true", help="no LLM: every response from the cache")
    parser.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "llm.sqlite"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "confidence.json")
    for flag, does in (
        ("--documents", "ask QUESTIONS (JSON: id, question, answer) about PDF through a real app's /brag"),
        (
            "--documents-fits",
            "fit on the labelled QUESTIONS about PDF and score the fits by cross-validation",
        ),
    ):
        parser.add_argument(flag, nargs=2, type=Path, metavar=("PDF", "QUESTIONS"), help=f"instead: {does}")
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="instead: print confidence.md's tables from RESULTS BEFORE [DOCUMENTS] JSON files",
    )
    return parser


def main() -> int:
    parser = arguments()
    args = parser.parse_args()
    if args.documents_fits:
        pdf, questions = args.documents_fits
        result = documents_fits(pdf, json.loads(questions.read_text(encoding="utf-8")), args.cache)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print({kind: {k: v for k, v in r.items() if k != "rows"} for kind, r in result.items()})
        return 0
    if args.report:
        print(
            "\n".join(
                report(args.report[0], args.report[1], args.report[2] if len(args.report) > 2 else None)
            )
        )
        return 0
    if args.documents:
        pdf, questions = args.documents
        rows = ask_the_app(pdf, json.loads(questions.read_text(encoding="utf-8")))
        result = {"document": pdf.name, "questions": questions.name, **documents_scores(rows), "rows": rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print({k: v for k, v in result.items() if k != "rows"})
        return 0
    root = storage.data_dir()
    if root is None:
        print("confidence: set BRAG_DATA_DIR to the shared evaluation data", file=sys.stderr)
        return 2
    llm = llms.CachedLLM(llms.make_llm("local"), args.cache, mode="replay" if args.replay else "read-write")
    results: dict[str, dict[str, Any]] = {}
    for kind in args.fits.split(","):
        for key in args.datasets.split(","):
            calibration = fit_for(kind, key, llm.name)
            rows = run(key, llm, calibration, root)
            results.setdefault(kind, {})[key] = {
                "calibration": calibration.meta.get("name"),
                **scores(rows),
                "rows": rows,
            }
            print(kind, key, {k: v for k, v in results[kind][key].items() if k != "rows"}, file=sys.stderr)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} (LLM cache hits {llm.hits}, misses {llm.misses})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
