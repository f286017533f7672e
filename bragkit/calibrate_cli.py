"""``python calibrate.py ...``: the command lines of calibration.

``calibrate.py`` is the fitting API and imports nothing from ``bragkit``; run as a script, it
hands its arguments here (as ``python -m brag`` hands them to ``bragkit.cli``). Four commands:
a fit from labelled questions (the default), ``gate`` (the weak-retrieval gate alone, no LLM),
``pool`` (one fit from several fits' outcomes) and ``self-test`` (a corpus's own fit from
questions written from its documents).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import brag
import calibrate
from bragkit import documents, fits, llms, selftest, storage
from bragkit import milvus as milvus_corpus


def main_gate(argv: Sequence[str]) -> int:
    """``python calibrate.py gate``: fit the weak-retrieval gate alone (no LLM)."""
    parser = argparse.ArgumentParser(
        prog="calibrate.py gate", description="Fit the weak-retrieval gate (no LLM)."
    )
    parser.add_argument("--questions", required=True, help="questions whose supporting passages are known")
    parser.add_argument("--corpus", help="corpus JSON (or --milvus and --collection)")
    milvus_corpus.add_arguments(parser)
    parser.add_argument("--split", default="0:100")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--target-recall", type=float, help="threshold for this share of weak windows caught")
    parser.add_argument("--into", help="a calibration JSON whose 'gate' section to replace")
    parser.add_argument("--out", help="where to write (default: --into, else standard output)")
    args = parser.parse_args(argv)
    try:
        items = calibrate.select(calibrate.read_labelled(args.questions), args.split)
        corpus = corpus_from_args(args)
        rows = calibrate.gate_rows(items, corpus, args.k)
        gate = calibrate.fit_gate(rows, k=args.k, target_recall=args.target_recall)
        result: dict[str, Any] = gate
        if args.into:
            result = {**json.loads(Path(args.into).read_text(encoding="utf-8")), "gate": gate}
            brag.load_calibration(result)
    except (ValueError, OSError) as err:
        print(f"calibrate gate: {err}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1) + "\n"
    out = args.out or args.into
    if out:
        storage.write_atomic(out, text)
    else:
        sys.stdout.write(text)
    return 0


EVIDENCE_HELP = (
    "how a read's votes vary with their evidence: 'curve', each its own reliability; 'levels', "
    "two levels (default: curve; pool: as the fits pooled were fitted)"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: calibrate and write the JSON (``gate`` as the first word: the gate alone)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gate"]:
        return main_gate(argv[1:])
    if argv[:1] == ["pool"]:
        return main_pool(argv[1:])
    if argv[:1] == ["self-test"]:
        return main_self_test(argv[1:])
    args = _parser(llms.CACHE_MODES).parse_args(argv)
    try:
        result = _calibrate_from_args(args)
    except (ValueError, OSError, llms.LLMError, brag.RunAborted) as err:
        print(f"calibrate: {err}", file=sys.stderr)
        return 2
    storage.write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    # The outcomes stay beside the fit, so `calibrate.py pool` can fit them with other sets.
    Path(f"{args.out}.progress.jsonl").replace(calibrate.outcomes_path(args.out))
    print(
        f"wrote {args.out}: eta {result['eta']}, "
        + ", ".join(f"{a} acc {result['diagnostics'][a]['accuracy']:.2f}" for a in result["actions"])
    )
    return 0


def main_pool(argv: Sequence[str]) -> int:
    """``calibrate.py pool FIT.json ... --out POOLED.json``: one fit from several fits' outcomes."""
    parser = argparse.ArgumentParser(
        prog="calibrate.py pool",
        description="Fit one calibration per model from the outcomes of several calibrations.",
    )
    parser.add_argument(
        "fits", nargs="+", help="calibration files, each with its NAME.outcomes.jsonl beside it"
    )
    parser.add_argument("--evidence", choices=calibrate.EVIDENCE_VARIANTS, help=EVIDENCE_HELP)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        sets = [(brag.read_json(Path(f), "calibration"), calibrate.read_outcomes(f)) for f in args.fits]
        result = calibrate.pool(sets, meta={"name": Path(args.out).stem}, evidence=args.evidence)
    except (ValueError, OSError) as err:
        print(f"calibrate pool: {err}", file=sys.stderr)
        return 2
    storage.write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(
        f"wrote {args.out}: pooled {result['n_questions']} questions from {', '.join(result['pooled_from'])}"
    )
    return 0


