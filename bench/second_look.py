"""A second look that reads what the first did not, measured by leaving one set of documents out.

Every labelled set over real manuals (``bench/docs/sets.json`` and ``sets_more.json``), observed
with every action and the next-ranked read RN (``python bench/second_look_observe.py --docs
DIR``). For each set, with everything fitted on the *other* sets:

- today's documents fit (R1, R2, CB, RT, RS) and its "not in your documents" model;
- the documents fit with the next-ranked read (RN) besides, and its found model;
- each fixed read alone (RT, R1, RN, RS, CB);

scored on its answerable questions (accuracy, AUROC, ECE, Brier, mean P − accuracy, wrong first
reads, later calls after them, fixed and broken, tokens and seconds a question) and on its
questions the documents cannot answer (answered with no flag).

Every run is the controller over the cached LLM responses (``bench/cache/selftest.sqlite``); a
call no observation made is made once and cached, and ``--replay`` then runs with no LLM at all.
``--ship`` writes the documents fit with RN over every set to ``data/calibrations``.

    python bench/second_look.py --docs DIR [--replay] [--ship]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe as observations
import documents_fit as documents
import second_look_observe as looked
import selftest as observed
from harness import documents_parser, write_keeping

import brag
from bragkit.llms import CachedLLM, make_llm

RESULTS = ROOT / "bench" / "results" / "second_look.md"
DETAILS = ROOT / "bench" / "results" / "second_look" / "results.json"
TODAY = observations.ACTIONS  # what today's documents fit observes
WITH_NEXT = looked.ACTIONS  # and the next-ranked read
FIXED = ("RT", "R1", "RN", "RS", "CB")
DocumentSet = documents.DocumentSet


def document_sets(docs: Path) -> list[DocumentSet]:
    """Every set whose questions were observed with the next-ranked read, in manifest order."""
    found = []
    for manifest in documents.MANIFESTS:
        for entry in json.loads(manifest.read_text(encoding="utf-8"))["sets"]:
            name, items = entry["name"], observed.questions_of(entry)
            unanswerable = observed.unanswerable_of(entry)
            real = looked.read_outcomes(name, "real")
            away = looked.read_outcomes(name, "unanswerable")
            if {i.id for i in items} - {o.id for o in real} or len(away) < len(unanswerable):
                continue  # not observed yet, or still being observed
            corpus = observed.corpus_of(entry, docs)
            found.append(DocumentSet(name, entry, corpus, items, unanswerable, real, []))
    return found


def keeping(sets: list[DocumentSet], actions: tuple[str, ...]) -> list[DocumentSet]:
    """The sets as a fit observing only ``actions`` would have them."""
    return [
        DocumentSet(
            s.name, s.entry, s.corpus, s.items, s.unanswerable, observations.with_actions(s.real, actions), []
        )
        for s in sets
    ]


def fit_of(llm: brag.LLM, sets: list[DocumentSet], actions: tuple[str, ...], meta=None) -> dict[str, Any]:
    """The documents fit over ``sets`` observing ``actions``, with its found model."""
    return documents.documents_fit(llm, keeping(sets, actions), meta)


def scores(answerable: list[dict], unanswerable: list[dict]) -> dict[str, Any]:
    """A run's scores (``documents_fit.scores``) with mean P − accuracy."""
    result = documents.scores(answerable, unanswerable)
    if "mean_p" in result:
        result["p_minus_accuracy"] = result["mean_p"] - result["accuracy"]
    return result


def held_out(llm: brag.LLM, sets: list[DocumentSet]) -> dict[str, Any]:
    """Every set scored with everything fitted without it."""
    fits = {"today's fit": TODAY, "with the next-ranked read": WITH_NEXT}
    results: dict[str, Any] = {"sets": {}}
    for s in sets:
        others = [o for o in sets if o.name != s.name]
        found: dict[str, Any] = {}
        for label, actions in fits.items():
            fit = brag.load_calibration(fit_of(llm, others, actions))
            answerable, unanswerable = documents.runs(llm, fit, s)
            found[label] = scores(answerable, unanswerable)
            found[label]["first_actions"] = _first_actions(answerable)
        for label in FIXED:
            found[f"{label} alone"] = observed.scored(observed.fixed_rows(s.real, label))
        results["sets"][s.name] = {"entry": s.entry, "scores": found}
    return results


def _first_actions(rows: list[dict]) -> dict[str, int]:
    """How often each action came first, and how often each ran later."""
    first = {a: sum(r["actions"][:1] == [a] for r in rows) for a in WITH_NEXT}
    later = {a: sum(a in r["actions"][1:] for r in rows) for a in WITH_NEXT}
    return {
        **{f"first {a}": n for a, n in first.items() if n},
        **{f"later {a}": n for a, n in later.items() if n},
    }


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------

