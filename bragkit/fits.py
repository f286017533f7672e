"""A corpus's own fit: the self-test that makes it, and the store that keeps it.

:func:`calibrate_corpus` writes questions from the documents (:mod:`bragkit.selftest`), runs every
action on them (``calibrate.observe``) and refits the model's shipped fit (the documents fit, for a
caller's documents) on what it saw
(``calibrate.self_test_fit``), all under one :class:`SelfTestPlan`'s bounds; :class:`KeptSelfTests`
keeps the owner's fits (``python calibrate.py self-test``) by model and corpus, where the app finds
them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brag
import calibrate
from bragkit import selftest, storage


def self_test_questions(test: selftest.SelfTest) -> list[calibrate.Labelled]:
    """A self-test's kept pairs as labelled questions (ids ``self-N``), for :func:`observe`."""
    return [calibrate.Labelled(f"self-{i}", p.question, (p.answer,)) for i, p in enumerate(test.pairs)]


SELF_TEST_HOPS = 1  # second-hop reads per question it observes (a calibration on benchmarks runs two)
# The share of a self-test's seconds that writing questions may take; running the actions on
# them takes the rest.
SELF_TEST_WRITING_SHARE = 0.5


@dataclass(frozen=True)
class SelfTestPlan:
    """A self-test's settings and bounds: questions to keep, tries, seconds and prompt characters in all."""

    questions: int = 30
    tries: int = 120
    seconds: float = 1800.0
    strength: float = calibrate.SELF_TEST_STRENGTH
    seed: int = 0
    prompt_chars: int = selftest.Budget.prompt_chars  # every prompt of the self-test, in all
    question_chars: int = selftest.Budget.question_chars  # a written question's length at most
    k: int = 5  # passages a read holds, as the controller the fit is for reads them
    actions: tuple[str, ...] | None = None  # what it observes on each question (None: every action)

    def observed(self, base: brag.Calibration) -> tuple[str, ...]:
        """The actions it runs on each kept question: its own, else those ``base`` offers that self-test.

        ``base`` is the fit the self-test refines: an action it does not offer is not offered
        after the refit either, so it is not run; one whose kind is not ``self_tested`` keeps
        ``base``'s entry.
        """
        if self.actions is not None:
            return self.actions
        return tuple(a.label for a in base.offered() if a.kind.self_tested)

    def budget(self) -> selftest.Budget:
        """The generation's share: its tries, twice as many calls (a question and its roundtrip)."""
        return selftest.Budget(
            self.questions,
            self.tries,
            2 * self.tries + 2,
            self.seconds * SELF_TEST_WRITING_SHARE,
            self.prompt_chars,
            self.question_chars,
        )


