"""Self-test calibration on real documents: does a fit on questions BRAG writes itself hold.

Four labelled sets over documentation nobody here wrote (``bench/docs/sets.json``: a PDF, an
HTML manual, a Markdown one, a German one). For each set, with the embedded model:

- ``observe``: every action (R1, R2 once, CB, RT) on the set's real questions, and a self-test
  of its documents (questions written, checked, every action run on the kept ones). Outcomes,
  kept pairs and the self-test's cost go to ``bench/results/selftest/``; every LLM response to
  ``bench/cache/selftest.sqlite``.
- ``report``: the shrinkage strength by leaving one set out; then on each set's real questions
  (a) today's pooled fit, (b) the self-test fit, (c) R1 alone and RT alone, (d) the set's own
  labels cross-validated (the ceiling), each run by the controller over the cached responses
  (``--replay``: no LLM at all). Writes ``bench/results/selftest.md``.

    python bench/selftest.py fetch --docs DIR          # apt-get download each set's package
    python bench/selftest.py observe --docs DIR [--set NAME]
    python bench/selftest.py report --docs DIR [--replay]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from confidence import ece
from harness import write_keeping

import brag
import calibrate
from bragkit import documents, fits, selftest
from bragkit.llms import CachedLLM, make_llm

SETS = ROOT / "bench" / "docs" / "sets.json"
OUT = ROOT / "bench" / "results" / "selftest"
CACHE = ROOT / "bench" / "cache" / "selftest.sqlite"
RESULTS = ROOT / "bench" / "results" / "selftest.md"
STRENGTHS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1e6)
FOLDS = 5
LAM = 0.05  # the app's default price of a call
PARTS = ("real", "unanswerable", "selftest")


def sets() -> list[dict[str, Any]]:
    return json.loads(SETS.read_text(encoding="utf-8"))["sets"]


def every_set(docs: Path, only: list[str] | None = None) -> Iterator[tuple[dict[str, Any], brag.Corpus]]:
    """Each labelled set of both manifests (``only`` those named, when given), with its corpus."""
    for manifest in (SETS, SETS.with_name("sets_more.json")):
        for entry in json.loads(manifest.read_text(encoding="utf-8"))["sets"]:
            if not only or entry["name"] in only:
                yield entry, corpus_of(entry, docs)


def use_sets(path: Path) -> None:
    global SETS
    SETS = path


def use_folders(out: Path, cache: Path) -> None:
    """Where outcomes go, and which response cache the model reads and writes."""
    global OUT, CACHE
    OUT, CACHE = out, cache


def local_name(name: str) -> str:
    """A packaged file's name once fetched: a gzipped one is unpacked."""
    return Path(name).name.removesuffix(".gz")


def corpus_of(entry: dict[str, Any], docs: Path) -> brag.Corpus:
    """The set's documents as the app reads an upload: each file through bragkit.documents."""
    passages: list[Any] = []
    for name in entry["files"]:
        path = docs / entry["name"] / local_name(name)
        passages += documents.read_file(path.name, path.read_bytes())
    return brag.Corpus(passages)


def questions_of(entry: dict[str, Any]) -> list[calibrate.Labelled]:
    rows = json.loads((ROOT / "bench" / "docs" / entry["questions"]).read_text(encoding="utf-8"))
    return [calibrate.Labelled(r["id"], r["question"], tuple(r["answer"])) for r in rows]


def model(mode: str) -> CachedLLM:
    return CachedLLM(make_llm("local"), CACHE, mode=mode)


# What a self-test of a caller's documents runs: the actions its base, the documents fit, offers.
PLAN_ACTIONS = fits.SelfTestPlan().observed(
    brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-documents.json")
)


def observer(llm: brag.LLM) -> brag.BRAG:
    settings = {"lam": 0.0, "k": 5, "m": 5, "seed": 0, "hops": fits.SELF_TEST_HOPS}
    return calibrate.observer(llm, PLAN_ACTIONS, None, settings)


def outcomes_path(name: str, which: str) -> Path:
    return OUT / f"{name}.{which}.jsonl"


# ------------------------------------------------------------------------------------------
# fetch and observe
# ------------------------------------------------------------------------------------------


