"""A corpus's own fit: the self-test that makes it, and the store that keeps it.

:func:`calibrate_corpus` writes questions from the documents (:mod:`bragkit.selftest`), runs every
action on them (``calibrate.observe``) and refits the model's shipped fit (the documents fit, for a
caller's documents) on what it saw
(``calibrate.self_test_fit``), all under one :class:`SelfTestPlan`'s bounds; :class:`FitStore`
keeps every fit on disk: the owner's (``python calibrate.py self-test``) by model and corpus,
where the app finds them, and the callers' (/calibrate) by name, per address.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    should_yield: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The self-test calibration of ``corpus`` for ``llm``: write questions, observe, refit.

    ``labelled``: the user's own questions with gold answers, observed and fitted with the
    self-test's. ``on_progress(fraction, what)`` reports as it goes; ``should_stop()`` cancels
    (:class:`selftest.Cancelled`); ``should_yield()`` ends its turn (others wait for the lane).
    However few questions pass the checks, or are run before the plan's time, its prompt
    characters or its turn run out, it ends with a fit on those: on fewer questions the
    refit leans harder on ``base`` (none: ``base`` as it is), and ``fitted_on.checked`` says so.
    """
    # One meter for all of it: the stop, the clock and the prompt characters are asked before
    # every call, while writing questions and while running the actions on them.
    meter = selftest.Meter(plan.seconds, plan.prompt_chars, should_stop, should_yield=should_yield)
    started = meter.started
    llm = selftest.Remembered(selftest.Metered(llm, meter))  # a roundtrip is the focused read's call
    generator = selftest.Metered(generator, meter) if generator is not None else None
    test = _written(corpus, llm, generator, plan, on_progress, should_stop)
    items = [*self_test_questions(test), *(i for i in labelled if i.gold)]

    def observed(done: int, total: int) -> None:
        if should_stop is not None and should_stop():
            raise selftest.Cancelled("self-test cancelled")
        meter.check()  # the clock and the lane's turn, between questions too
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
    after = f"after running the actions on {done} of its {total} questions"
    if what == "turn":
        return f"its turn ended (others were waiting for the self-test lane) {after}"
    allowed = f"{plan.seconds:g} s" if what == "time" else f"{plan.prompt_chars:,} prompt characters"
    return f"out of {what} ({allowed} allowed) {after}"


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


def fair_evictions(
    entries: Iterable[tuple[str, float, Any]], owner: str, per_owner: int, total: int
) -> list[Any]:
    """Which of ``entries`` (owner, last used, key) go, so that no one can push another's out.

    ``owner`` (who just added one) keeps at most ``per_owner``, its least recently used going
    first; past ``total`` in all, the least recently used of whoever keeps the most goes.
    """
    held: dict[str, list[tuple[float, Any]]] = {}
    for who, used, key in entries:
        held.setdefault(who, []).append((used, key))
    for kept in held.values():
        kept.sort(key=lambda entry: entry[0])
    gone = []
    mine = held.get(owner, [])
    while len(mine) > max(1, per_owner):
        gone.append(mine.pop(0)[1])
    count = sum(len(kept) for kept in held.values())
    while count > max(1, total):
        most = max((who for who in held if held[who]), key=lambda who: (len(held[who]), -held[who][0][0]))
        gone.append(held[most].pop(0)[1])
        count -= 1
    return gone