def calibrate_corpus(
    corpus: brag.Retriever,
    llm: brag.LLM,
    base: brag.Calibration | Mapping[str, Any],
    *,
    generator: brag.LLM | None = None,
    plan: SelfTestPlan = SelfTestPlan(),
    labelled: Sequence[calibrate.Labelled] = (),
    on_progress: Callable[[float, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The self-test calibration of ``corpus`` for ``llm``: write questions, observe, refit.

    ``labelled``: the user's own questions with gold answers, observed and fitted with the
    self-test's. ``on_progress(fraction, what)`` reports as it goes; ``should_stop()`` cancels
    (:class:`selftest.Cancelled`). However few questions pass the checks, or are run before the
    plan's time or prompt characters run out, it ends with a fit on those: on fewer questions the
    refit leans harder on ``base`` (none: ``base`` as it is), and ``fitted_on.checked`` says so.
    """
    # One meter for all of it: the stop, the clock and the prompt characters are asked before
    # every call, while writing questions and while running the actions on them.
    meter = selftest.Meter(plan.seconds, plan.prompt_chars, should_stop)
    started = meter.started
    llm = selftest.Remembered(selftest.Metered(llm, meter))  # a roundtrip is the focused read's call
    generator = selftest.Metered(generator, meter) if generator is not None else None
    test = _written(corpus, llm, generator, plan, on_progress, should_stop)
    items = [*self_test_questions(test), *(i for i in labelled if i.gold)]

    def observed(done: int, total: int) -> None:
        if should_stop is not None and should_stop():
            raise selftest.Cancelled("self-test cancelled")
        if time.monotonic() - started > plan.seconds:
            raise selftest.OutOfBudget("time")
        if on_progress is not None:
            on_progress(
                0.5 + 0.5 * (done / total if total else 1.0),
                f"Running the actions: question {done} of {total}",
            )

    base = brag.load_calibration(base)
    outcomes, ran_out = _observed(items, corpus, llm, base, plan, observed)
    summary = {**test.summary(), "seconds": round(time.monotonic() - started, 1)}
    summary["checked"] = checked_text(summary, plan.questions)
    if ran_out:
        summary["checked"] = "; ".join(
            filter(None, [summary["checked"], _ran_out_text(ran_out, len(outcomes), len(items), plan)])
        )
    return calibrate.self_test_fit(
        base,
        outcomes,
        corpus=corpus.fingerprint(),
        model=brag.llm_name(llm),
        strength=plan.strength,
        hops=SELF_TEST_HOPS,
        k=plan.k,
        meta=summary,
    )


def _ran_out_text(what: str, done: int, total: int, plan: SelfTestPlan) -> str:
    allowed = f"{plan.seconds:g} s" if what == "time" else f"{plan.prompt_chars:,} prompt characters"
    return f"out of {what} ({allowed} allowed) after running the actions on {done} of its {total} questions"


def _observed(
    items: Sequence[calibrate.Labelled],
    corpus: brag.Retriever,
    llm: brag.LLM,
    base: brag.Calibration,
    plan: SelfTestPlan,
    on_question: Callable[[int, int], None],
) -> tuple[list[calibrate.Outcome], str]:
    """Every action of the plan on each question in turn, as the controller the fit is for runs them.

    Its reads are the controller's (its seed, ``plan.k`` passages): a focused read of a
    question's own passage is the roundtrip's request, answered without a second call. When
    the plan's time or prompt characters run out, the questions done so far and what ran out.
    """
    settings = {"lam": 0.0, "k": plan.k, "m": base.m, "hops": SELF_TEST_HOPS}
    controller = calibrate.observer(llm, plan.observed(base), None, settings, base.table)
    outcomes: list[calibrate.Outcome] = []
    for item in [*items, None]:  # None: the last report of progress, once every question is done
        try:
            on_question(len(outcomes), len(items))
            if item is not None:
                outcomes += calibrate.observe([item], corpus, controller)
        except selftest.OutOfBudget as out:
            return outcomes, str(out) if item is not None else ""
        except brag.RunAborted as err:
            if isinstance(err.__cause__, selftest.Cancelled):
                raise selftest.Cancelled("self-test cancelled") from None
            if isinstance(err.__cause__, selftest.OutOfBudget):
                return outcomes, str(err.__cause__)
            raise
    return outcomes, ""


def _written(
    corpus: brag.Retriever,
    llm: brag.LLM,
    generator: brag.LLM | None,
    plan: SelfTestPlan,
    on_progress: Callable[[float, str], None] | None,
    should_stop: Callable[[], bool] | None,
) -> selftest.SelfTest:
    """The self-test's questions, the first half of its progress: as many as passed the checks."""

    def written(kept: int, wanted: int, verdict: str) -> None:
        if on_progress is not None:
            on_progress(0.5 * kept / wanted, f"Writing questions: {kept} of {wanted} kept")

    test = selftest.self_test(
        corpus,
        llm,
        generator=generator,
        budget=plan.budget(),
        seed=plan.seed,
        on_progress=written,
        should_stop=should_stop,
    )
    if test.stopped == "cancelled":
        raise selftest.Cancelled("self-test cancelled")
    return test


def checked_text(summary: Mapping[str, Any], wanted: int) -> str:
    """What a self-test could not check, in words ("" when it kept all it wanted).

    A short document gives few questions that pass the checks: the fit then rests on fewer
    questions and leans harder on the fit it refines (its strength in pseudo-questions is the
    same, so each question weighs less against it).
    """
    found = summary.get("yield") or {}
    kept, tried = int(found.get("kept", 0)), int(found.get("tried", 0))
    if kept >= wanted:
        return ""
    why = {"passages": "the documents gave no more questions", "time": "its time ran out"}.get(
        str(summary.get("stopped", "")), f"it ran out of {summary.get('stopped') or 'tries'}"
    )
    if not kept:
        return (
            f"none of the {tried} questions written from these documents passed the checks ({why}): "
            "the fit it refines is kept as it is"
        )
    return (
        f"{kept} of the {wanted} questions wanted passed the checks ({tried} written; {why}): "
        "the fit leans harder on the one it refines"
    )


class KeptSelfTests:
    """Self-test calibrations by model and corpus fingerprint, one JSON file each, in ``folder``.

    A file's name is a digest of the two, never a caller's text, so no request picks a path.
    The oldest go first beyond ``limit`` files.
    """

    def __init__(self, folder: Path, limit: int = 500) -> None:
        self.folder, self.limit = folder, limit

    def path(self, model: str, fingerprint: str) -> Path:
        """Where the fit for this model and corpus is kept."""
        digest = hashlib.sha256(f"{model}\n{fingerprint}".encode()).hexdigest()[:32]
        return self.folder / f"selftest-{digest}.json"

    def load(self, model: str, fingerprint: str) -> brag.Calibration | None:
        """The kept fit for this model and corpus, or None (an unreadable one is passed over)."""
        path = self.path(model, fingerprint)
        if not path.is_file():
            return None
        try:
            found = brag.load_calibration(path)
        except (OSError, ValueError):
            return None
        same = found.meta.get("model") == model and found.meta.get("corpus") == fingerprint
        return found if same else None

    def keep(self, fitted: Mapping[str, Any]) -> Path:
        """Write ``fitted`` (a :func:`calibrate_corpus` result) where :meth:`load` finds it."""
        path = self.path(str(fitted["model"]), str(fitted["corpus"]))
        self.folder.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(path, json.dumps(fitted, indent=1))
        kept = sorted(self.folder.glob("selftest-*.json"), key=lambda p: p.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self.limit)]:
            old.unlink(missing_ok=True)
        return path


def kept_self_tests(cache: Path | None = None) -> KeptSelfTests:
    """The kept self-test fits under ``BRAG_CACHE_DIR`` (or ``cache``)."""
    return KeptSelfTests((cache or brag.cache_dir()) / "selftest")
