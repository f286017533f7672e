"""The documents fit across readers, one reader (and one set of documents) left out at a time.

Readers: the embedded 0.5B (``bench/results/confidence_documents/``), ``local:smollm2`` and
``local:qwen1.5b`` (``bench/results/models/``, ``python bench/models_observe.py``), each over
the labelled sets of real manuals, answerable and unanswerable, with the actions every reader
was observed with (``ACTIONS``). For each held-out reader and each held-out set, every fit is
made without that set, and the fit across readers without that reader:

- **across readers**: :func:`calibrate.cross_reader_fit` on the other readers' other sets, and
  its found model on their runs under it: what an unknown model starts from;
- **adapted (terms)** / **adapted (refit)**: that fit after a self-test of the held-out set by
  the held-out reader (its self-test questions, ``<set>.selftest.jsonl``): its reader terms
  alone (``calibrate.reader_adapted``, strength chosen on the other readers), or every value
  refitted (``calibrate.refit``, as a single reader's fit is);
- **own fit** (the ceiling): the reader's own documents fit on its other sets;
- **hand-set prior** (today): ``data/calibration_prior.json``, less the second hop (no reader
  but the 0.5B was observed with it).

Every run is the controller over the cached responses: no LLM is called (a miss fails), so the
results reproduce from the committed caches. ``--ship`` writes the fit over every reader and set.

    python bench/models.py --docs DIR [--ship]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import confidence_observe
import documents_fit as docfit
import models_observe
import selftest as observed
from harness import documents_parser, write_keeping

import brag
import calibrate
from bragkit.llms import CachedLLM
from bragkit.llms.local import LOCAL_MODELS

RESULTS = ROOT / "bench" / "results" / "models.md"
DETAILS = ROOT / "bench" / "results" / "models.json"
SHIPPED = ROOT / "data" / "calibrations" / "documents-across-readers.json"
ACTIONS = models_observe.ACTIONS
M, HOPS = docfit.M, docfit.HOPS
STRENGTHS = (1.0, 3.0, 10.0, 30.0, 100.0)


@dataclass(frozen=True)
class Reader:
    """One reader's observed sets: its name (as its backend names itself), outcomes and cache."""

    key: str
    model: str
    cache: Path

    def outcomes(self, name: str, part: str, actions: tuple[str, ...] = ACTIONS) -> list[calibrate.Outcome]:
        """Its outcomes of one set's part (real, unanswerable, selftest), with ``actions`` only."""
        if self.key == "qwen0.5b":
            found = confidence_observe.read_outcomes(name, part)
            return confidence_observe.with_actions(found, actions)
        path = models_observe.outcomes_path(self.key, name, part)
        return list(calibrate.read_progress(path, f"{self.key}/{name}").values()) if path.is_file() else []

    def llm(self, mode: str) -> CachedLLM:
        """Its cached responses, under its own name."""
        return CachedLLM(Unreachable(self.model), self.cache, model=self.model, mode=mode)


class Unreachable:
    """A backend of the right name that is never called: every replayed response is cached."""

    def __init__(self, name: str) -> None:
        self.name = name

    def complete(self, messages: list[dict[str, str]], **_: Any) -> brag.Completion:
        """Refuse: the response was not cached."""
        raise brag.InputError(f"{self.name}: a response is not in the cache (observe it first)")


def local_name(key: str) -> str:
    weights = LOCAL_MODELS[key]
    return f"local:{weights.name}:{weights.prompt_format}"


READERS = (
    Reader("qwen0.5b", local_name("qwen"), observed.CACHE),
    Reader("smollm2", local_name("smollm2"), models_observe.CACHE),
    Reader("qwen1.5b", local_name("qwen1.5b"), models_observe.CACHE),
)


@dataclass
class Observed:
    """One reader's reads of one set: the questions it read, their outcomes and its self-test."""

    reader: Reader
    name: str
    corpus: brag.Corpus
    items: list[calibrate.Labelled]
    unanswerable: list[calibrate.Labelled]
    real: list[calibrate.Outcome]
    self_test: list[calibrate.Outcome]


