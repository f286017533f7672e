"""The documents fit, and "not in your documents", measured by leaving one set of documents out.

Every labelled set over real manuals (``bench/docs/sets.json`` and ``sets_more.json``) whose
questions were observed (``python bench/confidence_observe.py --docs DIR``). For each
set, with everything fitted on the *other* sets:

- the documents fit (``calibrate.documents_fit``) and its "not in your documents" model
  (``calibrate.fit_found``, fitted on the other sets' runs under that fit);
- against today's benchmark fit, the set's own self-test fit (the documents fit refitted on its
  self-test questions, at the strength chosen on the other sets) and its own labels
  (cross-validated: the ceiling), and each read alone;
- on its answerable questions (accuracy, AUROC, ECE, "a guess", calls, tokens, seconds, right
  answers flagged) and on its questions the documents cannot answer (flagged or not).

Every run is the controller over the cached LLM responses (``--replay``: no LLM at all).
``--ship`` writes the documents fit over every set to ``data/calibrations``.

    python bench/documents_fit.py --docs DIR [--replay] [--ship]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe as observations
import selftest as observed
from harness import documents_parser, write_keeping

import brag
import calibrate
from bragkit import fits

MANIFESTS = (ROOT / "bench" / "docs" / "sets.json", ROOT / "bench" / "docs" / "sets_more.json")
RESULTS = ROOT / "bench" / "results" / "documents_fit.md"
DETAILS = ROOT / "bench" / "results" / "documents_fit.json"
SHIPPED = ROOT / "data" / "calibrations" / "qwen2.5-coder-0.5b-documents.json"
# Self-tests run as the plan runs them now, on a response cache of their own (so their minutes
# are the model's): `python bench/selftest.py observe --only selftest --out bench/results/self_tests
# --cache bench/cache/self_tests.sqlite --docs DIR --set NAME`. A set without one uses its earlier
# self-test in bench/results/selftest, without the actions the plan no longer runs.
SELF_TESTS = ROOT / "bench" / "results" / "self_tests"
M, HOPS = 5, fits.SELF_TEST_HOPS  # as every set was observed (bench/selftest.py observer)
# The strength a self-test refit used before the documents fit (chosen then toward the benchmark
# fit): shown beside today's choice, and the strength of the own-labels ceiling.
EARLIER_STRENGTH = 5.0


@dataclass
class DocumentSet:
    """One labelled set: its corpus, its questions and what every action returned on them."""

    name: str
    entry: dict[str, Any]
    corpus: brag.Corpus
    items: list[calibrate.Labelled]
    unanswerable: list[calibrate.Labelled]
    real: list[calibrate.Outcome]
    self_test: list[calibrate.Outcome]  # [] when the set has no self-test observed


def document_sets(docs: Path) -> list[DocumentSet]:
    """Every set with observed questions, in manifest order."""
    found = []
    for manifest in MANIFESTS:
        for entry in json.loads(manifest.read_text(encoding="utf-8"))["sets"]:
            name = entry["name"]
            if not _complete(name, "real", observed.questions_of(entry)):
                continue  # not observed yet, or still being observed
            unanswerable = observed.unanswerable_of(entry)
            found.append(
                DocumentSet(
                    name,
                    entry,
                    observed.corpus_of(entry, docs),
                    observed.questions_of(entry),
                    unanswerable if _complete(name, "unanswerable", unanswerable) else [],
                    outcomes_of(name, "real"),
                    self_test_outcomes(name),
                )
            )
    return found


def self_test_folder(name: str) -> Path | None:
    """Where the set's self-test is: today's plan's, else the earlier one, else None."""
    for folder in (SELF_TESTS, observed.OUT):
        if (folder / f"{name}.selftest.jsonl").is_file() and (folder / f"{name}.pairs.json").is_file():
            return folder
    return None


def outcomes_of(name: str, part: str) -> list[calibrate.Outcome]:
    """The set's outcomes with every action, the sampled read among them (``confidence_observe.py``)."""
    return observations.read_outcomes(name, part)