COLUMNS = (
    ("n", "n", "{:d}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("auroc", "AUROC", "{:.3f}"),
    ("ece", "ECE", "{:.3f}"),
    ("brier", "Brier", "{:.3f}"),
    ("p_minus_accuracy", "mean P − acc", "{:+.3f}"),
    ("wrong_first", "wrong first", "{:d}"),
    ("later_after_wrong", "later after", "{:d}"),
    ("fixed", "fixed", "{:d}"),
    ("broke", "broken", "{:d}"),
    ("tokens", "tokens", "{:.0f}"),
    ("seconds", "seconds", "{:.2f}"),
)


def _cell(value: Any, form: str) -> str:
    return "–" if value is None else form.format(value)


def set_table(name: str, found: dict[str, Any]) -> list[str]:
    entry = found["entry"]
    head = [f"### {name}: {entry['package']} {entry['version']} ({entry['format']}, {entry['language']})", ""]
    header = ["fit", *(title for _, title, _ in COLUMNS), "unanswerable unflagged"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, sc in found["scores"].items():
        away = sc.get("unanswerable")
        cells = [_cell(sc.get(key), form) for key, _, form in COLUMNS]
        unflagged = f"{round(away['unflagged'] * away['n'])} of {away['n']}" if away else "–"
        lines.append("| " + " | ".join([label, *cells, unflagged]) + " |")
    firsts = {k: v["first_actions"] for k, v in found["scores"].items() if "first_actions" in v}
    notes = [f"- {k}: " + ", ".join(f"{a} {n}" for a, n in v.items()) for k, v in firsts.items()]
    return [*head, *lines, "", "Calls:", *notes, ""]


def pooled(results: dict[str, Any], label: str) -> dict[str, float]:
    """Over every set: the sums, the question-weighted means, and the worst set on each target."""
    per = [r["scores"][label] for r in results["sets"].values()]
    n = sum(sc["n"] for sc in per)
    total = {
        key: sum(sc.get(key) or 0 for sc in per)
        for key in ("wrong_first", "later_after_wrong", "fixed", "broke")
    }
    right_first = sum(sc["n"] - sc["wrong_first"] for sc in per)
    away = [sc["unanswerable"] for sc in per if sc.get("unanswerable")]
    return {
        "n": n,
        "accuracy": sum(sc["accuracy"] * sc["n"] for sc in per) / n,
        "tokens": sum(sc["tokens"] * sc["n"] for sc in per) / n,
        "seconds": sum(sc["seconds"] * sc["n"] for sc in per) / n,
        **total,
        "fixed_share": total["fixed"] / max(1, total["wrong_first"]),
        "broken_share": total["broke"] / max(1, right_first),
        "worst_p_gap": max(abs(sc["p_minus_accuracy"]) for sc in per),
        "worst_auroc": min(sc["auroc"] for sc in per if sc.get("auroc") is not None),
        "worst_unflagged": max(a["unflagged"] for a in away) if away else 0.0,
        "unflagged": sum(round(a["unflagged"] * a["n"]) for a in away),
        "unanswerable": sum(a["n"] for a in away),
        "median_ece": float(np.median([sc["ece"] for sc in per])),
    }


def pooled_table(results: dict[str, Any]) -> list[str]:
    rt = [r["scores"]["RT alone"] for r in results["sets"].values()]
    rt_tokens = sum(sc["tokens"] * sc["n"] for sc in rt) / sum(sc["n"] for sc in rt)
    header = (
        "| fit | questions | accuracy | wrong first reads | later calls after them | fixed | broken | "
        "tokens (× RT's) | seconds | worst \\|mean P − acc\\| | worst AUROC | median ECE | "
        "unanswerable unflagged |"
    )
    lines = [header, "|" + "---|" * 13]
    for label in ("today's fit", "with the next-ranked read"):
        p = pooled(results, label)
        lines.append(
            f"| {label} | {p['n']} | {p['accuracy']:.3f} | {p['wrong_first']} | {p['later_after_wrong']} | "
            f"{p['fixed']} ({p['fixed_share']:.2f}) | {p['broke']} ({p['broken_share']:.3f}) | "
            f"{p['tokens']:.0f} ({p['tokens'] / rt_tokens:.2f}×) | {p['seconds']:.2f} | "
            f"{p['worst_p_gap']:.3f} | "
            f"{p['worst_auroc']:.3f} | {p['median_ece']:.3f} | {p['unflagged']} of {p['unanswerable']} |"
        )
    return lines


def markdown(results: dict[str, Any], command: str) -> list[str]:
    lines = [
        "# A second look that reads what the first did not, one set of documents left out at a time",
        "",
        f"`{command}` (the controller over `bench/cache/selftest.sqlite`; no LLM with `--replay`). "
        "Outcomes: `python bench/second_look_observe.py --docs DIR`.",
        "",
        "Every fit scored on a set was made without that set (the documents fit and its found model on the "
        "other sets). Right: normalised exact match or token F1 ≥ 0.8. λ = 0.05. A wrong first read: the "
        "run's first read of the documents answered wrong; fixed: the run's answer is right after a wrong "
        'first read; broken: wrong after a right one. Flagged: "not in your documents" or P < 0.5. '
        "ECE over 10 bins. Tokens are prompt + completion a question.",
        "",
        "## Pooled over the sets",
        "",
        *pooled_table(results),
        "",
        "## Each set",
        "",
    ]
    for name, found in results["sets"].items():
        lines += set_table(name, found)
    return lines


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--replay", action="store_true", help="no LLM: every call must be in the cache")
    parser.add_argument(
        "--ship", action="store_true", help="write the documents fit with RN to data/calibrations"
    )
    args = parser.parse_args()
    llm = CachedLLM(make_llm("local"), observed.CACHE, mode="replay" if args.replay else "read-write")
    sets = document_sets(args.docs)
    results = held_out(llm, sets)
    command = f"python bench/second_look.py --docs DIR{' --replay' if args.replay else ''}"
    DETAILS.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    write_keeping(RESULTS, markdown(results, command))
    if args.ship:
        shipped = fit_of(llm, sets, WITH_NEXT, {"name": documents.SHIPPED.stem})
        documents.SHIPPED.write_text(
            json.dumps(shipped, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        print(f"wrote {documents.SHIPPED.relative_to(ROOT)} from {', '.join(s.name for s in sets)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