def fetch(docs: Path) -> None:
    """Each set's Debian package, at its version, unpacked; its files copied to DIR/<set>/."""
    for entry in sets():
        target = docs / entry["name"]
        if all((target / local_name(f)).is_file() for f in entry["files"]):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            spec = f"{entry['package']}={entry['version']}"
            subprocess.run(["apt-get", "download", spec], cwd=tmp, check=True)
            deb = next(Path(tmp).glob("*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), "out"], cwd=tmp, check=True)
            target.mkdir(parents=True, exist_ok=True)
            for name in entry["files"]:
                source = Path(tmp) / "out" / name
                data = gzip.decompress(source.read_bytes()) if name.endswith(".gz") else source.read_bytes()
                (target / local_name(name)).write_bytes(data)


def unanswerable_of(entry: dict[str, Any]) -> list[calibrate.Labelled]:
    """The set's questions its documents cannot answer (key terms checked absent; no gold)."""
    path = ROOT / "bench" / "docs" / f"{entry['name']}_unanswerable.json"
    rows = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    return [calibrate.Labelled(r["id"], r["question"], ()) for r in rows]


def observe(entry: dict[str, Any], docs: Path, parts: tuple[str, ...] = PARTS) -> None:
    """Every action on the real and unanswerable questions; a self-test and every action on its questions."""
    name, llm = entry["name"], model("read-write")
    corpus = corpus_of(entry, docs)
    OUT.mkdir(parents=True, exist_ok=True)
    controller = observer(llm)
    for part, items in (("real", questions_of(entry)), ("unanswerable", unanswerable_of(entry))):
        if part in parts and items:
            started = time.monotonic()
            calibrate.observe(
                items, corpus, controller, progress_path=outcomes_path(name, part), progress=name
            )
            print(
                f"{name}: {len(items)} {part} questions observed in {time.monotonic() - started:.0f} s",
                flush=True,
            )
    if "selftest" in parts:
        self_test_observed(name, corpus, llm)


def self_test_observed(name: str, corpus: brag.Corpus, llm: CachedLLM) -> None:
    """A self-test as the app runs one: a focused read of a question's own passage is its roundtrip."""
    pairs = OUT / f"{name}.pairs.json"
    misses = llm.misses
    started = time.monotonic()
    remembered = selftest.Remembered(llm)
    controller = observer(remembered)
    test = selftest.self_test(corpus, remembered, budget=fits.SelfTestPlan().budget())
    written = time.monotonic() - started
    calls = llm.misses - misses
    started = time.monotonic()
    calibrate.observe(
        fits.self_test_questions(test),
        corpus,
        controller,
        progress_path=outcomes_path(name, "selftest"),
        progress=name,
    )
    observed = time.monotonic() - started
    cost = {
        "generation_s": round(written, 1),
        "observation_s": round(observed, 1),
        "generation_calls": calls,
        "observation_calls": llm.misses - misses - calls,
    }
    if pairs.exists() and llm.misses == misses:  # replayed: keep the first run's measured cost
        cost = json.loads(pairs.read_text(encoding="utf-8"))["cost"]
    record = {
        "summary": test.summary(),
        "cost": cost,
        "pairs": [vars(p) for p in test.pairs],
        "tried": test.pairs_tried,
    }
    pairs.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{name}: self-test kept {len(test.pairs)}; {cost}", flush=True)


def loopback(entry: dict[str, Any], docs: Path) -> dict[str, Any]:
    """A whole self-test of the set's documents against a loopback OpenAI-compatible server.

    The server is the tests' self-test reader (tests/selftest_reader.py), which answers at
    once: what is left is BRAG's own cost of a self-test (retrieval, checks, the fit) and the
    HTTP round trips, beside the embedded model's minutes.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    from openai_server import FakeOpenAI, Reply
    from selftest_reader import replies

    from bragkit.llms import make_llm as make

    corpus = corpus_of(entry, docs)
    handler = lambda request: Reply(texts=replies(request["messages"], int(request.get("n") or 1)))  # noqa: E731
    with FakeOpenAI(handler=handler) as server:
        llm = make(server.url + "#loopback")
        started = time.monotonic()
        fitted = fits.calibrate_corpus(corpus, llm, pooled())
        seconds = time.monotonic() - started
        calls = len(server.chat_requests)
    kept = fitted["fitted_on"]["questions"]
    return {"set": entry["name"], "kept": kept, "calls": calls, "seconds": round(seconds, 1)}


def read_outcomes(name: str, which: str) -> list[calibrate.Outcome]:
    return list(calibrate.read_progress(outcomes_path(name, which), name).values())


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------


def pooled() -> brag.Calibration:
    return next(c for c in brag.shipped_calibrations().values() if c.meta.get("corpus") == brag.POOLED)


def loss(fit: brag.Calibration, outcomes: list[calibrate.Outcome]) -> float:
    return float(np.mean(calibrate.vote_losses(fit, outcomes, fits.SELF_TEST_HOPS)))


def refitted(base: brag.Calibration, outcomes: list[calibrate.Outcome], strength: float) -> brag.Calibration:
    return brag.load_calibration(
        calibrate.self_test_fit(base, outcomes, corpus="bench", strength=strength, hops=fits.SELF_TEST_HOPS)
    )


def strengths(names: list[str], base: brag.Calibration) -> tuple[dict[str, float], dict[float, list[float]]]:
    """Per set, the strength that fits the *other* sets' real questions best; every loss."""
    losses = {
        s: [loss(refitted(base, read_outcomes(n, "selftest"), s), read_outcomes(n, "real")) for n in names]
        for s in STRENGTHS
    }
    chosen = {}
    for i, name in enumerate(names):
        others = {  # with one set there are no others: its own (a smoke run, not a result)
            s: np.mean([v for j, v in enumerate(vals) if j != i or len(names) == 1])
            for s, vals in losses.items()
        }
        chosen[name] = min(others, key=others.get)
    return chosen, losses


def run_rows(
    llm: brag.LLM, fit: brag.Calibration, items: list[calibrate.Labelled], corpus: brag.Corpus
) -> list[dict[str, Any]]:
    controller = brag.BRAG(llm, calibration=fit, lam=LAM)
    rows = []
    for item in items:
        answer, report = controller.run(item.question, corpus)
        reads = [
            s
            for s in report["steps"]
            if s.get("action") and (s.get("observation") or {}).get("answer") is not None
        ]
        first = reads[0]["observation"]["answer"] if reads else ""
        totals = report["totals"]
        rows.append(
            {
                "id": item.id,
                "p": report["confidence"]["p_correct"],
                "right": calibrate.is_correct(answer, item.gold),
                "first_right": calibrate.is_correct(first, item.gold),
                "guess": report["confidence"]["guess"],
                "calls": totals["llm_calls"],
                "tokens": totals["prompt_tokens"] + totals["completion_tokens"],
                "seconds": totals.get("llm_seconds", 0.0),
                "actions": [s["action"] for s in report["steps"] if s.get("action")],
                "found": report.get("found_in_documents", True),
                "signals": (report["confidence"].get("found") or {}).get("signals", {}),
            }
        )
    return rows


def fixed_rows(outcomes: list[calibrate.Outcome], label: str) -> list[dict[str, Any]]:
    rows = []
    for o in outcomes:
        usage = o.usage[label][0]
        rows.append(
            {
                "right": bool(o.correct[label]),
                "calls": 1,
                "tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                "seconds": usage["llm_seconds"],
            }
        )
    return rows


def scored(rows: list[dict[str, Any]]) -> dict[str, Any]:
    right = np.array([r["right"] for r in rows], dtype=float)
    result: dict[str, Any] = {
        "n": len(rows),
        "accuracy": float(right.mean()),
        "calls": float(np.mean([r["calls"] for r in rows])),
        "tokens": float(np.mean([r["tokens"] for r in rows])),
        "seconds": float(np.mean([r["seconds"] for r in rows])),
    }
    if "p" not in rows[0]:
        return result
    p = np.array([r["p"] for r in rows])
    guess = np.array([r["guess"] for r in rows])
    first = np.array([r["first_right"] for r in rows])
    later = np.array([len(r["actions"]) > 1 for r in rows])
    both = 0 < right.sum() < len(right)
    result.update(
        mean_p=float(p.mean()),
        ece=float(ece(p, right)),
        auroc=calibrate.auc(p, right > 0) if both else None,
        brier=float(np.mean((p - right) ** 2)),
        guesses=int(guess.sum()),
        guess_right=float(right[guess].mean()) if guess.any() else None,
        sure_right=float(right[~guess].mean()) if (~guess).any() else None,
        wrong_first=int((~first).sum()),
        later_after_wrong=int((later & ~first).sum()),
        fixed=int(((right > 0) & ~first).sum()),
        broke=int(((right == 0) & first).sum()),
    )
    return result


def own_labels(
    llm: brag.LLM, base: brag.Calibration, items: list[calibrate.Labelled], real, corpus, strength: float
) -> list[dict[str, Any]]:
    """The set's own labels as the fit, each fold answered by a refit on the other folds."""
    rows: list[dict[str, Any]] = []
    by_id = {o.id: o for o in real}
    for fold in range(FOLDS):
        train = [by_id[i.id] for n, i in enumerate(items) if n % FOLDS != fold]
        test = [i for n, i in enumerate(items) if n % FOLDS == fold]
        rows += run_rows(llm, refitted(base, train, strength), test, corpus)
    return rows


def report(docs: Path, replay: bool) -> dict[str, Any]:
    entries = sets()
    names = [e["name"] for e in entries]
    base = pooled()
    chosen, losses = strengths(names, base)
    overall = {s: float(np.mean(v)) for s, v in losses.items()}
    llm = model("replay" if replay else "read-write")
    results: dict[str, Any] = {"strength": chosen, "losses": overall, "sets": {}}
    for entry in entries:
        name = entry["name"]
        corpus, items = corpus_of(entry, docs), questions_of(entry)
        real, test = read_outcomes(name, "real"), read_outcomes(name, "selftest")
        fit = refitted(base, test, chosen[name])
        rows = {
            "pooled": run_rows(llm, base, items, corpus),
            "self-test": run_rows(llm, fit, items, corpus),
            "own labels (CV)": own_labels(llm, base, items, real, corpus, chosen[name]),
        }
        scores = {k: scored(v) for k, v in rows.items()}
        scores["R1 alone"] = scored(fixed_rows(real, "R1"))
        scores["RT alone"] = scored(fixed_rows(real, "RT"))
        record = json.loads((OUT / f"{name}.pairs.json").read_text(encoding="utf-8"))
        results["sets"][name] = {
            "entry": entry,
            "scores": scores,
            "self_test_accuracy": {a: float(np.mean([o.correct[a] for o in test])) for a in ("R1", "RT")},
            "real_accuracy": {a: float(np.mean([o.correct[a] for o in real])) for a in ("R1", "RT")},
            "self_test": {**record["summary"], "cost": record["cost"], "kept": len(record["pairs"])},
            "actions": {k: _action_counts(v) for k, v in rows.items()},
        }
    return results


def _action_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        for a in r["actions"]:
            counts[a] = counts.get(a, 0) + 1
    return counts


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(results: dict[str, Any], command: str) -> list[str]:
    lines = [
        "# Self-test calibration on real documents",
        "",
        f"`{command}` (figures from the committed outcomes and `bench/cache/selftest.sqlite`).",
        "",
        "Right: normalised exact match with a gold answer or token F1 ≥ 0.8 (`calibrate.is_correct`). "
        'λ = 0.05, the app\'s default. "A guess": P(correct) < 0.5.',
        "",
        "## Shrinkage strength, leave one set out",
        "",
        "Held-out vote log-loss on each set's real questions of the self-test refit, mean over sets:",
        "",
        "| strength | " + " | ".join(_f(s, 0) for s in results["losses"]) + " |",
        "|---" * (len(results["losses"]) + 1) + "|",
        "| loss | " + " | ".join(_f(v) for v in results["losses"].values()) + " |",
        "",
        "Chosen for each set on the other sets: "
        + ", ".join(f"{n} {_f(s, 0)}" for n, s in results["strength"].items()),
        "",
    ]
    pooled_rows: dict[str, list[dict[str, Any]]] = {}
    for name, found in results["sets"].items():
        lines += [*_set_table(name, found), "", *_set_notes(found), ""]
        for strategy, score in found["scores"].items():
            pooled_rows.setdefault(strategy, []).append(score)
    looped = OUT / "loopback.json"
    if looped.exists():
        lines += ["## The cost of a self-test against a loopback OpenAI-compatible server", ""]
        lines += ["`python bench/selftest.py loopback --docs DIR` (a reader that answers at once):", ""]
        for row in json.loads(looped.read_text(encoding="utf-8")):
            lines.append(
                f"- {row['set']}: {row['kept']} kept, {row['calls']} LLM calls, {row['seconds']} s in all"
            )
        lines.append("")
    lines += [
        "## Pooled over the sets (question-weighted)",
        "",
        "| strategy | accuracy | calls | tokens |",
        "|---|---|---|---|",
    ]
    for strategy, rows in pooled_rows.items():
        n = sum(r["n"] for r in rows)
        accuracy, calls, tokens = (
            sum(r[key] * r["n"] for r in rows) / n for key in ("accuracy", "calls", "tokens")
        )
        lines.append(f"| {strategy} | {accuracy:.3f} | {calls:.2f} | {tokens:.0f} |")
    return [*lines, ""]


def _set_notes(found: dict[str, Any]) -> list[str]:
    st, real, synthetic = found["self_test"], found["real_accuracy"], found["self_test_accuracy"]
    y, cost = st["yield"], st["cost"]
    refused = (
        f"{y['names_answer']} named the answer, {y['duplicate']} duplicates, {y['vague']} did not find "
        f"their passage, {y['roundtrip']} failed the roundtrip; {y['no_span']} passages had no answer span"
    )
    minutes = f"{cost['generation_s'] / 60:.1f} min writing, {cost['observation_s'] / 60:.1f} min running"
    return [
        "Actions taken: " + "; ".join(f"{k}: {v}" for k, v in found["actions"].items()),
        "",
        f"Self-test: {y['tried']} questions tried, {st['kept']} kept "
        f"(yield {y['rate']:.2f}; refused: {refused}).",
        f"Cost: {cost['generation_calls']} generation calls; {minutes} every action on the kept questions.",
        "",
        f"Synthetic against real, same documents: R1 right on {synthetic['R1']:.2f} of the self-test "
        f"questions and {real['R1']:.2f} of the real ones; RT on {synthetic['RT']:.2f} and {real['RT']:.2f}.",
    ]


COLUMNS = (
    "accuracy",
    "mean_p",
    "ece",
    "auroc",
    "brier",
    "guesses",
    "guess_right",
    "sure_right",
    "calls",
    "tokens",
    "seconds",
)
LATER = ("wrong_first", "later_after_wrong", "fixed", "broke")


def _set_table(name: str, found: dict[str, Any]) -> list[str]:
    entry = found["entry"]
    where = f"{entry.get('format')}, {entry.get('language')}, {len(entry['files'])} file(s)"
    lines = [
        f"## {name}: {entry.get('package')} {entry.get('version')} ({where})",
        "",
        "| strategy | n | " + " | ".join(COLUMNS) + " | wrong first | later after wrong | fixed | broke |",
        "|---" * (len(COLUMNS) + 6) + "|",
    ]
    for strategy, s in found["scores"].items():
        cells = [_f(s.get(c), 0 if c == "tokens" else 2 if c == "seconds" else 3) for c in COLUMNS] + [
            _f(s.get(c)) for c in LATER
        ]
        lines.append(f"| {strategy} | {s['n']} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("fetch", "observe", "loopback", "report"))
    parser.add_argument("--docs", type=Path, required=True, help="where each set's files are (DIR/<set>/)")
    parser.add_argument("--set", help="observe one set only")
    parser.add_argument("--replay", action="store_true", help="report from the cache alone (no LLM)")
    parser.add_argument("--sets", type=Path, default=SETS, help="the sets' manifest")
    parser.add_argument("--only", default=",".join(PARTS), help="observe these parts (comma-separated)")
    parser.add_argument("--out", type=Path, default=OUT, help="where outcomes go")
    parser.add_argument("--cache", type=Path, default=CACHE, help="the LLM response cache")
    args = parser.parse_args()
    use_sets(args.sets)
    use_folders(args.out, args.cache)
    if args.command == "fetch":
        fetch(args.docs)
    elif args.command == "loopback":
        found = [loopback(entry, args.docs) for entry in sets() if args.set in (None, entry["name"])]
        (OUT / "loopback.json").write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
        print(found)
    elif args.command == "observe":
        for entry in sets():
            if args.set in (None, entry["name"]):
                observe(entry, args.docs, tuple(args.only.split(",")))
    else:
        results = report(args.docs, args.replay)
        (OUT / "report.json").write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
        command = "python bench/selftest.py report --docs DIR" + (" --replay" if args.replay else "")
        write_keeping(RESULTS, markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