def self_test_outcomes(name: str) -> list[calibrate.Outcome]:
    folder = self_test_folder(name)
    if folder is None:
        return []
    if observations.outcomes_path(name, "selftest").is_file():  # re-observed with every feature
        return as_self_tested(observations.read_outcomes(name, "selftest"))
    found = calibrate.read_progress(folder / f"{name}.selftest.jsonl", name).values()
    return as_self_tested(list(found))


def _complete(name: str, part: str, items: list[calibrate.Labelled]) -> bool:
    """Whether every one of ``items`` has its outcome observed."""
    path = observations.outcomes_path(name, part)
    return path.is_file() and {i.id for i in items} <= {o.id for o in outcomes_of(name, part)}


def as_self_tested(outcomes: list[calibrate.Outcome]) -> list[calibrate.Outcome]:
    """Outcomes as today's self-test observes them: only the actions its plan runs.

    Self-tests observed before hops were left out of the plan ran R2 as well; its reads do
    not enter the fit now (the documents fit's entry is kept), so they are dropped here.
    """
    return observations.with_actions(outcomes, observed.PLAN_ACTIONS)


# ------------------------------------------------------------------------------------------
# The fits
# ------------------------------------------------------------------------------------------


def model_name() -> str:
    return str(observed.pooled().meta["model"])


def runs(llm: brag.LLM, fit: brag.Calibration, s: DocumentSet) -> tuple[list[dict], list[dict]]:
    """The controller under ``fit`` on the set's answerable questions, then on its unanswerable ones."""
    return observed.run_rows(llm, fit, s.items, s.corpus), observed.run_rows(
        llm, fit, s.unanswerable, s.corpus
    )


def found_rows(llm: brag.LLM, fit: brag.Calibration, sets: list[DocumentSet]) -> list[tuple]:
    """(signals, answerable, right) of every question of ``sets`` under ``fit``."""
    rows = []
    for s in sets:
        answerable, unanswerable = runs(llm, fit, s)
        rows += [(r["signals"], True, r["right"]) for r in answerable]
        rows += [(r["signals"], False, False) for r in unanswerable]
    return rows


def documents_fit(
    llm: brag.LLM, sets: list[DocumentSet], meta: dict[str, Any] | None = None, evidence: str = "curve"
) -> dict[str, Any]:
    """The documents fit over ``sets``, with its found model fitted on their runs under it."""
    outcomes = {s.name: s.real for s in sets}
    options = {"model": model_name(), "evidence": evidence}
    plain = calibrate.documents_fit(outcomes, M, HOPS, **options)
    found = calibrate.fit_found(found_rows(llm, brag.load_calibration(plain), sets))
    return calibrate.documents_fit(outcomes, M, HOPS, found=found, meta=meta, **options)


def refitted(base: brag.Calibration, outcomes: list[calibrate.Outcome], strength: float) -> brag.Calibration:
    return observed.refitted(base, outcomes, strength)


def strengths(bases: dict[str, brag.Calibration], sets: list[DocumentSet]) -> tuple[dict[str, float], dict]:
    """Per set, the self-test strength that fits the other sets' real questions best."""
    tested = [s for s in sets if s.self_test]
    losses = {
        strength: {
            s.name: observed.loss(refitted(bases[s.name], s.self_test, strength), s.real) for s in tested
        }
        for strength in observed.STRENGTHS
    }
    chosen = {}
    for s in sets:
        others = {k: np.mean([v for n, v in by.items() if n != s.name] or [0.0]) for k, by in losses.items()}
        chosen[s.name] = float(min(others, key=others.get))
    return chosen, {k: float(np.mean(list(v.values()))) if v else None for k, v in losses.items()}


# ------------------------------------------------------------------------------------------
# Scores
# ------------------------------------------------------------------------------------------


def flagged(row: dict[str, Any]) -> bool:
    """Answered with a flag: "not in your documents", or "a guess"."""
    return (not row["found"]) or row["guess"]