class FitStore:
    """Every fit kept on disk, one JSON file each, under one folder, and found by name.

    A name is ``fit-`` and 12 hex digits, and only a name of that form ever becomes a file name,
    so no caller's text picks a path. Two kinds of fit live here:

    - a caller's (``keep``): what /calibrate made, named by its content, in a folder of the
      address that made it (a digest); one address keeps at most ``per_caller``, its least
      recently used going first, and past ``limit`` in all one goes from whoever keeps the most,
      so no caller can push another's out;
    - the owner's self-test of a corpus (``keep_own``, ``python calibrate.py self-test``): named
      by its model and corpus fingerprint, in the owner's folder, which callers never evict (the
      oldest go past ``limit``); ``own`` finds it, and /brag uses it for everyone.
    """

    NAME = re.compile(r"^fit-[0-9a-f]{12}$")
    OWNER = "owner"  # the owner's folder

    def __init__(self, folder: Path, limit: int = 500, per_caller: int = 20) -> None:
        self.folder, self.limit, self.per_caller = folder, limit, per_caller
        self._lock = threading.Lock()

    @staticmethod
    def own_name(model: str, fingerprint: str) -> str:
        """The name of the owner's fit of ``model`` over the corpus of ``fingerprint``."""
        return "fit-" + _digest(model, fingerprint)[:12]

    def path(self, name: str) -> Path | None:
        """The file of a kept fit, for a name of the kept form that exists; else None."""
        if not self.NAME.match(name):
            return None
        # A caller's fit kept before fits had owners' folders lies at the top.
        candidates = [self.folder / self.OWNER / f"{name}.json", self.folder / f"{name}.json"]
        for found in [*candidates, *self.folder.glob(f"a-*/{name}.json")]:
            if found.is_file():
                return found
        return None

    def load(self, name: str) -> brag.Calibration:
        """A kept fit by name; it counts as used now (the least recently used go first)."""
        path = self.path(name) if isinstance(name, str) else None
        if path is None:
            raise brag.InputError(f"no kept calibration is named {brag._shown(name)}; run /calibrate again")
        try:
            found = brag.load_calibration(path)
        except brag.InputError:
            unreadable = f"the kept calibration {name} cannot be read; run /calibrate again"
            raise brag.InputError(unreadable) from None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: it was read whole
        return found

    def keep(self, fitted: Mapping[str, Any], caller: str = "") -> str:
        """Store a fit that ``caller`` (an address) made, and return its name."""
        digest = hashlib.sha256(json.dumps(fitted, sort_keys=True).encode()).hexdigest()
        name = f"fit-{digest[:12]}"
        folder = self.folder / f"a-{hashlib.sha256(caller.encode()).hexdigest()[:16]}"
        with self._lock:
            storage.write_atomic(folder / f"{name}.json", json.dumps({**fitted, "name": name}, indent=1))
            entries = []
            for path in [*self.folder.glob("fit-*.json"), *self.folder.glob("a-*/fit-*.json")]:
                try:
                    entries.append((path.parent.name, path.stat().st_mtime, path))
                except OSError:
                    continue
            for old in fair_evictions(entries, folder.name, self.per_caller, self.limit):
                old.unlink(missing_ok=True)
        return name

    def keep_own(self, fitted: Mapping[str, Any]) -> Path:
        """Store the owner's self-test fit (a :func:`calibrate_corpus` result) where :meth:`own` finds it."""
        name = self.own_name(str(fitted["model"]), str(fitted["corpus"]))
        path = self.folder / self.OWNER / f"{name}.json"
        with self._lock:
            storage.write_atomic(path, json.dumps({**fitted, "name": name}, indent=1))
            kept = sorted(path.parent.glob("fit-*.json"), key=lambda p: p.stat().st_mtime)
            for old in kept[: max(0, len(kept) - self.limit)]:
                old.unlink(missing_ok=True)
        return path

    def own(self, model: str, fingerprint: str) -> brag.Calibration | None:
        """The owner's fit of ``model`` over this corpus, or None (an unreadable one is passed over).

        A fit kept before the store was one (``selftest/`` beside this folder) is found too.
        """
        candidates = [
            self.folder / self.OWNER / f"{self.own_name(model, fingerprint)}.json",
            self.folder.parent / "selftest" / f"selftest-{_digest(model, fingerprint)[:32]}.json",
        ]
        for path in candidates:
            try:
                found = brag.load_calibration(path) if path.is_file() else None
            except (OSError, ValueError):
                continue
            meta = found.meta if found is not None else {}
            if found is not None and (meta.get("model"), meta.get("corpus")) == (model, fingerprint):
                return found
        return None


def _digest(model: str, fingerprint: str) -> str:
    return hashlib.sha256(f"{model}\n{fingerprint}".encode()).hexdigest()


def fit_store(cache: Path | None = None, limit: int = 500, per_caller: int = 20) -> FitStore:
    """The kept fits under ``BRAG_CACHE_DIR`` (or ``cache``): ``calibrations/``."""
    return FitStore((cache or brag.cache_dir()) / "calibrations", limit, per_caller)