def main_self_test(argv: Sequence[str]) -> int:
    """``calibrate.py self-test FILE... --out FIT.json``: a corpus's fit from questions written from it."""
    parser = argparse.ArgumentParser(
        prog="calibrate.py self-test",
        description="Calibrate BRAG on documents without labels: it writes questions from them, checks "
        "them, runs the actions and refits the model's documents fit. The fit is also kept for the model "
        "and corpus (BRAG_CACHE_DIR), where the app finds it.",
    )
    parser.add_argument("files", nargs="+", help="documents (PDF, HTML, Word, Markdown, text)")
    parser.add_argument(
        "--model", default="local", help="make_llm spec of the reader (default: the embedded model)"
    )
    parser.add_argument(
        "--generator", help="make_llm spec of the model that writes the questions (default: the reader)"
    )
    parser.add_argument("--questions", help="your own labelled questions, added to the self-test's")
    parser.add_argument("--keep", type=int, default=fits.SelfTestPlan.questions, help="questions to keep")
    seconds = fits.SelfTestPlan.seconds
    parser.add_argument("--seconds", type=float, default=seconds, help="time allowed in all")
    parser.add_argument("--cache", default=str(brag.cache_dir() / "llm.sqlite"), help="SQLite response cache")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        passages = [p for f in args.files for p in documents.read_file(Path(f).name, Path(f).read_bytes())]
        corpus = brag.Corpus(passages)
        llm = llms.CachedLLM(llms.make_llm(args.model), args.cache)
        writer = llms.CachedLLM(llms.make_llm(args.generator), args.cache) if args.generator else None
        own = calibrate.read_labelled(args.questions) if args.questions else []
        plan = fits.SelfTestPlan(questions=args.keep, tries=4 * args.keep, seconds=args.seconds)
        base = brag.shipped_calibration(brag.llm_name(llm))  # no corpus name: the documents fit
        result = fits.calibrate_corpus(
            corpus,
            llm,
            base,
            generator=writer,
            plan=plan,
            labelled=own,
            on_progress=lambda fraction, what: print(f"{fraction:4.0%} {what}", file=sys.stderr),
        )
    except (ValueError, OSError, llms.LLMError, brag.RunAborted, selftest.Cancelled) as err:
        print(f"calibrate self-test: {err}", file=sys.stderr)
        return 2
    result = {**result, "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    storage.write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    kept = fits.fit_store().keep_own(result)  # the owner's: the app uses it for everyone who asks
    print(f"wrote {args.out} (kept as {kept}): {brag.self_test_text(result['fitted_on'])}")
    return 0


def corpus_from_args(args: argparse.Namespace) -> brag.Retriever:
    """``--corpus FILE``, or ``--milvus URI --collection NAME``: exactly one of them."""
    if bool(args.milvus or args.collection) == bool(args.corpus):
        raise brag.InputError("give the corpus as --corpus FILE or as --milvus URI --collection NAME (one)")
    milvus = milvus_corpus.from_arguments(args)
    return milvus if milvus is not None else brag.Corpus(Path(args.corpus).read_text(encoding="utf-8"))


def _parser(cache_modes: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Fit a BRAG calibration from labelled questions.")
    parser.add_argument(
        "--questions", required=True, help="labelled questions (any layout of ../shared/data)"
    )
    parser.add_argument(
        "--unlabelled",
        action="store_true",
        help="questions may lack gold answers (strings, {question}, JSON Lines): fitted by EM, checked",
    )
    parser.add_argument(
        "--corpus", help="corpus JSON: list of {title, text} or strings (or --milvus and --collection)"
    )
    milvus_corpus.add_arguments(parser)
    parser.add_argument("--split", default="0:100", help="which questions, as start:stop (default 0:100)")
    parser.add_argument("--model", default="local", help="make_llm spec (default: the embedded model)")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument(
        "--hops", type=int, default=brag.DEFAULT_HOPS, help="second-hop reads (R2) run per question"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="questions at once (for an endpoint that serves many)"
    )
    parser.add_argument("--f1", type=float, default=0.8, help="token F1 that counts as correct")
    parser.add_argument(
        "--actions",
        default=",".join(calibrate.default_actions()),
        help=f"the actions to observe and fit, of {', '.join(brag.action_labels())} (default: %(default)s)",
    )
    parser.add_argument(
        "--evidence", choices=calibrate.EVIDENCE_VARIANTS, default="curve", help=EVIDENCE_HELP
    )
    parser.add_argument("--cache", default="bench/cache/llm.sqlite", help="SQLite response cache")
    parser.add_argument("--cache-mode", default="read-write", choices=cache_modes)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", help="corpus name to record (default: the corpus file name)")
    return parser


def _calibrate_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Read the questions and the corpus, run every action with a progress bar, and fit."""
    from tqdm import tqdm

    read = calibrate.read_questions if args.unlabelled else calibrate.read_labelled
    items = calibrate.select(read(args.questions), args.split)
    corpus = corpus_from_args(args)
    llm = llms.CachedLLM(llms.make_llm(args.model, provider=args.provider), args.cache, mode=args.cache_mode)
    bar = tqdm(total=len(items), desc="calibrating", unit="q")

    def progress(done: int, total: int) -> None:
        bar.set_postfix(calls=llm.hits + llm.misses, cache_hits=llm.hits, refresh=False)
        bar.update(done - bar.n)

    result = calibrate.calibrate(
        items,
        corpus,
        llm,
        k=args.k,
        m=args.m,
        hops=args.hops,
        f1_threshold=args.f1,
        progress_path=f"{args.out}.progress.jsonl",
        on_progress=progress,
        workers=args.workers,
        actions=[label.strip() for label in args.actions.split(",") if label.strip()],
        evidence=args.evidence,
        meta={
            "name": Path(args.out).stem,
            "model_spec": args.model,
            "corpus": args.name or (Path(args.corpus).name if args.corpus else args.collection),
            "questions_file": Path(args.questions).name,
            "split": args.split,
            "note": f"fitted by calibrate.py on questions {args.split} of {Path(args.questions).name}",
        },
    )
    bar.close()
    return result