def scores(answerable: list[dict], unanswerable: list[dict]) -> dict[str, Any]:
    """The answerable questions' scores, and how the unanswerable ones came back."""
    result = observed.scored(answerable)
    right = [r for r in answerable if r["right"]]
    result["right_flagged_not_found"] = float(np.mean([not r["found"] for r in right])) if right else None
    result["right_flagged"] = float(np.mean([flagged(r) for r in right])) if right else None
    if unanswerable:
        result["unanswerable"] = {
            "n": len(unanswerable),
            "not_found": float(np.mean([not r["found"] for r in unanswerable])),
            "flagged": float(np.mean([flagged(r) for r in unanswerable])),
            "unflagged": float(np.mean([not flagged(r) for r in unanswerable])),
        }
    return result


def own_labels(llm: brag.LLM, base: brag.Calibration, s: DocumentSet, strength: float) -> list[dict]:
    """The set's own labels as the fit, each fold answered by a refit on the other folds."""
    return observed.own_labels(llm, base, s.items, s.real, s.corpus, strength)


def held_out(llm: brag.LLM, sets: list[DocumentSet]) -> dict[str, Any]:
    """Every set scored with everything fitted without it."""
    bases = {s.name: documents_fit(llm, [o for o in sets if o.name != s.name]) for s in sets}
    loaded = {n: brag.load_calibration(b) for n, b in bases.items()}
    chosen, losses = strengths(loaded, sets)
    benchmark = observed.pooled()
    results: dict[str, Any] = {"strength": chosen, "losses": losses, "sets": {}}
    for s in sets:
        base = loaded[s.name]
        fits_of = {"benchmark fit": benchmark, "documents fit (held out)": base}
        if s.self_test:
            fits_of["own self-test fit"] = refitted(base, s.self_test, chosen[s.name])
            fits_of[f"own self-test fit, strength {EARLIER_STRENGTH:g}"] = refitted(
                base, s.self_test, EARLIER_STRENGTH
            )
        found = {label: scores(*runs(llm, fit, s)) for label, fit in fits_of.items()}
        found["own labels (CV)"] = scores(own_labels(llm, base, s, EARLIER_STRENGTH), [])
        for label in ("RT", "R1"):
            found[f"{label} alone"] = observed.scored(observed.fixed_rows(s.real, label))
        results["sets"][s.name] = {
            "entry": s.entry,
            "scores": found,
            "found_model": bases[s.name]["found"],
            "self_test": self_test_record(s),
        }
    return results


def self_test_record(s: DocumentSet) -> dict[str, Any] | None:
    """What the set's self-test cost: tried, kept, minutes, calls (as today's plan runs it)."""
    folder = self_test_folder(s.name)
    if not s.self_test or folder is None:
        return None
    record = json.loads((folder / f"{s.name}.pairs.json").read_text(encoding="utf-8"))
    cost = record["cost"]
    today = folder == SELF_TESTS
    runs = [u for o in s.self_test for found in o.usage.values() for u in found]
    # Today's runs: the wall clock and the calls made. Earlier ones ran R2 as well: the seconds
    # and calls of the actions the plan runs now, from each question's usage.
    running = cost["observation_s"] if today else sum(u["llm_seconds"] for u in runs)
    calls = cost["observation_calls"] if today else sum(u["llm_calls"] for u in runs)
    return {
        "tried": record["summary"]["yield"]["tried"],
        "kept": len(record["pairs"]),
        "writing_min": cost["generation_s"] / 60,
        "running_min": running / 60,
        "generation_calls": cost["generation_calls"],
        "action_calls": calls,
        "observed": list(observed.PLAN_ACTIONS),
        "run": "today's plan" if today else "earlier (R2 too; its minutes left out)",
    }


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------

COLUMNS = ("accuracy", "ece", "auroc", "guesses", "guess_right", "sure_right", "calls", "tokens", "seconds")


_f = observed._f  # one way to print a figure in the bench's tables