def observed_sets(docs: Path) -> dict[str, dict[str, Observed]]:
    """Per reader, per set, what it read (only the questions it has outcomes for)."""
    found: dict[str, dict[str, Observed]] = {}
    corpora: dict[str, brag.Corpus] = {}
    for manifest in docfit.MANIFESTS:
        for entry in json.loads(manifest.read_text(encoding="utf-8"))["sets"]:
            name = entry["name"]
            for reader in READERS:
                real = {o.id: o for o in reader.outcomes(name, "real")}
                if not real:
                    continue
                if name not in corpora:
                    corpora[name] = observed.corpus_of(entry, docs)
                unanswerable = {o.id for o in reader.outcomes(name, "unanswerable")}
                found.setdefault(reader.key, {})[name] = Observed(
                    reader,
                    name,
                    corpora[name],
                    [i for i in observed.questions_of(entry) if i.id in real],
                    [i for i in observed.unanswerable_of(entry) if i.id in unanswerable],
                    list(real.values()),
                    reader.outcomes(name, "selftest"),
                )
    return found


# ------------------------------------------------------------------------------------------
# The fits
# ------------------------------------------------------------------------------------------


def runs(fit: brag.Calibration, s: Observed, llms: dict[str, CachedLLM]) -> tuple[list[dict], list[dict]]:
    llm = llms[s.reader.key]
    return observed.run_rows(llm, fit, s.items, s.corpus), observed.run_rows(
        llm, fit, s.unanswerable, s.corpus
    )


def found_rows(fit: brag.Calibration, sets: list[Observed], llms: dict[str, CachedLLM]) -> list[tuple]:
    """(signals, answerable, right) of every question of ``sets`` under ``fit``.

    A fit across readers is read as a model it has no terms for would (a fit for one reader, as it is).
    """
    common = fit.for_reader("a model it has no terms for")
    rows = []
    for s in sets:
        answerable, unanswerable = runs(common, s, llms)
        rows += [(r["signals"], True, r["right"]) for r in answerable]
        rows += [(r["signals"], False, False) for r in unanswerable]
    return rows


def across(sets: list[Observed], llms: dict[str, CachedLLM], meta: dict | None = None) -> dict[str, Any]:
    """The fit across the readers of ``sets``, with its found model fitted on their runs under it."""
    by_reader: dict[str, dict[str, list[calibrate.Outcome]]] = {}
    for s in sets:
        by_reader.setdefault(s.reader.model, {})[s.name] = s.real
    plain = calibrate.cross_reader_fit(by_reader, M, HOPS)
    found = calibrate.fit_found(found_rows(brag.load_calibration(plain), sets, llms))
    return calibrate.cross_reader_fit(by_reader, M, HOPS, found=found, meta=meta)


def own_fit(sets: list[Observed], llms: dict[str, CachedLLM]) -> brag.Calibration:
    """One reader's own documents fit over ``sets``, with its found model (the ceiling)."""
    outcomes = {s.name: s.real for s in sets}
    model = sets[0].reader.model
    plain = calibrate.documents_fit(outcomes, M, HOPS, model=model)
    found = calibrate.fit_found(found_rows(brag.load_calibration(plain), sets, llms))
    return brag.load_calibration(calibrate.documents_fit(outcomes, M, HOPS, model=model, found=found))


def prior() -> brag.Calibration:
    """The hand-set prior as a reader with no fit meets it, less the second hop."""
    data = brag.load_calibration().to_dict()
    data["actions"] = {k: v for k, v in data["actions"].items() if k in ACTIONS}
    return brag.load_calibration(data)


def adapted(base: brag.Calibration, s: Observed, how: str, strength: float) -> brag.Calibration:
    return brag.load_calibration(
        calibrate.self_test_fit(
            base, s.self_test, corpus="bench", hops=HOPS, adapt=how, reader_strength=strength
        )
    )


def vote_loss(fit: brag.Calibration, outcomes: list[calibrate.Outcome]) -> float:
    return float(np.mean(calibrate.vote_losses(fit, outcomes, HOPS)))


# ------------------------------------------------------------------------------------------
# Scores
# ------------------------------------------------------------------------------------------


def scores(answerable: list[dict], unanswerable: list[dict]) -> dict[str, Any]:
    result = docfit.scores(answerable, unanswerable)
    result["distinct_p"] = len({round(r["p"], 3) for r in answerable})
    result["first"] = dict(Counter(r["actions"][0] if r["actions"] else "-" for r in answerable))
    return result