def set_table(name: str, found: dict[str, Any]) -> list[str]:
    entry = found["entry"]
    lines = [
        f"### {name}: {entry.get('package')} {entry.get('version')} "
        f"({entry.get('format')}, {entry.get('language')}, {len(entry['files'])} file(s))",
        "",
        "| fit | n | "
        + " | ".join(COLUMNS)
        + " | right: not found | right flagged | unanswerable: not found | flagged | unflagged |",
        "|---" * (len(COLUMNS) + 7) + "|",
    ]
    for label, s in found["scores"].items():
        u = s.get("unanswerable") or {}
        cells = [_f(s.get(c), 0 if c == "tokens" else 2 if c in ("seconds", "calls") else 3) for c in COLUMNS]
        tail = [
            _f(s.get("right_flagged_not_found")),
            _f(s.get("right_flagged")),
            _f(u.get("not_found")),
            _f(u.get("flagged")),
            _f(u.get("unflagged")),
        ]
        lines.append(f"| {label} | {s['n']} | " + " | ".join(cells + tail) + " |")
    return [*lines, ""]


def pooled_table(results: dict[str, Any]) -> list[str]:
    """Question-weighted over the sets, for each fit every set has."""
    labels = [k for k in next(iter(results["sets"].values()))["scores"] if not k.startswith("own self-test")]
    lines = [
        "| fit | questions | accuracy | ece (mean of sets) | right: not found | right flagged "
        "| unanswerable not found | flagged | unflagged |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        rows = [found["scores"][label] for found in results["sets"].values()]
        n = sum(r["n"] for r in rows)
        accuracy = sum(r["accuracy"] * r["n"] for r in rows) / n
        ece = [r["ece"] for r in rows if r.get("ece") is not None]
        flagged_right = [r["right_flagged"] for r in rows if r.get("right_flagged") is not None]
        right_not_found = [
            r["right_flagged_not_found"] for r in rows if r.get("right_flagged_not_found") is not None
        ]
        un = [r["unanswerable"] for r in rows if r.get("unanswerable")]
        un_n = sum(u["n"] for u in un)

        def share(key: str, un=un, un_n=un_n) -> str:
            return _f(sum(u[key] * u["n"] for u in un) / un_n) if un_n else "–"

        lines.append(
            f"| {label} | {n} | {accuracy:.3f} | {_f(float(np.mean(ece)) if ece else None)} | "
            f"{_f(float(np.mean(right_not_found)) if right_not_found else None)} | "
            f"{_f(float(np.mean(flagged_right)) if flagged_right else None)} | "
            f"{share('not_found')} | {share('flagged')} | {share('unflagged')} |"
        )
    return [*lines, ""]


def self_test_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| set | self-test | tried | kept | writing min | running min | total min | generation calls | "
        "action calls | accuracy: documents fit → own self-test fit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in results["sets"].items():
        st = found["self_test"]
        if st is None:
            continue
        before = found["scores"]["documents fit (held out)"]["accuracy"]
        after = found["scores"]["own self-test fit"]["accuracy"]
        lines.append(
            f"| {name} | {st['run']} | {st['tried']} | {st['kept']} | "
            f"{st['writing_min']:.1f} | {st['running_min']:.1f} | "
            f"{st['writing_min'] + st['running_min']:.1f} | {st['generation_calls']} | "
            f"{st['action_calls']} | "
            f"{before:.3f} → {after:.3f} |"
        )
    return [*lines, ""]


SHAPES = {
    "option": "_OPTION",
    "path": "_PATH",
    "function": "_FUNCTION",
    "variable or constant": "_VARIABLE",
    "identifier": "_IDENTIFIER",
    "named": "_NAMED",
    "number": "_NUMBER",
    "name": "_NAME_SHAPE",
    "quoted term": "_QUOTED",
}


def shape_yield(folders: tuple[Path, ...]) -> dict[str, dict[str, list[int]]]:
    """Per self-test run folder and answer shape: [questions checked by the roundtrip, kept]."""
    from bragkit import selftest as st

    found: dict[str, dict[str, list[int]]] = {}
    for folder in folders:
        counts: dict[str, list[int]] = {}
        for path in sorted(folder.glob("*.pairs.json")):
            for tried in json.loads(path.read_text(encoding="utf-8"))["tried"]:
                if tried["verdict"] not in ("kept", "roundtrip"):
                    continue
                shape = next(
                    (n for n, attr in SHAPES.items() if getattr(st, attr).fullmatch(tried["answer"])), "other"
                )
                counts.setdefault(shape, [0, 0])
                counts[shape][0] += 1
                counts[shape][1] += tried["verdict"] == "kept"
        found[str(folder.relative_to(ROOT))] = counts
    return found


def shape_table(found: dict[str, dict[str, list[int]]]) -> list[str]:
    lines = ["| self-tests | shape | checked by the roundtrip | kept | share kept |", "|---|---|---|---|---|"]
    for folder, counts in found.items():
        for shape, (checked, kept) in sorted(counts.items(), key=lambda item: -item[1][0]):
            lines.append(f"| {folder} | {shape} | {checked} | {kept} | {kept / checked:.2f} |")
    return [*lines, ""]


def markdown(results: dict[str, Any], command: str) -> list[str]:
    strength = ", ".join(f"{k} {v:g}" for k, v in results["strength"].items())
    losses = " | ".join(_f(v) for v in results["losses"].values())
    lines = [
        '# The documents fit and "not in your documents", one set of documents left out at a time',
        "",
        f"`{command}` (the controller over `bench/cache/selftest.sqlite`; no LLM with `--replay`).",
        "",
        "Every fit scored on a set was made without that set: the documents fit and its found model "
        "on the other sets; the self-test fit refines that documents fit on the set's own self-test "
        "questions; own labels are the set's real questions, cross-validated in 5 folds (the ceiling). "
        'Right: normalised exact match or token F1 ≥ 0.8. λ = 0.05. "A guess": P(correct) < 0.5. '
        'Flagged: "not in your documents" or "a guess". ECE over 10 bins.',
        "",
        "## Pooled over the sets",
        "",
        *pooled_table(results),
        "## Self-test strength toward the documents fit, leave one set out",
        "",
        "| strength | " + " | ".join(f"{k:g}" for k in results["losses"]) + " |",
        "|---" * (len(results["losses"]) + 1) + "|",
        f"| held-out vote loss | {losses} |",
        "",
        f"Chosen for each set on the others: {strength}",
        "",
        "## Self-tests (as the plan runs them now: " + ", ".join(observed.PLAN_ACTIONS) + ")",
        "",
        *self_test_table(results),
        "Answer shapes: of the questions that reached the roundtrip, how many it kept (a span's shape "
        'as `bragkit/selftest.py` names it; "other": a term defined on a line of its own, or a '
        "span no single shape spells).",
        "",
        *shape_table(results["shapes"]),
        "## Each set",
        "",
    ]
    for name, found in results["sets"].items():
        lines += set_table(name, found)
    return lines


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--replay", action="store_true", help="from the cache alone (no LLM)")
    parser.add_argument("--ship", action="store_true", help="write the documents fit over every set")
    args = parser.parse_args()
    llm = observed.model("replay" if args.replay else "read-write")
    sets = document_sets(args.docs)
    if args.ship:
        fitted = documents_fit(llm, sets, meta={"name": SHIPPED.stem})
        SHIPPED.write_text(json.dumps(fitted, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {SHIPPED.relative_to(ROOT)} from {', '.join(s.name for s in sets)}")
        return 0
    results = held_out(llm, sets)
    results["shapes"] = shape_yield(tuple(f for f in (observed.OUT, SELF_TESTS) if f.is_dir()))
    DETAILS.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    command = "python bench/documents_fit.py --docs DIR" + (" --replay" if args.replay else "")
    write_keeping(RESULTS, markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