def pooled_scores(rows: list[tuple[list[dict], list[dict]]]) -> dict[str, Any]:
    answerable = [r for a, _ in rows for r in a]
    unanswerable = [r for _, u in rows for r in u]
    return scores(answerable, unanswerable)


_WORKER: dict[str, Any] = {}  # each worker process's own caches and sets (no connection is shared)


def _start_worker(docs: Path) -> None:
    _WORKER["llms"] = {r.key: r.llm("replay") for r in READERS}
    _WORKER["found"] = observed_sets(docs)


def _held_out_base(job: tuple[str, str]) -> dict[str, Any]:
    """The fit across readers without set ``name``, and without reader ``key`` unless it is ''."""
    key, name = job
    found = _WORKER["found"]
    others = [s for k, by in found.items() if k != key for n, s in by.items() if n != name]
    return across(others, _WORKER["llms"])


def _held_out_runs(
    job: tuple[str, str, dict[str, Any], dict[str, Any], float],
) -> dict[str, tuple[list, list]]:
    """Reader ``key``'s runs on set ``name`` under each fit made without that set."""
    key, name, base_file, known_file, strength = job
    found, llms = _WORKER["found"], _WORKER["llms"]
    sets, s = found[key], found[key][name]
    base = brag.load_calibration(base_file).for_reader(s.reader.model)
    own = own_fit([o for n, o in sets.items() if n != name], llms)
    fits_of = {"hand-set prior (today)": prior(), "across readers": base, "own fit (ceiling)": own}
    # As the shipped fit is for a reader it was fitted on: that reader's other sets in it, and its terms.
    fits_of["across readers, its own terms"] = brag.load_calibration(known_file).for_reader(s.reader.model)
    if s.self_test:
        fits_of["adapted (terms)"] = adapted(base, s, "terms", strength)
        fits_of["adapted (refit)"] = adapted(base, s, "refit", strength)
        fits_of["across readers, same sets"] = base
        fits_of["own fit, same sets"] = own
    return {label: runs(fit, s, llms) for label, fit in fits_of.items()}


def held_out(docs: Path, found: dict[str, dict[str, Observed]], workers: int = 2) -> dict[str, Any]:
    """Every reader and set left out: each fit's runs, pooled per reader; the strengths' losses.

    The fits and runs of each (reader, set) are independent: ``workers`` processes make them.
    """
    jobs = [(key, name) for key, sets in found.items() for name in sets]
    names = sorted({name for _, name in jobs})
    with ProcessPoolExecutor(workers, initializer=_start_worker, initargs=(docs,)) as pool:
        files = dict(zip(jobs, pool.map(_held_out_base, jobs), strict=True))
        known = dict(zip(names, pool.map(_held_out_base, [("", n) for n in names]), strict=True))
        bases = {
            (key, name): brag.load_calibration(f).for_reader(found[key][name].reader.model)
            for (key, name), f in files.items()
        }
        # The self-test strength of each reader's terms, chosen on the other readers' self-tests.
        losses = {
            key: {
                strength: [
                    vote_loss(adapted(bases[key, n], s, "terms", strength), s.real)
                    for n, s in sets.items()
                    if s.self_test
                ]
                for strength in STRENGTHS
            }
            for key, sets in found.items()
        }
        chosen = {}
        for key in found:
            others = {
                st: np.mean([x for k, by in losses.items() if k != key for x in by[st]] or [0.0])
                for st in STRENGTHS
            }
            chosen[key] = float(min(others, key=others.get))
        run_jobs = [(key, name, files[key, name], known[name], chosen[key]) for key, name in jobs]
        ran = dict(zip(jobs, pool.map(_held_out_runs, run_jobs), strict=True))
    results: dict[str, Any] = {"readers": {}, "sets": [n for n in next(iter(found.values()))]}
    results["losses"] = {
        k: {str(st): float(np.mean(v)) if v else None for st, v in by.items()} for k, by in losses.items()
    }
    for key, sets in found.items():
        labels: dict[str, list] = {}
        for name in sets:
            for label, rows in ran[key, name].items():
                labels.setdefault(label, []).append(rows)
        results["readers"][key] = {
            "model": next(iter(sets.values())).reader.model,
            "strength": chosen[key],
            "sets": list(sets),
            "questions": sum(len(s.items) for s in sets.values()),
            "unanswerable": sum(len(s.unanswerable) for s in sets.values()),
            "self_tested": [n for n, s in sets.items() if s.self_test],
            "scores": {label: pooled_scores(rows) for label, rows in labels.items()},
        }
    return results


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------

_f = observed._f


def reader_table(key: str, found: dict[str, Any]) -> list[str]:
    lines = [
        f"### {key} (`{found['model']}`): {found['questions']} questions, {found['unanswerable']} "
        f"unanswerable, over {len(found['sets'])} sets; "
        f"self-tested: {', '.join(found['self_tested']) or 'none'}; terms' strength {found['strength']:g}",
        "",
        "| fit | accuracy | AUROC | ECE | Brier | mean P | distinct P | first read | calls | tokens "
        "| seconds | unanswerable unflagged | right flagged |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in found["scores"].items():
        u = s.get("unanswerable") or {}
        first = ", ".join(f"{a} {n}" for a, n in sorted(s["first"].items(), key=lambda x: -x[1]))
        cells = [
            _f(s["accuracy"]),
            _f(s.get("auroc")),
            _f(s.get("ece")),
            _f(s.get("brier")),
            _f(s.get("mean_p")),
            str(s["distinct_p"]),
            first,
            _f(s["calls"], 2),
            _f(s["tokens"], 0),
            _f(s["seconds"], 2),
            _f(u.get("unflagged")),
            _f(s.get("right_flagged")),
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def markdown(results: dict[str, Any], command: str) -> list[str]:
    lines = [
        "# Any model from the first question: the documents fit across readers, one reader left out",
        "",
        f"`{command}` (the controller over the cached responses; no LLM is called).",
        "",
        "Each held-out reader's questions on each set are answered with fits made without that "
        "set; the fit across readers is also made without that reader (what an unknown model "
        "starts from). Pooled over the sets. Right: normalised exact match or token F1 ≥ 0.8; "
        'λ = 0.05; ECE over 10 bins; "unanswerable unflagged": a question the documents cannot '
        'answer, answered with neither "not in your documents" nor "a guess". Actions: '
        + ", ".join(ACTIONS)
        + '. The rows "same sets" repeat a fit on the self-tested sets only, beside the adapted ones.',
        "",
        "## Terms' strength (held-out vote log-loss of the reader's real questions after its self-test)",
        "",
        "| reader | " + " | ".join(f"{s:g}" for s in STRENGTHS) + " |",
        "|---" * (len(STRENGTHS) + 1) + "|",
    ]
    for key, by in results["losses"].items():
        lines.append(f"| {key} | " + " | ".join(_f(by[str(s)]) for s in STRENGTHS) + " |")
    lines += ["", "## Each reader held out", ""]
    for key, found in results["readers"].items():
        lines += reader_table(key, found)
    return lines


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--ship", action="store_true", help="write the fit across every reader and set")
    args = parser.parse_args()
    llms = {r.key: r.llm("replay") for r in READERS}  # observed by models_observe.py, confidence_observe.py
    found = observed_sets(args.docs)
    if args.ship:
        # The second hop too, where it was observed (the 0.5B's reads): a question whose answer
        # spans two passages needs it, whatever the reader (fitted on the 0.5B's hops alone).
        # Its found model is the one fitted on runs without it (the cache holds a hop only
        # after the read it was observed after).
        every = [s for by in found.values() for s in by.values()]
        found_model = across(every, llms)["found"]
        with_hops = [replace(s, real=s.reader.outcomes(s.name, "real", (*ACTIONS, "R2"))) for s in every]
        by_reader: dict[str, dict[str, list[calibrate.Outcome]]] = {}
        for s in with_hops:
            by_reader.setdefault(s.reader.model, {})[s.name] = s.real
        meta = {"name": SHIPPED.stem}
        fitted = calibrate.cross_reader_fit(by_reader, M, HOPS, found=found_model, meta=meta)
        SHIPPED.write_text(json.dumps(fitted, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {SHIPPED.relative_to(ROOT)} from {', '.join(found)}")
        return 0
    results = held_out(args.docs, found)
    DETAILS.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    write_keeping(RESULTS, markdown(results, "python bench/models.py --docs DIR"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
