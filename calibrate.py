r"""Calibration: fit BRAG's hyperpriors for one model and one corpus from labelled questions.

Every action runs on every question (R1; R2 with R1's follow-up query; CB with m samples) through
the response cache, and each finished question is appended to a progress file, so an
interrupted run continues where it stopped and repeats no LLM call. Fitting (SPEC section 4):

- q_a, the answer rate: Beta posterior mean under a prior of strength ``PRIOR_STRENGTH``
  centred on the weak prior of each action's row (``prior_values``);
- rho_a, reliability among answers: the same shrinkage; stored as Beta(a, b) with a + b =
  ``CONCENTRATION`` (one vote per type per question cannot identify the spread, only the mean);
- pi_g (Dirichlet(1) smoothing) and kappa_g (shrunk like rho) per CB agreement level g;
- eta: how often a wrong vote repeats an earlier wrong answer on the same question, Beta(1, 9).

    python calibrate.py --questions ../shared/data/hotpotqa/hotpotqa_ircot500.json \\
        --corpus ../shared/data/hotpotqa/hotpotqa_ircot500_corpus.json --split 0:100 \\
        --model local --out data/calibrations/my-fit.json
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import brag

MIN_QUESTIONS = 30
PRIOR_STRENGTH = 4.0  # pseudo-observations pulling each fitted rate toward its row's prior
CONCENTRATION = brag.PRIOR_CONCENTRATION  # a + b of each fitted reliability Beta
ETA_PRIOR = (1.0, 9.0)  # Beta prior on eta: mean 0.1
# The weak prior every fit shrinks toward (hand-set before any data: data/calibration_prior.json,
# which prior_text describes). kappa_0(g) for m samples is 0.1 + 0.6 g / m: more agreement, more reliable.
PRIOR_ETA = 0.1


# The rows a fit's labels name: the shipped table unless a caller fits rows of its own (BRAG's ``actions``).
Table = Sequence[brag.Action]


def prior_values(table: Table = brag.ACTION_TABLE) -> dict[str, Any]:
    """The hand-set q and rho of each action of ``table``, and eta."""
    return {
        "q": {a.label: a.prior_q for a in table},
        "rho": {a.label: a.prior_rho for a in table if a.prior_rho is not None},
        "eta": PRIOR_ETA,
    }


def prior_rho(label: str, table: Table = brag.ACTION_TABLE) -> float:
    """An action's hand-set P(right | answered), from its row (0.5 when its row sets none)."""
    rho = brag.action_named(label, table).prior_rho
    return 0.5 if rho is None else rho


def prior_text(fitted: Sequence[str], table: Table = brag.ACTION_TABLE) -> str:
    """The weak prior a fit of the actions ``fitted`` shrank toward, in words (the file's ``prior``)."""
    prior = prior_values(table)
    q = ", ".join(f"q_{a} {v:g}" for a, v in prior["q"].items() if a in fitted)
    rhos = {a: v for a, v in prior["rho"].items() if a in fitted}
    if len(set(rhos.values())) == 1:
        rho = " = ".join(f"rho_{a}" for a in rhos) + f" = {next(iter(rhos.values())):g}"
    else:
        rho = ", ".join(f"rho_{a} {v:g}" for a, v in rhos.items())
    return (
        f"each rate shrunk toward a weak prior with {PRIOR_STRENGTH:g} pseudo-observations: {q}, "
        f"{rho}; kappa_g toward the closed-book precision over all "
        "levels (itself toward the mean of 0.1 + 0.6 g/m), then made non-decreasing in g; pi_g uniform "
        f"(Dirichlet(1)); eta ~ Beta{ETA_PRIOR}; reliabilities stored as Beta with a + b = {CONCENTRATION:g}"
    )


prior_kappa = brag.prior_kappa


def default_actions(table: Table = brag.ACTION_TABLE) -> tuple[str, ...]:
    """What calibration observes and fits unless told which actions to fit (calibrate.py --actions)."""
    return tuple(a.label for a in table if a.fitted)


def closed_book_reliabilities(tallies: Sequence[tuple[int, int]]) -> list[float]:
    """kappa_g per agreement level from (right, votes) per level g = 1..m.

    Each level is shrunk toward the model's own closed-book precision over all levels (itself
    shrunk toward the hand-set prior's mean), not toward the hand-set prior: a weak model rarely
    reaches high agreement, and a hand-set 0.7 at g = m, met by one or two votes, made closed-book
    look like its best source. Then pool adjacent violators so kappa never falls as g rises.
    """
    m = len(tallies)
    right_all, votes_all = sum(r for r, _ in tallies), sum(n for _, n in tallies)
    pooled = shrunk(right_all, votes_all, float(np.mean([prior_kappa(g, m) for g in range(1, m + 1)])))
    return _non_decreasing(
        [shrunk(r, n, pooled) for r, n in tallies], [n + PRIOR_STRENGTH for _, n in tallies]
    )


def _non_decreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    merged: list[list[float]] = []  # value, weight, how many values it stands for
    for value, weight in zip(values, weights, strict=True):
        merged.append([value, weight, 1])
        while len(merged) > 1 and merged[-2][0] > merged[-1][0]:
            (v1, w1, k1), (v2, w2, k2) = merged[-2], merged.pop()
            merged[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2]
    return [value for value, _, count in merged for _ in range(int(count))]


# ------------------------------------------------------------------------------------------
# Labelled questions in every layout of ../shared/data
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Labelled:
    """A question, its gold answers (none: unlabelled), and its supporting passages' titles when known."""

    id: str
    question: str
    gold: tuple[str, ...]
    supporting: tuple[str, ...] = ()


def _labelled(item: Any, index: int, gold_required: bool = True) -> Labelled:
    if isinstance(item, str) and not gold_required:
        item = {"question": item}
    if not isinstance(item, dict):
        raise brag.InputError(f"labelled[{index}]: expected an object, got {type(item).__name__}")
    question = item.get("question")
    if not isinstance(question, str) or not question.strip():
        raise brag.InputError(f"labelled[{index}]: 'question' is missing or empty")
    qid = str(item.get("id", item.get("_id", index)))
    supporting: list[str] = []
    if "gold" in item:  # our own layout
        gold = item["gold"]
        gold = [gold] if isinstance(gold, str) else gold
    elif "answer_aliases" in item:  # MuSiQue
        gold = [item.get("answer"), *item.get("answer_aliases", [])]
        supporting = [p["title"] for p in item.get("paragraphs", []) if p.get("is_supporting")]
    elif "paragraphs" in item:  # HippoRAG sample layout (IRCoT HotpotQA)
        gold = item.get("answer")
        gold = [gold] if isinstance(gold, str) else gold
        supporting = [p["title"] for p in item["paragraphs"] if p.get("is_supporting")]
    elif "_id" in item and "answer" in item:  # raw HotpotQA / 2WikiMultihopQA
        gold = [item["answer"]]
        supporting = sorted({fact[0] for fact in item.get("supporting_facts", [])})
    elif not gold_required and not {"answer", "answers", "gold_answers"} & set(item):
        return Labelled(qid, " ".join(question.split()), ())
    else:
        raise brag.InputError(
            f"labelled[{index}]: unknown layout with fields {sorted(item)}; expected "
            '{"question", "gold": [...]} or a HotpotQA / 2WikiMultihopQA / MuSiQue item'
        )
    if not gold_required and (not gold or gold == [""]):  # an empty gold: this question is unlabelled
        return Labelled(qid, " ".join(question.split()), (), tuple(supporting))
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) and g.strip() for g in gold):
        raise brag.InputError(
            f"labelled[{index}]: gold answers are missing (need a non-empty list of strings)"
        )
    return Labelled(qid, " ".join(question.split()), tuple(gold), tuple(supporting))


def read_labelled(source: str | os.PathLike[str] | Sequence[Any]) -> list[Labelled]:
    """Labelled questions from a list, a JSON string, or a JSON / JSON Lines file."""
    source = brag.read_json(source, "labelled questions")
    if not isinstance(source, list):
        raise brag.InputError("labelled questions: expected a JSON list of {question, gold} objects")
    return [_labelled(item, i) for i, item in enumerate(source)]


def read_questions(source: str | os.PathLike[str] | Sequence[Any]) -> list[Labelled]:
    """Questions with or without gold answers, for an unlabelled or mixed fit.

    A JSON list of strings or of ``{"question", "gold"?}`` objects (or any labelled layout),
    from a list, a JSON string, JSON Lines text, or a JSON / JSON Lines file.
    """
    if isinstance(source, str) and source.lstrip().startswith("{"):  # JSON Lines text
        lines = [line for line in source.splitlines() if line.strip()]
        source = "[" + ",".join(lines) + "]"
    source = brag.read_json(source, "questions")
    if not isinstance(source, list):
        raise brag.InputError(
            'questions: expected a JSON list of strings or of {"question", "gold"?} objects'
        )
    return [_labelled(item, i, gold_required=False) for i, item in enumerate(source)]


def select(items: list[Labelled], split: str) -> list[Labelled]:
    """A ``start:stop`` slice of the file order (the split's ids go into the output)."""
    try:
        start, _, stop = split.partition(":")
        return items[slice(int(start) if start else None, int(stop) if stop else None)]
    except ValueError:
        raise brag.InputError(f"split must look like 0:100, got {split!r}") from None


# ------------------------------------------------------------------------------------------
# Observing every action on every question (resumable)
# ------------------------------------------------------------------------------------------


is_correct = brag.is_correct  # what calibration counts as right: exact match, or token F1 >= 0.8


@dataclass
class Outcome:
    """What each action observed returned on one question ('' = no answer), by its label.

    ``answers`` and ``correct`` hold every action observed (a second hop's: its first read);
    ``agreement`` each samples action's agreement level; ``evidence`` each read's evidence
    features; ``hops`` each second hop's reads in order, each with its answer, whether it was
    right, whether it repeats an earlier read's answer, and whether an earlier read had
    answered right. :class:`KindFit` says what each kind records.
    """

    id: str
    answers: dict[str, str]
    correct: dict[str, bool]
    agreement: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    weak: dict[str, bool | None] = field(default_factory=dict)  # the gate's verdict per window
    hops: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    usage: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # each run's cost, per action
    labelled: bool = True  # False: no gold answer, so ``correct`` and the hops' flags mean nothing
    evidence: dict[str, dict[str, float | None]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Outcome:
        """An outcome as :func:`observe` saved it, or as saved before actions were kinds.

        Those files recorded one action of each kind, the table's first: ``agreement`` was its
        samples action's level, ``evidence`` its read's features, ``hops`` its second hop's reads.
        """
        row = dict(row)
        if not isinstance(row.get("agreement", {}), dict):
            first = {a.kind.fit_shape: a.label for a in reversed(brag.ACTION_TABLE)}
            row["agreement"] = {first["samples"]: row["agreement"]}
            row["hops"] = {first["hop"]: row.get("hops", [])}
            row["evidence"] = {first["read"]: row.get("evidence", {})}
        return cls(**row)


def observe_one(item: Labelled, corpus: brag.Corpus, controller: brag.BRAG, f1_threshold: float) -> Outcome:
    """Run every action the controller offers on one question, a second hop as often as it allows."""
    schedule = [a.label for a in controller.offered for _ in range(fit_of(a).runs(controller.hops))]
    report = controller.ask(item.question, corpus, actions=schedule)
    outcome = Outcome(item.id, dict.fromkeys((a.label for a in controller.offered), ""), {})
    kinds = {a.label: fit_of(a) for a in controller.offered}
    reads: list[tuple[str, bool]] = []  # (answer, right) of every read so far
    for step in report.steps:
        seen, label = step.observation, step.action
        if label is None or seen is None:
            continue
        outcome.usage.setdefault(label, []).append(dict(step.cost or {}))
        right = is_correct(seen.answer, item.gold, f1_threshold)
        kinds[label].observe(outcome, label, seen, right, reads)
        gate = seen.details.get("gate")
        if label not in outcome.weak and gate:  # the first window of each action
            outcome.weak[label] = gate["weak"]
    outcome.correct = {a: is_correct(got, item.gold, f1_threshold) for a, got in outcome.answers.items()}
    outcome.calls, outcome.labelled = report.totals["llm_calls"], bool(item.gold)
    return outcome


def progress_key(
    llm: brag.LLM,
    corpus: brag.Retriever,
    k: int,
    m: int,
    hops: int,
    seed: int,
    f1_threshold: float,
    actions: Sequence[str] | None = None,
) -> str:
    """What observed outcomes depend on: the model, the corpus, the settings, the actions, the prompts."""
    brag.check_retriever(corpus)  # its fingerprint is part of the key
    prompts = [brag.read_messages("Q", []), brag.closed_book_messages("Q"), brag.READ_STOP]
    payload = [brag.llm_name(llm), corpus.fingerprint(), k, m, hops, seed, f1_threshold, prompts]
    actions = default_actions() if actions is None else tuple(actions)
    if actions != default_actions():  # the key of a default fit is what it always was
        payload.append(list(actions))
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def read_progress(path: Path, key: str | None) -> dict[str, Outcome]:
    """Outcomes saved by an earlier run with the same ``key`` (None: any); a clear error for a damaged file.

    A last line cut short (the run was killed while writing it) is dropped, so that question
    runs again; any other damage names the file and the line.
    """
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    what = f"calibration progress file {path}"
    if not lines or not lines[0].strip():
        return {}
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or "progress_key" not in header:
        raise brag.InputError(f"{what} has no valid header line; delete it to start the calibration over")
    if key is not None and header["progress_key"] != key:
        raise brag.InputError(f"{what} belongs to another model, corpus or setting; delete it to start over")
    done: dict[str, Outcome] = {}
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            done[row["id"]] = Outcome.from_dict(row)
        except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            raise brag.InputError(
                f"{what}, line {number}, is damaged ({type(err).__name__}); delete the file to start the "
                "calibration over"
            ) from None
    return done


def observe(
    items: Sequence[Labelled],
    corpus: brag.Corpus,
    controller: brag.BRAG,
    *,
    progress_path: str | os.PathLike[str] | None = None,
    progress: str = "",
    f1_threshold: float = 0.8,
    on_progress: Callable[[int, int], None] | None = None,
    workers: int = 1,
) -> list[Outcome]:
    """Outcomes for every item, in order; those already in ``progress_path`` (same key) are read.

    ``workers`` questions run at once (threads; each question's actions stay in order). Every
    request is the one a sequential run makes, so the cache, the outcomes and the fit are the
    same; each finished question is saved at once, so an interrupted run resumes either way.
    """
    path = Path(progress_path) if progress_path else None
    done = read_progress(path, progress) if path else {}
    if path and not done:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"progress_key": progress}) + "\n", encoding="utf-8")
    lock = threading.Lock()
    todo = [item for item in items if item.id not in done]
    finished = len(items) - len(todo)

    def work(item: Labelled) -> None:
        nonlocal finished
        outcome = observe_one(item, corpus, controller, f1_threshold)
        with lock:
            if path:
                with path.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(asdict(outcome)) + "\n")
            done[item.id] = outcome
            finished += 1
            if on_progress:
                on_progress(finished, len(items))

    if on_progress and finished:
        on_progress(finished, len(items))
    if workers <= 1:
        for item in todo:
            work(item)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(work, item) for item in todo]:
                future.result()  # the first failure is raised once the questions under way end
    return [done[item.id] for item in items]


# ------------------------------------------------------------------------------------------
# Fitting
# ------------------------------------------------------------------------------------------


def shrunk(successes: float, trials: float, prior_mean: float, strength: float = PRIOR_STRENGTH) -> float:
    """Beta posterior mean with a prior of ``strength`` pseudo-observations at ``prior_mean``."""
    return (successes + strength * prior_mean) / (trials + strength)


def wilson(successes: int, trials: int, z: float = 1.96) -> list[float]:
    """95 % Wilson score interval of a proportion."""
    if trials == 0:
        return [0.0, 1.0]
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def _beta(mean: float) -> dict[str, float]:
    return {"a": round(mean * CONCENTRATION, 6), "b": round((1 - mean) * CONCENTRATION, 6)}


def fit(
    outcomes: Sequence[Outcome],
    m: int,
    hops: int = 1,
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
) -> dict[str, Any]:
    """Fitted values, counts and diagnostics (the calibration JSON without its metadata).

    With every question labelled, one pass of :func:`fit_counts`. With some or all unlabelled,
    expectation-maximisation over each unlabelled question's right answer (:func:`fit_unlabelled`),
    after checking that the data can tell the sources' reliabilities apart (:func:`identifiable`).
    ``fitted_on`` records which, and on how many questions. ``evidence``: how a read's votes vary
    with their evidence (:data:`EVIDENCE_VARIANTS`); ``table``: the rows the outcomes' labels name.
    """
    labelled = sum(o.labelled for o in outcomes)
    kind = "labelled" if labelled == len(outcomes) else "unlabelled" if not labelled else "mixed"
    fitted_on: dict[str, Any] = {"kind": kind, "questions": len(outcomes), "labelled": labelled}
    if kind == "labelled":
        fitted = fit_counts(outcomes, m, hops, table)
        fit_evidence_levels(outcomes, hops, fitted, evidence, table)
        return {**fitted, "fitted_on": fitted_on}
    identifiable(outcomes, table)
    if labelled < MIN_QUESTIONS:
        raise Unidentifiable(
            f"{labelled} of these {len(outcomes)} questions have gold answers; a fit from questions "
            f"without them needs at least {MIN_QUESTIONS} with gold to be checked against. Without "
            "gold, which sources agree is explained as well by right answers as by wrong ones that "
            "coincide, and EM gave reliabilities far from the labelled fit's on every dataset we "
            "measured (bench/results/unlabelled.md)"
        )
    fitted, em = fit_unlabelled(outcomes, m, hops, table=table)
    _same_from_every_start(outcomes, m, hops, fitted, table)
    _plausible(outcomes, fitted, table)
    return {**fitted, "fitted_on": {**fitted_on, "em": em}}


def fit_counts(
    outcomes: Sequence[Outcome], m: int, hops: int = 1, table: Table = brag.ACTION_TABLE
) -> dict[str, Any]:
    """One fit from the outcomes' right/wrong flags, which may be probabilities (an EM step).

    Each action observed, by its kind (:class:`KindFit`), as SPEC section 4 says; a hop's
    ``same`` and ``new`` branches from the first ``hops`` second-hop reads of each question (see
    :func:`fit_second_hop`); eta from pairs of votes that do not read the same passages (a read
    and a samples action), because a second hop repeats its first hop's wrong answer far more
    often than independent sources do.
    """
    observed = observed_actions(outcomes, table)
    counts: dict[str, Any] = {}
    diagnostics: dict[str, Any] = {}
    for action in observed:
        counts[action.label], diagnostics[action.label] = _answer_counts(outcomes, action.label)
    eta, eta_counts, diagnostics["wrong_answer_repeats"] = _fit_eta(outcomes, observed)
    actions = {
        a.label: a.kind.entry_dict(
            fit_of(a).fit(
                outcomes,
                a.label,
                Base(a.kind.prior(a, m), PRIOR_STRENGTH, from_row=True),
                hops,
                eta,
                counts[a.label],
                observed,
            )
        )
        for a in observed
    }
    counts["eta"] = eta_counts
    fitted = {"eta": round(eta, 6), "actions": actions, "counts": counts, "diagnostics": diagnostics}
    costs = fit_costs(outcomes, observed)
    return {**fitted, "costs": costs} if costs is not None else fitted


def observed_actions(outcomes: Sequence[Outcome], table: Table = brag.ACTION_TABLE) -> Table:
    """The table's actions every outcome observed, in table order."""
    return tuple(a for a in table if outcomes and all(a.label in o.answers for o in outcomes))


def fit_costs(
    outcomes: Sequence[Outcome], actions: Sequence[brag.Action]
) -> dict[str, dict[str, float | None]] | None:
    """Each action's mean prompt and completion tokens, requests and LLM seconds per run.

    None when some action was never run or no run recorded its usage (progress files written
    before costs were). Seconds are None when any call's latency was unknown.
    """
    costs: dict[str, dict[str, float | None]] = {}
    for action in (a.label for a in actions):
        runs = [u for o in outcomes for u in o.usage.get(action, [])]
        if not runs:
            return None
        mean = {
            key: round(sum(u[key] for u in runs) / len(runs), 4)
            for key in ("prompt_tokens", "completion_tokens")
        }
        requests = sum(u.get("requests", u["llm_calls"]) for u in runs) / len(runs)
        known = all(u.get("llm_seconds_known", True) for u in runs)
        seconds = round(sum(u["llm_seconds"] for u in runs) / len(runs), 4) if known else None
        costs[action] = {**mean, "requests": round(requests, 4), "seconds": seconds}
    return costs


def _tally(outcomes: Sequence[Outcome], action: str) -> dict[str, Any]:
    """On how many questions ``action`` ran, answered, and was right (expected, when unlabelled)."""
    answered = sum(bool(o.answers[action]) for o in outcomes)
    correct = round(sum(o.correct[action] for o in outcomes), 4)
    return {"n": len(outcomes), "answered": answered, "correct": correct}


def _answer_counts(outcomes: Sequence[Outcome], action: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """How often ``action`` answered and was right, and those rates with their intervals."""
    counts = _tally(outcomes, action)
    n, answered, correct = counts["n"], counts["answered"], counts["correct"]
    diagnostics = {
        "answer_rate": round(answered / n, 4) if n else 0.0,
        "answer_rate_ci95": wilson(answered, n),
        "accuracy": round(correct / n, 4) if n else 0.0,
        "accuracy_ci95": wilson(correct, n),
        "precision": round(correct / answered, 4) if answered else 0.0,
        "precision_ci95": wilson(correct, answered),
    }
    return counts, diagnostics


def _fit_eta(
    outcomes: Sequence[Outcome], actions: Sequence[brag.Action]
) -> tuple[float, dict[str, float], dict[str, Any]]:
    """η, with its counts and every pair's repeat rate.

    From pairs of wrong votes of sources that read nothing in common: a read and a samples action.
    """
    repeats = wrong_repeats(outcomes, actions)
    independent = [name for name, pair in _pairs(actions).items() if _independent(*pair)]
    trials = sum(repeats[name][0] for name in independent)
    hits = sum(repeats[name][1] for name in independent)
    eta = (hits + ETA_PRIOR[0]) / (trials + sum(ETA_PRIOR))
    rates = {
        pair: {"both_wrong": round(t, 4), "same": round(h, 4), "rate": round(h / t, 4) if t else None}
        for pair, (t, h) in repeats.items()
    }
    return eta, {"wrong_vote_trials": round(trials, 4), "repeats": round(hits, 4)}, rates


def _pairs(actions: Sequence[brag.Action]) -> dict[str, tuple[brag.Action, brag.Action]]:
    """Every pair of ``actions``, in table order, by name: ``CB repeats R1``."""
    return {f"{b.label} repeats {a.label}": (a, b) for a, b in itertools.combinations(actions, 2)}


def _independent(a: brag.Action, b: brag.Action) -> bool:
    """One reads passages and the other none, and neither is read against the answers before it.

    Their votes share no passage and no prompt (a read and closed-book samples); a hop's vote
    is typed by the answers before it, so its wrong answers are not independent of theirs.
    """
    return a.kind.reads_passages != b.kind.reads_passages and not (a.kind.needs_new or b.kind.needs_new)


def wrong_repeats(
    outcomes: Sequence[Outcome], actions: Sequence[brag.Action] | None = None
) -> dict[str, tuple[float, float]]:
    """(questions where both answered wrong, of them the same wrong answer) per pair of sources.

    Every pair of ``actions`` (default: those observed), in table order. With probabilities
    for right, both counts are expected: both are wrong when the truth is neither answer,
    1 - P(first) - P(second), or 1 - P(it) when they name the same one.
    """
    chosen = observed_actions(outcomes) if actions is None else actions
    found = {}
    for name, (a, b) in _pairs(chosen).items():
        first, second = a.label, b.label
        both, same = 0, 0
        for o in outcomes:
            if not (o.answers[first] and o.answers[second]):
                continue
            repeat = brag.same_answer(o.answers[first], o.answers[second])
            right = (o.correct[first], o.correct[second])
            wrong = max(0, 1 - max(right)) if repeat else max(0, 1 - sum(right))
            both, same = both + wrong, same + wrong * repeat
        found[name] = (both, same)
    return found


def fit_second_hop(
    outcomes: Sequence[Outcome], label: str, hops: int, eta: float, base: Base
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A hop read against the answers before it: the ``same`` and ``new`` branches, and their counts.

    ``same``: its likelihood ratio is how much more often a second hop repeats an earlier answer
    after a right one than after a wrong one (add-one smoothed), stored as the reliability
    rho = L eta / (1 + L eta) that gives a vote that ratio. ``new``: how often a second hop that
    names an answer no earlier read gave is right, shrunk like rho. ``pi``: the share of
    repeats among answers given after an earlier answer.
    """
    reads = [h for o in outcomes for h in o.hops.get(label, [])[:hops]]
    after = [h for h in reads if h["after_answer"]]
    # Reads after a right and after a wrong earlier answer (expected counts, when unlabelled).
    after_right = [sum(h["after_right"] for h in after), sum(h["after_right"] * h["repeats"] for h in after)]
    after_wrong = [len(after) - after_right[0], sum(h["repeats"] for h in after) - after_right[1]]
    answered_after = [h for h in after if h["answer"]]
    news = [h for h in reads if h["answer"] and not h["repeats"]]
    repeat_right = (after_right[1] + 1) / (after_right[0] + 2)
    repeat_wrong = (after_wrong[1] + 1) / (after_wrong[0] + 2)
    ratio = repeat_right / repeat_wrong
    base_same, base_new = brag.Hop.branches(base.prior)
    pi = _toward(sum(h["repeats"] for h in answered_after), len(answered_after), base_same.pi, base.strength)
    rho_new = _toward(sum(h["correct"] for h in news), len(news), base_new.mean, base.strength)
    counts = {
        "reads": len(reads),
        "after_right": [round(x, 4) for x in after_right],
        "after_wrong": [round(x, 4) for x in after_wrong],
        "new": [len(news), round(sum(h["correct"] for h in news), 4)],
        "same_likelihood_ratio": round(ratio, 4),
    }
    same = {"pi": round(pi, 6), "rho": _beta(ratio * eta / (1 + ratio * eta))}
    new_a, new_b = _beta_pair(rho_new)  # kept inside (0, 1): a refit with no strength may reach 0
    return same, {"rho": {"a": new_a, "b": new_b}}, counts


# ------------------------------------------------------------------------------------------
# Evidence levels: a read's votes split by what their answers show
# ------------------------------------------------------------------------------------------

EVIDENCE_FOLDS = 5
MIN_EVIDENCE_AUC = 0.55  # held-out AUROC a split must reach to be kept, at least
MIN_LEVEL_VOTES = 5  # votes each level must hold (and a tenth of them)
Vote = tuple[Mapping[str, Any], float]  # (evidence features, right: 1/0 or its probability)
# How a read's votes vary with their evidence: "curve", each vote its own rho (brag.EvidenceCurve),
# with the dependence of reads that share a passage; "levels", two levels of the four features
# fits had before the curve (kept so the two are compared on the same outcomes).
EVIDENCE_VARIANTS = ("curve", "levels")
LEVEL_FEATURES = ("answer_p", "answer_p_min", "span", "in_question")


def fit_evidence_levels(
    outcomes: Sequence[Outcome],
    hops: int,
    fitted: dict[str, Any],
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
) -> None:
    """Fit how each read's votes, and a hop's votes for a new answer, vary with their evidence.

    In place. ``curve``: each read's entry gets an evidence ``curve`` (:func:`fit_evidence_curve`)
    when its score tells right answers from wrong ones on held-out votes, and a read of the
    question's own window a ``same`` branch: what repeating another read's answer says
    (:func:`fit_repeats`). ``levels``: an ``evidence`` split (:func:`fit_evidence_split`).
    ``fitted["diagnostics"]["evidence"]`` has the held-out AUROCs.
    """
    if evidence not in EVIDENCE_VARIANTS:
        raise brag.InputError(f"evidence must be one of {EVIDENCE_VARIANTS}, got {evidence!r}")
    actions = fitted["actions"]
    diagnostics = fitted["diagnostics"].setdefault("evidence", {})
    observed = observed_actions(outcomes, table)
    for action in observed:
        votes = fit_of(action).evidence_votes(outcomes, action.label, hops)
        if votes is None:
            continue
        if evidence == "curve":
            curve = fit_evidence_curve(votes, strength=CURVE_L2)
            diagnostics[action.label] = {"votes": len(votes), "held_out_auc": curve["auc"] if curve else None}
            if curve is not None and curve["auc"] >= _chance_of(votes):
                actions[action.label]["curve"] = curve
            if not action.kind.needs_new:
                same = fit_repeats(outcomes, action.label, fitted["eta"], observed)
                if same is not None:
                    actions[action.label]["same"] = same
            continue
        base = shrunk(sum(right for _, right in votes), len(votes), prior_rho(action.label, table))
        split, aucs = fit_evidence_split([({f: v.get(f) for f in LEVEL_FEATURES}, y) for v, y in votes], base)
        diagnostics[action.label] = {"votes": len(votes), "held_out_auc": aucs}
        if split is not None:
            actions[action.label]["evidence"] = split


def _chance_of(votes: Sequence[Vote]) -> float:
    return chance_auc(sum(y >= 0.5 for _, y in votes), sum(y < 0.5 for _, y in votes))


# ------------------------------------------------------------------------------------------
# Evidence curves: each read's vote its own reliability
# ------------------------------------------------------------------------------------------

CURVE_BINS = 5  # bins of the fitted votes' scores the lookahead prices a vote's spread with
# The penalty of a labelled fit's weights, in standardised units (toward 0): chosen by leaving one
# documents set out at a time (bench/results/confidence_documents.md, evidence variants).
CURVE_L2 = 1.0
MIN_CURVE_VOTES = 20  # votes a curve is fitted on, at least, with both right and wrong ones
# A self-test refit's pull toward its base curve: chosen on the other sets' self-tests for each
# documents set left out (bench/results/confidence_documents.md).
CURVE_STRENGTH = 20.0


def carried_features(votes: Sequence[Vote]) -> tuple[str, ...]:
    """The evidence features the votes were recorded with (a value or None), in ``EVIDENCE``'s order.

    What a fit on them looked at: a feature added since they were recorded is not among them.
    """
    return tuple(f for f in brag.evidence_names() if any(f in v for v, _ in votes))


def curve_features(votes: Sequence[Vote]) -> list[str]:
    """The evidence features most votes have (four in five) and that vary among them."""
    found = []
    for feature in brag.evidence_names():
        values = [v.get(feature) for v, _ in votes]
        known = [x for x in values if x is not None]
        if len(known) >= 0.8 * len(votes) and len(set(known)) > 1:
            found.append(feature)
    return found


def _design(votes: Sequence[Vote], features: Sequence[str], means: Mapping[str, float]) -> np.ndarray:
    """The votes' features as rows, a missing one at its mean."""
    return np.array(
        [[means[f] if v.get(f) is None else float(v[f]) for f in features] for v, _ in votes], dtype=float
    ).reshape(len(votes), len(features))


def _toward_logistic(
    x: np.ndarray,
    y: np.ndarray,
    prior: np.ndarray,
    l2: float,
    pull_intercept: bool,
    iterations: int = 50,
    offset: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Logistic regression (intercept first) whose weights are pulled toward ``prior`` by ``l2``.

    ``x`` standardised; the intercept is pulled too when ``pull_intercept`` (a refit toward a
    base curve: a corpus's few votes move its level no more than its slope). ``offset``: a
    fixed part of each row's linear predictor, which no weight multiplies.
    """
    z = np.hstack([np.ones((len(x), 1)), x])
    w = prior.astype(float).copy()
    penalty = np.diag([l2 if pull_intercept else 0.0] + [l2] * x.shape[1])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-np.clip(z @ w + offset, -30, 30)))
        gradient = z.T @ (p - y) + penalty @ (w - prior)
        hessian = z.T @ (z * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hessian + 1e-9 * np.eye(len(w)), gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def _curve_weights(
    votes: Sequence[Vote], features: Sequence[str], base: brag.EvidenceCurve | None, strength: float
) -> tuple[dict[str, float], float, dict[str, float]]:
    """(weights, intercept, means) in the features' own units, fitted on ``votes``.

    A feature none of the votes has (a backend without log-probabilities) keeps ``base``'s mean:
    its column is constant, so its weight stays where ``base`` put it.
    """
    base_means = dict(base.means) if base is not None else {}
    means = {}
    for f in features:
        known = [v[f] for v, _ in votes if v.get(f) is not None]
        means[f] = float(np.mean(known)) if known else base_means.get(f, 0.0)
    x = _design(votes, features, means)
    y = np.array([right for _, right in votes], dtype=float)
    centre, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale < 1e-9, 1.0, scale)  # a constant column (rounding leaves a hair of spread)
    prior = np.zeros(len(features) + 1)
    if base is not None:  # the base curve, in these votes' standardised units
        weights = dict(base.weights)
        raw = np.array([weights.get(f, 0.0) for f in features])
        prior = np.concatenate([[base.score(dict(zip(features, centre, strict=True)))], raw * scale])
    w = _toward_logistic((x - centre) / scale, y, prior, strength, base is not None)
    raw = w[1:] / scale
    weights = {f: round(float(x), 6) for f, x in zip(features, raw, strict=True)}
    return weights, round(float(w[0] - raw @ centre), 6), {f: round(x, 6) for f, x in means.items()}


def _spread(
    votes: Sequence[Vote], weights: Mapping[str, float], intercept: float, means: Mapping[str, float]
) -> list[list[float]]:
    """(share, score after the call) of ``CURVE_BINS`` bins of equal count of the votes' scores."""
    before_call = brag.evidence_names(before_call=True)
    post = sorted(
        intercept
        + sum(
            w * (means[f] if v.get(f) is None else v[f]) for f, w in weights.items() if f not in before_call
        )
        for v, _ in votes
    )
    bins = np.array_split(np.array(post), min(CURVE_BINS, len(post)))
    return [[round(len(b) / len(post), 6), round(float(b.mean()), 6)] for b in bins if len(b)]


def _as_curve(
    weights: Mapping[str, float], intercept: float, means: Mapping[str, float], spread: list, auc_: float
) -> brag.EvidenceCurve:
    return brag.EvidenceCurve(
        tuple(weights.items()), intercept, tuple(means.items()), tuple(map(tuple, spread)), auc_
    )


def fit_evidence_curve(
    votes: Sequence[Vote], base: brag.EvidenceCurve | None = None, strength: float = CURVE_L2
) -> dict[str, Any] | None:
    """A read's evidence curve from its votes (features, right), as a calibration file holds it.

    A logistic regression of right on the features most votes have (:func:`curve_features`, or
    ``base``'s), its weights pulled toward ``base``'s (a refit) or toward 0 (a labelled fit)
    by ``strength``; its ``auc`` the held-out AUROC of the same fit over ``EVIDENCE_FOLDS``
    folds. None with too few votes, or without both right and wrong ones.
    """
    votes = list(votes)
    right = sum(y >= 0.5 for _, y in votes)
    if len(votes) < MIN_CURVE_VOTES or right in (0, len(votes)):
        return None
    features = [f for f, _ in base.weights] if base is not None else curve_features(votes)
    if not features:
        return None
    weights, intercept, means = _curve_weights(votes, features, base, strength)
    curve = _as_curve(weights, intercept, means, _spread(votes, weights, intercept, means), 0.5)
    held = _held_out_reliabilities(votes, features, base, strength)
    auc_ = auc([p for p, _ in held], [y >= 0.5 for _, y in held])
    return brag.curve_to_dict(replace(curve, auc=round(float(auc_), 4), features=carried_features(votes)))


def _held_out_reliabilities(
    votes: Sequence[Vote], features: Sequence[str], base: brag.EvidenceCurve | None, strength: float
) -> list[tuple[float, float]]:
    """(rho, right) of each vote under the curve fitted on the other folds."""
    held = []
    for fold in range(EVIDENCE_FOLDS):
        train = [v for i, v in enumerate(votes) if i % EVIDENCE_FOLDS != fold]
        test = [v for i, v in enumerate(votes) if i % EVIDENCE_FOLDS == fold]
        if not test:
            continue
        if not _both_classes([(0.0, y) for _, y in train]):
            held += [(0.5, y) for _, y in test]
            continue
        weights, intercept, means = _curve_weights(train, features, base, strength)
        curve = _as_curve(weights, intercept, means, [[1.0, 0.0]], 0.5)
        held += [(curve.reliability(v), y) for v, y in test]
    return held


def refit_curve(base: brag.EvidenceCurve, votes: Sequence[Vote], strength: float) -> brag.EvidenceCurve:
    """``base`` refitted on a corpus's votes, pulled toward it by ``strength``.

    Its features, and any the votes carry that ``base``'s fit never looked at (a feature added to
    ``brag.EVIDENCE`` since), each new one's weight pulled toward 0. ``base`` itself unless the
    refit predicts these votes better on held-out folds (log-loss): votes that carry no signal
    keep the pooled curve.
    """
    votes = list(votes)
    if len(votes) < EVIDENCE_FOLDS or not _both_classes([(0.0, y) for _, y in votes]):
        return base
    looked = set(base.features or (f for f, _ in base.weights))
    features = [f for f, _ in base.weights] + [f for f in curve_features(votes) if f not in looked]
    held = _held_out_reliabilities(votes, features, base, strength)
    kept = [(base.reliability(v), y) for v, y in votes]
    if _log_loss(held) >= _log_loss(kept):
        return base
    weights, intercept, means = _curve_weights(votes, features, base, strength)
    spread = _spread(votes, weights, intercept, means)
    looked_at = tuple(f for f in brag.evidence_names() if f in looked or f in carried_features(votes))
    return replace(_as_curve(weights, intercept, means, spread, base.auc), features=looked_at)


def _log_loss(rows: Sequence[tuple[float, float]]) -> float:
    return -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in rows) / max(1, len(rows))


REPEAT_PRIOR = 2.0  # pseudo-questions each side of a repeat's likelihood ratio starts from (even)


def _window_ranks(action: brag.Action) -> range:
    """The ranks (from 1) of the question's own passages a read's prompt holds (all from ``first``)."""
    start = action.first + 1
    return range(start, start + action.passages) if action.passages else range(start, sys.maxsize)


def _resting_ranks(action: brag.Action, evidence: Mapping[str, Any]) -> range:
    """The ranks its answer rests on: the first passage holding it word for word, else its window."""
    ranks, rank = _window_ranks(action), brag.span_rank(evidence)
    return ranks[rank - 1 : rank] if rank is not None and rank <= len(ranks) else ranks


def _holds_any(action: brag.Action, ranks: range) -> bool:
    """Whether a read's window holds a passage of ``ranks`` (the run's ``repeats``, by rank)."""
    window = _window_ranks(action)
    return max(window.start, ranks.start) < min(window.stop, ranks.stop)


def fit_repeats(
    outcomes: Sequence[Outcome], label: str, eta: float, observed: Table | None = None
) -> dict[str, Any] | None:
    """What a read saying another read's answer again says: its ``same`` branch, or None.

    Reads of the question's own window that share the passage an answer rests on are no
    independent witnesses (``brag.resting_passages``). Over every other read that answered
    and holds the passage this one's answer rests on: how often this one repeats it (``pi``),
    and how much more often after a right answer than a wrong one (the likelihood ratio L,
    each side shrunk toward even by ``REPEAT_PRIOR``), stored as the reliability whose ratio
    is L at ``eta``, as a hop's ``same`` branch is. ``observed``: the outcomes' rows (default:
    the shipped table's they observed).
    """
    rows = observed_actions(outcomes) if observed is None else observed
    row = next((a for a in rows if a.label == label), None) or brag.action_named(label)
    others = [a for a in rows if a.label != label and a.kind.reads_passages and not a.kind.needs_new]
    after_right, after_wrong = [0, 0], [0, 0]  # (repeats, pairs)
    for o in outcomes:
        mine = o.answers.get(label)
        if not mine or not o.labelled:
            continue
        resting = _resting_ranks(row, o.evidence.get(label) or {})
        for other in (a.label for a in others if _holds_any(a, resting)):
            theirs = o.answers.get(other)
            if theirs:
                tally = after_right if o.correct[other] else after_wrong
                tally[0] += brag.same_answer(mine, theirs)
                tally[1] += 1
    if min(after_right[1], after_wrong[1]) < MIN_LEVEL_VOTES:
        return None
    ratio = ((after_right[0] + REPEAT_PRIOR / 2) / (after_right[1] + REPEAT_PRIOR)) / (
        (after_wrong[0] + REPEAT_PRIOR / 2) / (after_wrong[1] + REPEAT_PRIOR)
    )
    pi = (after_right[0] + after_wrong[0]) / (after_right[1] + after_wrong[1])
    rho = ratio * eta / (1 + ratio * eta)
    return {"pi": round(pi, 6), "rho": _beta(rho)}


def fit_evidence_split(
    votes: Sequence[Vote], base_rho: float
) -> tuple[dict[str, Any] | None, dict[str, float]]:
    """The best two-level split of ``votes`` by a score of their evidence, and each score's AUROC.

    The scores tried: each feature alone (oriented so that higher is more often right), and a
    logistic combination of every feature most votes have (``combined``). Each is scored by
    cross-validation over the votes (``EVIDENCE_FOLDS`` folds in order): the score and its
    split are fitted on the other folds, and each held-out vote is scored with its level's
    reliability; a score's result is the AUROC of those held-out reliabilities for a right
    vote. The best is kept when it clears :func:`chance_auc`, and refitted on all votes. A
    feature missing from more than a fifth of the votes is not used.
    """
    present = [
        f for f in brag.evidence_names() if sum(v.get(f) is not None for v, _ in votes) >= 0.8 * len(votes)
    ]
    candidates = {f: (f,) for f in present}
    if len(present) > 1:
        candidates["combined"] = tuple(present)
    rows_of = {
        name: [
            ([v[f] for f in features], right)
            for v, right in votes
            if all(v.get(f) is not None for f in features)
        ]
        for name, features in candidates.items()
    }
    results = {
        name: held for name, rows in rows_of.items() if (held := _held_out_auc(rows, base_rho)) is not None
    }
    if not results:
        return None, results
    name = max(results, key=lambda n: (results[n], n != "combined"))  # a tie goes to one feature
    if results[name] < chance_auc(sum(y >= 0.5 for _, y in votes), sum(y < 0.5 for _, y in votes)):
        return None, results
    features, rows = candidates[name], rows_of[name]
    score = _evidence_score(rows)
    split = _best_split([(score(x), y) for x, y in rows], base_rho) if score else None
    if split is None or score is None:
        return None, results
    threshold, (n_hi, right_hi), (n_lo, right_lo) = split

    def level(n: int, right: float) -> dict[str, Any]:
        return {"pi": round((n + 1) / (len(rows) + 2), 6), "rho": _beta(shrunk(right, n, base_rho))}

    return {
        "name": name,
        "weights": dict(zip(features, (round(w, 6) for w in score.weights), strict=True)),
        "intercept": round(score.intercept, 6),
        "threshold": round(threshold, 6),
        "auc": results[name],
        "levels": {"hi": level(n_hi, right_hi), "lo": level(n_lo, right_lo)},
        "features": list(carried_features(votes)),  # looked at
    }, results


def _held_out_auc(rows: Sequence[tuple[list[float], float]], base_rho: float) -> float | None:
    """AUROC of held-out level reliabilities for a right vote (None when a class is missing)."""
    if not _both_classes([(0.0, y) for _, y in rows]):
        return None
    held_out: list[tuple[float, float]] = []
    for fold in range(EVIDENCE_FOLDS):
        train = [r for i, r in enumerate(rows) if i % EVIDENCE_FOLDS != fold]
        test = [r for i, r in enumerate(rows) if i % EVIDENCE_FOLDS == fold]
        score = _evidence_score(train)
        split = _best_split([(score(x), y) for x, y in train], base_rho) if score else None
        for x, right in test:
            held_out.append((_level_rho(split, score(x), base_rho) if score else base_rho, right))
    if not _both_classes(held_out):
        return None
    return round(auc([r for r, _ in held_out], [y >= 0.5 for _, y in held_out]), 4)


@dataclass(frozen=True)
class _Score:
    """A linear score of a vote's features, higher meaning more often right."""

    weights: tuple[float, ...]
    intercept: float

    def __call__(self, x: Sequence[float]) -> float:
        return self.intercept + sum(w * v for w, v in zip(self.weights, x, strict=True))


def _evidence_score(rows: Sequence[tuple[Sequence[float], float]]) -> _Score | None:
    """The score of one or more features, fitted on ``rows``; None without both classes.

    One feature: itself, negated if lower values are more often right. Several: a logistic
    regression's linear predictor, in the features' own units.
    """
    if not _both_classes([(0.0, y) for _, y in rows]):
        return None
    x = np.array([features for features, _ in rows], dtype=float)
    y = np.array([right for _, right in rows], dtype=float)
    if x.shape[1] == 1:
        sign = 1.0 if auc(x[:, 0], y >= 0.5) >= 0.5 else -1.0
        return _Score((sign,), 0.0)
    model = fit_logistic(x, y)
    weights = np.asarray(model["coef"]) / np.asarray(model["std"])
    return _Score(tuple(weights.tolist()), model["intercept"] - float(weights @ np.asarray(model["mean"])))


def chance_auc(positives: int, negatives: int) -> float:
    """The held-out AUROC a split must reach.

    ``MIN_EVIDENCE_AUC``, and two standard errors above 0.5 of a score that carries no signal
    (Hanley and McNeil), so that with few right votes the best of a few noisy scores is not
    taken for evidence.
    """
    if positives == 0 or negatives == 0:
        return 1.0
    null_sd = math.sqrt((positives + negatives + 1) / (12 * positives * negatives))
    return max(MIN_EVIDENCE_AUC, 0.5 + 2 * null_sd)


def _both_classes(rows: Sequence[tuple[float, float]]) -> bool:
    right = sum(y >= 0.5 for _, y in rows)
    return 0 < right < len(rows)


_Split = tuple[float, tuple[int, float], tuple[int, float]]  # threshold, hi (n, right), lo (n, right)


def _best_split(rows: Sequence[tuple[float, float]], base_rho: float) -> _Split | None:
    """The threshold whose two levels fit the right/wrong flags best.

    Levels are "score >= threshold" (hi) and the rest (lo), each with at least
    ``MIN_LEVEL_VOTES`` votes and a tenth of them; the fit is the Bernoulli log-likelihood of
    the flags under each level's shrunk reliability, and hi must be the more reliable level.
    """
    best: tuple[float, _Split] | None = None
    least = max(MIN_LEVEL_VOTES, math.ceil(0.1 * len(rows)))
    ordered = sorted(rows, key=lambda r: r[0])
    values = [v for v, _ in ordered]
    total_right = sum(r for _, r in ordered)
    right_below = 0.0
    for i in range(1, len(ordered)):
        right_below += ordered[i - 1][1]
        if values[i] == values[i - 1] or i < least or len(ordered) - i < least:
            continue
        lo, hi = (i, right_below), (len(ordered) - i, total_right - right_below)
        rho_lo, rho_hi = shrunk(lo[1], lo[0], base_rho), shrunk(hi[1], hi[0], base_rho)
        if rho_hi <= rho_lo:
            continue
        fit = sum(r * math.log(p) + (n - r) * math.log(1 - p) for (n, r), p in ((lo, rho_lo), (hi, rho_hi)))
        if best is None or fit > best[0]:
            best = (fit, ((values[i - 1] + values[i]) / 2, hi, lo))
    return best[1] if best is not None else None


def _level_rho(split: _Split | None, value: float, base_rho: float) -> float:
    """The reliability a split gives a vote with this score (the base one without a split)."""
    if split is None:
        return base_rho
    threshold, hi, lo = split
    n, right = hi if value >= threshold else lo
    return shrunk(right, n, base_rho)


# ------------------------------------------------------------------------------------------
# Unlabelled questions: expectation-maximisation over the right answer
# ------------------------------------------------------------------------------------------

EM_ITERATIONS = 200
EM_TOLERANCE = 1e-6  # the largest change of any fitted reliability, rate or eta that ends the EM
MIN_ANSWERS = 5  # questions a source must answer for its reliability to be fitted
MIN_AGREEMENTS = 5  # unlabelled questions where R1 and CB must agree, and must disagree


class Unidentifiable(brag.InputError):
    """The questions cannot tell the sources' reliabilities apart without gold answers."""


def identifiable(outcomes: Sequence[Outcome], table: Table = brag.ACTION_TABLE) -> None:
    """Raise :class:`Unidentifiable`, saying why, when an unlabelled fit would be guesswork.

    Without gold, all the fit learns from is which sources agree on a question. A read and a
    samples action read nothing in common (the table's first of each), so their agreement is
    the evidence: a source that never answers, two that always agree (every reliability fits
    equally well), or two that almost never do (nothing tells a right answer from a wrong one)
    leave the reliabilities to the prior. Enough labelled questions settle it on their own.
    """
    labelled = sum(o.labelled for o in outcomes)
    if labelled >= MIN_QUESTIONS:
        return
    advice = f"give gold answers for some questions (at least {MIN_QUESTIONS} settle it), or more questions"
    pair = next((p for p in _pairs(observed_actions(outcomes, table)).values() if _independent(*p)), None)
    if pair is None:
        raise Unidentifiable(f"without gold answers a fit needs a read and closed-book samples; {advice}")
    read, samples = (a.label for a in sorted(pair, key=lambda a: not a.kind.reads_passages))
    for action in (read, samples):
        answered = sum(bool(o.answers[action]) for o in outcomes)
        if answered < MIN_ANSWERS:
            raise Unidentifiable(
                f"{action} answered {answered} of {len(outcomes)} questions: too few to tell how often "
                f"it is right without gold answers; {advice}"
            )
    pairs = [o for o in outcomes if not o.labelled and o.answers[read] and o.answers[samples]]
    agree = sum(brag.same_answer(o.answers[read], o.answers[samples]) for o in pairs)
    if len(pairs) - agree < MIN_AGREEMENTS:
        raise Unidentifiable(
            f"{read} and {samples} (closed-book) gave the same answer on {agree} of the {len(pairs)} "
            f"unlabelled questions both answered: sources that always agree fit any reliability equally "
            f"well; {advice}"
        )
    if agree < MIN_AGREEMENTS:
        raise Unidentifiable(
            f"{read} and {samples} (closed-book) agreed on only {agree} of the {len(pairs)} unlabelled "
            f"questions both answered: without agreement nothing tells a right answer from a wrong one; "
            f"{advice}"
        )


@dataclass
class _Votes:
    """One unlabelled question's votes: each source's answer as an index into its candidates.

    Built action by action in table order (:meth:`KindFit.em_votes`): ``earlier`` holds the
    candidates the reads so far named, which a hop's vote is typed against.
    """

    outcome: Outcome
    candidates: list[str] = field(default_factory=list)
    votes: list[tuple[brag.VoteType, int]] = field(default_factory=list)  # (vote type, candidate)
    slots: dict[str, int | None] = field(default_factory=dict)  # each action's (a hop: first) candidate
    hop_slots: dict[str, list[tuple[int | None, list[int]]]] = field(default_factory=dict)
    earlier: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, outcome: Outcome, hops: int, actions: Sequence[brag.Action] | None = None) -> _Votes:
        """Its votes from each of ``actions`` (default: those it observed), in table order."""
        votes = cls(outcome)
        for action in observed_actions([outcome]) if actions is None else actions:
            fit_of(action).em_votes(votes, action.label, hops)
        return votes

    def index(self, answer: str) -> int | None:
        """The candidate ``answer`` names (added when new); None for no answer."""
        if not answer:
            return None
        for i, seen in enumerate(self.candidates):
            if brag.same_answer(answer, seen):
                return i
        self.candidates.append(answer)
        return len(self.candidates) - 1

    def expected(self, ratios: Mapping[brag.VoteType, float], eta: float) -> Outcome:
        """The outcome with each answer's probability of being right in place of right/wrong.

        The posterior's own vote model: a vote of type t multiplies its candidate's weight by
        L_t = rho_t / ((1 - rho_t) eta), and the right answer is none of the candidates with
        weight 1 / eta. The ratios are not floored at 1 here: EM needs the model's likelihood.
        """
        weights = [1.0] * len(self.candidates)
        for kind, candidate in self.votes:
            weights[candidate] *= ratios[kind]
        total = 1.0 / eta + sum(weights)
        p = [w / total for w in weights]

        def right(candidate: int | None) -> float:
            return p[candidate] if candidate is not None else 0.0

        hops = {
            label: [
                {**hop, "correct": right(mine), "after_right": sum(p[i] for i in set(earlier))}
                for hop, (mine, earlier) in zip(self.outcome.hops.get(label, []), slots, strict=True)
            ]
            for label, slots in self.hop_slots.items()
        }
        correct = {a: right(c) for a, c in self.slots.items()}
        return replace(self.outcome, correct=correct, hops={**self.outcome.hops, **hops})


def fit_unlabelled(
    outcomes: Sequence[Outcome],
    m: int,
    hops: int,
    start: float | None = None,
    table: Table = brag.ACTION_TABLE,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """EM: expected right answers under the current fit, then :func:`fit_counts` on them, again.

    Labelled questions keep their gold right/wrong flags throughout; the fit starts from the
    hand-set prior (or with every reliability at ``start``) and stops when no fitted value
    moves by more than ``EM_TOLERANCE``.
    """
    observed = observed_actions(outcomes, table)
    unlabelled = [(i, _Votes.of(o, hops, observed)) for i, o in enumerate(outcomes) if not o.labelled]
    current = list(outcomes)
    calibration = brag.load_calibration(None, brag.with_shipped(table))
    fitted: dict[str, Any] = {}
    before: dict[str, float] = {}
    for iteration in range(1, EM_ITERATIONS + 1):
        priors = calibration.source_priors(m, observed)
        ratios = {t: a / (b * calibration.eta) for t, (a, b) in priors.items()}
        if start is not None and iteration == 1:
            ratios = {t: start / ((1 - start) * calibration.eta) for t in priors}
        for i, votes in unlabelled:
            current[i] = votes.expected(ratios, calibration.eta)
        fitted = fit_counts(current, m, hops, table)
        calibration = _loaded(fitted, m, table)
        values = _fitted_values(calibration, m)
        moved = max((abs(v - before.get(k, math.inf)) for k, v in values.items()), default=0.0)
        before = values
        if moved <= EM_TOLERANCE:
            break
    return fitted, {"iterations": iteration, "converged": moved <= EM_TOLERANCE}


# Where else the EM starts, to see whether the data pin the fit down: every reliability low,
# and every reliability high.
EM_STARTS = (0.05, 0.95)
EM_AGREEMENT = 0.05  # the largest difference in any reliability between the starts' fits


def _same_from_every_start(
    outcomes: Sequence[Outcome], m: int, hops: int, fitted: dict[str, Any], table: Table = brag.ACTION_TABLE
) -> None:
    """Raise :class:`Unidentifiable` when EM from other starts ends at another fit.

    Where the questions only say how often sources agree, many reliabilities explain them
    equally well (one vote alone is right with exactly the probability the fit gives it, so
    it never corrects the fit), and EM stops wherever it started on that ridge. A fit that
    depends on its start is the data's silence, not a measurement.
    """
    ours = {k: v for k, v in _fitted_values(_loaded(fitted, m, table), m).items() if not k.startswith("q_")}
    for start in EM_STARTS:
        other = _fitted_values(_loaded(fit_unlabelled(outcomes, m, hops, start, table)[0], m, table), m)
        worst = max(ours, key=lambda k: abs(ours[k] - other[k]))
        if abs(ours[worst] - other[worst]) > EM_AGREEMENT:
            raise Unidentifiable(
                f"without gold answers these questions do not pin the reliabilities down: started from "
                f"the prior the fit gives {worst} {ours[worst]:.2f}, started with every reliability at "
                f"{start:g} it gives {other[worst]:.2f}; give gold answers for some questions (at least "
                f"{MIN_QUESTIONS} settle it), or more questions"
            )


def _plausible(outcomes: Sequence[Outcome], fitted: dict[str, Any], table: Table = brag.ACTION_TABLE) -> None:
    """Raise :class:`Unidentifiable` when the labelled questions refute a mixed fit.

    Each observed action's precision must stay inside the 95 % interval the labelled questions
    alone give, or the unlabelled ones pulled it there.
    """
    labelled = [o for o in outcomes if o.labelled]
    for action in (a.label for a in observed_actions(outcomes, table)):
        counts = _tally(labelled, action)
        if not counts["answered"]:
            continue
        low, high = wilson(int(counts["correct"]), counts["answered"])
        mine = fitted["diagnostics"][action]["precision"]
        if not low <= mine <= high:
            raise Unidentifiable(
                f"the questions without gold answers pull {action}'s precision to {mine:.2f}, outside "
                f"the {low:.2f}–{high:.2f} its {len(labelled)} labelled questions allow: without gold "
                f"they do not pin it down; give gold answers for more questions (at least "
                f"{MIN_QUESTIONS} settle it)"
            )


def _loaded(fitted: dict[str, Any], m: int, table: Table = brag.ACTION_TABLE) -> brag.Calibration:
    fitted = {"version": brag.CALIBRATION_VERSION, "m": m, **fitted}
    return brag.load_calibration(fitted, brag.with_shipped(table))


def _fitted_values(calibration: brag.Calibration, m: int) -> dict[str, float]:
    """Every number the EM fits: eta, each answer rate, and each vote type's reliability."""
    values = {"eta": calibration.eta, **{f"q_{a}": p.q for a, p in calibration.actions.items()}}
    for kind, (a, b) in calibration.source_priors(m).items():
        values[str(kind)] = a / (a + b)
    return values


# ------------------------------------------------------------------------------------------
# The weak-retrieval gate (SPEC section 3): no LLM
# ------------------------------------------------------------------------------------------


def auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """ROC AUC by the Mann-Whitney U statistic.

    P(score of a positive > score of a negative), ties counted half: what sklearn's
    ``roc_auc_score`` computes.
    """
    scores, positive = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise brag.InputError("AUC needs both weak and strong windows")
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def youden(oriented: Sequence[float], weak: Sequence[bool]) -> tuple[float, float, float]:
    """Threshold t maximising TPR - FPR for "weak when oriented value <= t"; (t, TPR, FPR)."""
    values, weak = np.asarray(oriented, dtype=float), np.asarray(weak, dtype=bool)
    best = (-math.inf, 0.0, 0.0, 0.0)
    for t in np.unique(values):
        fires = values <= t
        tpr, fpr = fires[weak].mean(), fires[~weak].mean()
        if tpr - fpr > best[0]:
            best = (tpr - fpr, float(t), float(tpr), float(fpr))
    return best[1], best[2], best[3]


def threshold_for_recall(
    oriented: Sequence[float], weak: Sequence[bool], recall: float
) -> tuple[float, float, float]:
    """The lowest threshold that catches at least ``recall`` of the weak windows; (t, TPR, FPR)."""
    values, weak = np.asarray(oriented, dtype=float), np.asarray(weak, dtype=bool)
    for t in np.unique(values):
        fires = values <= t
        if fires[weak].mean() >= recall:
            return float(t), float(fires[weak].mean()), float(fires[~weak].mean())
    return float(values.max()), 1.0, 1.0


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, iterations: int = 50) -> dict[str, Any]:
    """L2-regularised logistic regression by Newton's method on standardised features."""
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std == 0, 1.0, std)
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
    w = np.zeros(z.shape[1])
    penalty = np.diag([0.0] + [l2] * (z.shape[1] - 1))
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-(z @ w)))
        gradient = z.T @ (p - y) + penalty @ w
        hessian = z.T @ (z * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hessian + 1e-9 * np.eye(len(w)), gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return {"intercept": float(w[0]), "coef": w[1:].tolist(), "mean": mean.tolist(), "std": std.tolist()}


def logistic_scores(model: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Probability that each window is weak under a fitted logistic combination."""
    z = (x - np.asarray(model["mean"])) / np.asarray(model["std"])
    return 1 / (1 + np.exp(-(model["intercept"] + z @ np.asarray(model["coef"]))))


def window_is_weak(window_titles: Iterable[str], needed_titles: Iterable[str]) -> bool:
    """Weak: at least one needed passage (by title) is outside the window."""
    return not set(needed_titles) <= set(window_titles)


def gate_rows(
    items: Sequence[Labelled], corpus: brag.Corpus, k: int = 5
) -> list[tuple[dict[str, float], bool]]:
    """Signals and the weak label of each question's R1 window (questions with known support)."""
    rows = []
    for item in items:
        if not item.supporting:
            continue
        found = corpus.retrieve(item.question, k)
        window = [i for i, _ in found.hits]
        signals = brag.window_signals(item.question, corpus, window, k, found)
        rows.append((signals, window_is_weak([corpus[i].title for i in window], item.supporting)))
    return rows


def fit_gate(
    rows: Sequence[tuple[Mapping[str, float], bool]],
    *,
    k: int = 5,
    min_separation: float = 0.65,
    max_correlation: float = 0.85,
    target_recall: float | None = None,
    max_signals: int = 2,
) -> dict[str, Any]:
    """Fit the gate section of a calibration, in four steps.

    AUC per signal (:func:`_signal_aucs`); the strongest signals that are not redundant
    (:func:`_select_signals`); an orientation and threshold for each, by Youden's J or a
    target recall (:func:`_thresholds`); and a logistic combination for comparison
    (:func:`_logistic_fit`).
    """
    weak = np.array([w for _, w in rows], dtype=bool)
    if len(rows) < MIN_QUESTIONS or weak.all() or not weak.any():
        raise brag.InputError(f"gate calibration needs {MIN_QUESTIONS}+ windows, some weak and some strong")
    names = sorted({name for signals, _ in rows for name in signals})
    table = {n: np.array([s.get(n, np.nan) for s, _ in rows]) for n in names}
    aucs = _signal_aucs(table, weak)
    ranked = sorted(aucs, key=lambda n: -max(aucs[n], 1 - aucs[n]))
    kept, dropped = _select_signals(ranked, aucs, table, min_separation, max_correlation, max_signals)
    signals = _thresholds(kept, aucs, table, weak, target_recall)
    gate = brag.Gate(
        tuple(brag.GateSignal(s["name"], s["orientation"], s["threshold"], s["auc"]) for s in signals), k
    )
    fires = np.array([bool(gate.fires(s)) for s, _ in rows])
    everywhere = [n for n in names if all(n in s for s, _ in rows)]
    return {
        "k": k,
        "signals": signals,
        "rule": "weak when any kept signal fires",
        "n": len(rows),
        "weak_rate": round(float(weak.mean()), 4),
        "auc": {name: round(value, 4) for name, value in aucs.items()},
        "dropped": dropped,
        "tpr": round(float(fires[weak].mean()), 4),
        "fpr": round(float(fires[~weak].mean()), 4),
        "logistic": _logistic_fit(rows, weak, kept if len(kept) >= 2 else ranked[:2]),
        "logistic_all_signals": _logistic_fit(rows, weak, everywhere),
    }


def _signal_aucs(table: Mapping[str, np.ndarray], weak: np.ndarray) -> dict[str, float]:
    """Each signal's AUC for telling weak windows from strong ones, where it was measured."""
    aucs = {}
    for name, values in table.items():
        present = ~np.isnan(values)
        if weak[present].any() and (~weak[present]).any():
            aucs[name] = auc(values[present], weak[present])
    return aucs


def _select_signals(
    ranked: Sequence[str],
    aucs: Mapping[str, float],
    table: Mapping[str, np.ndarray],
    min_separation: float,
    max_correlation: float,
    max_signals: int,
) -> tuple[list[str], dict[str, str]]:
    """The strongest signals that separate well and do not repeat a stronger one; why others went."""
    kept: list[str] = []
    dropped: dict[str, str] = {}
    for name in ranked:
        separation = max(aucs[name], 1 - aucs[name])
        if separation < min_separation:
            dropped[name] = f"separation {separation:.3f} < {min_separation}"
            continue
        for stronger in kept:
            both = ~np.isnan(table[name]) & ~np.isnan(table[stronger])
            corr = (
                float(np.corrcoef(table[name][both], table[stronger][both])[0, 1]) if both.sum() > 2 else 0.0
            )
            if abs(corr) > max_correlation:
                dropped[name] = f"|corr| {abs(corr):.3f} with {stronger} > {max_correlation}"
                break
        else:
            if len(kept) < max_signals:
                kept.append(name)
            else:
                dropped[name] = f"only the {max_signals} strongest signals are combined"
    return kept, dropped


def _thresholds(
    kept: Sequence[str],
    aucs: Mapping[str, float],
    table: Mapping[str, np.ndarray],
    weak: np.ndarray,
    target_recall: float | None,
) -> list[dict[str, Any]]:
    """Each kept signal oriented so that lower means weaker, with its threshold and its rates."""
    signals = []
    for name in kept:
        orientation = 1.0 if aucs[name] < 0.5 else -1.0  # lower oriented value = weaker
        present = ~np.isnan(table[name])
        oriented = orientation * table[name][present]
        if target_recall is None:
            threshold, tpr, fpr = youden(oriented, weak[present])
        else:
            threshold, tpr, fpr = threshold_for_recall(oriented, weak[present], target_recall)
        signals.append(
            {
                "name": name,
                "orientation": orientation,
                "threshold": threshold,
                "auc": round(aucs[name], 4),
                "tpr": round(tpr, 4),
                "fpr": round(fpr, 4),
            }
        )
    return signals


def _logistic_fit(
    rows: Sequence[tuple[Mapping[str, float], bool]], weak: np.ndarray, features: list[str]
) -> dict[str, Any] | None:
    """A logistic regression of weakness on ``features``, over the windows that have them all."""
    complete = [i for i, (s, _) in enumerate(rows) if all(f in s for f in features)]
    if not features or not complete:
        return None
    x = np.array([[rows[i][0][f] for f in features] for i in complete])
    model = {"features": features, **fit_logistic(x, weak[complete].astype(float))}
    model["auc_calibration"] = round(auc(logistic_scores(model, x), weak[complete]), 4)
    return model


def _fit_gate_if_identifiable(
    items: Sequence[Labelled], corpus: brag.Corpus, k: int
) -> dict[str, Any] | None:
    """The gate fitted on ``items``' windows, or None when they are all weak or all strong."""
    rows = gate_rows(items, corpus, k)
    if len(rows) >= MIN_QUESTIONS and any(w for _, w in rows) and not all(w for _, w in rows):
        return fit_gate(rows, k=k)
    return None


def _checked(items: Sequence[Labelled], actions: Sequence[str] | None, table: Table) -> tuple[str, ...]:
    """The actions to fit, once the questions and the actions are known to be usable."""
    chosen = tuple(default_actions(table) if actions is None else actions)
    if not chosen or isinstance(actions, str) or not set(chosen) <= set(brag.action_labels(table)):
        labels = ", ".join(brag.action_labels(table))
        raise brag.InputError(f"actions must be labels of the table ({labels}), got {brag._shown(actions)}")
    ordered = [a for a in table if a.label in chosen]  # the order calibration runs them in
    for i, action in enumerate(ordered):
        if action.kind.needs_new and not any(a.kind.sets_next_hop for a in ordered[:i]):
            raise brag.InputError(
                f"actions: {action.label} reads what a read before it found, so it needs a read "
                "action before it in the table (R1)"
            )
    if len(items) < MIN_QUESTIONS:
        raise brag.InputError(f"calibration needs at least {MIN_QUESTIONS} questions, got {len(items)}")
    if len({i.id for i in items}) != len(items):
        raise brag.InputError("questions: ids must be unique")
    return chosen


def observer(
    llm: brag.LLM,
    actions: Sequence[str],
    gate: dict[str, Any] | None,
    settings: Any,
    table: Table = brag.ACTION_TABLE,
) -> brag.BRAG:
    """The controller calibration observes with: the prior, this gate, and exactly ``actions``.

    The schedule decides what runs, and the gate's verdict on each window is recorded so each
    read gets strong- and weak-window reliabilities. An action the prior has no entry for runs
    on its kind's prior (its answers, not its prior, are what the fit uses). ``table``: the
    rows ``actions`` name.
    """
    prior = brag.load_calibration().to_dict()
    prior["actions"] = {label: entry for label, entry in prior["actions"].items() if label in actions}
    extra = tuple(
        label for label in brag.action_labels(table) if label in actions and label not in prior["actions"]
    )
    calibration = {**prior, "gate": gate}
    return brag.BRAG(llm, calibration=calibration, extra_actions=extra, actions=tuple(table), **settings)


def calibrate(
    items: Sequence[Labelled],
    corpus: brag.Corpus,
    llm: brag.LLM,
    *,
    k: int = 5,
    m: int = 5,
    hops: int = brag.DEFAULT_HOPS,
    seed: int = 0,
    f1_threshold: float = 0.8,
    progress_path: str | os.PathLike[str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    meta: dict[str, Any] | None = None,
    workers: int = 1,
    actions: Sequence[str] | None = None,
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
) -> dict[str, Any]:
    """Observe every action on ``items`` and fit; the result loads with ``brag.load_calibration``.

    ``actions``: the labels to observe and fit, of ``table``'s rows (default: those marked
    ``fitted``); a controller of those rows offers each (``evidence``: :data:`EVIDENCE_VARIANTS`).
    Items without gold answers are fitted by EM (:func:`fit`); :class:`Unidentifiable` when they cannot be.
    """
    chosen = _checked(items, actions, table)
    gate = _fit_gate_if_identifiable(items, corpus, k)
    settings = {"lam": 0.0, "k": k, "m": m, "seed": seed, "hops": hops}
    controller = observer(llm, chosen, gate, settings, table)
    outcomes = observe(
        items,
        corpus,
        controller,
        progress_path=progress_path,
        progress=progress_key(llm, corpus, k, m, hops, seed, f1_threshold, chosen),
        f1_threshold=f1_threshold,
        on_progress=on_progress,
        workers=workers,
    )
    fitted = fit(outcomes, m, hops, evidence, table)
    result = {
        "version": brag.CALIBRATION_VERSION,
        "source": "fitted",
        "fitted": True,
        # The name the backend goes by is what a calibration is matched to (brag.shipped_calibration).
        "model": brag.llm_name(llm),
        **(meta or {}),
        "k": k,
        "m": m,
        "hops": hops,
        "evidence": evidence,
        "n_questions": len(items),
        "split_ids": [i.id for i in items],
        "f1_threshold": f1_threshold,
        "prior": prior_text(list(fitted["actions"]), table),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        **fitted,
        "gate": gate,
    }
    brag.load_calibration(result, brag.with_shipped(table))  # fails loudly if the loader rejects the fit
    return result


# ------------------------------------------------------------------------------------------
# Pooling: one fit per model from every labelled set
# ------------------------------------------------------------------------------------------

POOL_FOLDS = 5


def pool(
    sets: Sequence[tuple[Mapping[str, Any], Sequence[Outcome]]],
    meta: dict[str, Any] | None = None,
    evidence: str | None = None,
) -> dict[str, Any]:
    """One calibration from several calibrations' outcomes (one model, the same settings).

    The labelled outcomes of every set are fitted together, without a gate (a gate's
    thresholds belong to one corpus's retrieval scores), so each read's reliability is over all
    its votes. For each set, its own fit and the pooled one are compared by cross-validation on
    its questions (:func:`own_or_pooled`); ``replaces`` names the corpora whose own fit the
    pooled one beats, and :func:`brag.shipped_calibration` gives those the pooled fit.
    """
    if len(sets) < 2:
        raise brag.InputError("pool needs at least two calibrations")
    first = sets[0][0]
    for calibration, outcomes in sets:
        for key in ("model", "k", "m", "hops"):
            if calibration.get(key) != first.get(key):
                raise brag.InputError(
                    f"pool: {calibration.get('name')} has {key} = {calibration.get(key)!r}, "
                    f"{first.get('name')} has {first.get(key)!r}; pool fits of one model and one setting"
                )
        if not all(o.labelled for o in outcomes):
            raise brag.InputError(f"pool: {calibration.get('name')} has questions without gold answers")
        mine, theirs = (sorted(c.get("actions") or {}) for c in (calibration, first))
        if mine != theirs:
            raise brag.InputError(
                f"pool: {calibration.get('name')} fitted the actions {', '.join(mine)}, {first.get('name')} "
                f"{', '.join(theirs)}; pool fits of the same actions"
            )
    m, hops = int(first["m"]), int(first["hops"])
    evidence = evidence or str(first.get("evidence") or "curve")  # as the fits pooled were fitted
    together = without_gate([o for _, outcomes in sets for o in outcomes])
    fitted = fit(together, m, hops, evidence)
    names = [str(c.get("corpus") or c.get("name")) for c, _ in sets]
    comparison = {name: own_or_pooled(i, sets, m, hops, evidence) for i, name in enumerate(names)}
    return _pooled_file(
        fitted,
        {
            "model": first.get("model"),
            "name": "pooled",
            **(meta or {}),
            "corpus": "pooled",
            "pooled_from": names,
            "replaces": [name for name, scores in comparison.items() if scores["pooled"] < scores["own"]],
            "cross_validation": comparison,
            "k": first.get("k"),
            "m": m,
            "hops": hops,
            "evidence": evidence,
            "n_questions": len(together),
            "f1_threshold": first.get("f1_threshold"),
            "note": f"pooled by calibrate.py from {', '.join(names)}",
        },
    )


def _pooled_file(fitted: dict[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """A fit over several sets as a calibration file (no gate: its thresholds are one corpus's), checked."""
    result = {
        "version": brag.CALIBRATION_VERSION,
        "source": "fitted",
        "fitted": True,
        **meta,
        "prior": prior_text(list(fitted["actions"])),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        **fitted,
        "gate": None,
    }
    brag.load_calibration(result)
    return result


def own_or_pooled(
    index: int,
    sets: Sequence[tuple[Mapping[str, Any], Sequence[Outcome]]],
    m: int,
    hops: int,
    evidence: str = "curve",
) -> dict[str, float]:
    """Held-out vote log-loss on set ``index``'s questions of its own fit and of the pooled fit.

    ``POOL_FOLDS`` folds of its questions: each fold is scored by a fit on the set's other folds
    (its own, with its gate's verdicts) and by a fit on those plus every other set (pooled, no
    gate), as :func:`vote_losses` scores them. Lower is better.
    """
    own_calibration, outcomes = sets[index]
    others = without_gate([o for i, (_, found) in enumerate(sets) if i != index for o in found])
    own_loss, pooled_loss = [], []
    for fold in range(POOL_FOLDS):
        train = [o for i, o in enumerate(outcomes) if i % POOL_FOLDS != fold]
        test = [o for i, o in enumerate(outcomes) if i % POOL_FOLDS == fold]
        own = _loaded({**fit(train, m, hops, evidence), "gate": own_calibration.get("gate")}, m)
        pooled = _loaded(fit(others + without_gate(train), m, hops, evidence), m)
        own_loss += vote_losses(own, test, hops)
        pooled_loss += vote_losses(pooled, without_gate(test), hops)
    return {"own": round(float(np.mean(own_loss)), 5), "pooled": round(float(np.mean(pooled_loss)), 5)}


def without_gate(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """Outcomes as a fit without a gate sees them: no window judged weak or strong."""
    return [replace(o, weak={}) for o in outcomes]


def documents_fit(
    sets: Mapping[str, Sequence[Outcome]],
    m: int,
    hops: int,
    *,
    model: str,
    found: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
) -> dict[str, Any]:
    """The model's fit for documents: labelled questions over real manuals, every set together.

    What BRAG knows about documents before a self-test (which reads do well on a manual, how
    often closed-book helps there) holds across manuals, not for one corpus: uploaded and pasted
    documents use this fit (:func:`brag.shipped_calibration`), and a self-test refits it.
    ``found``: its :func:`fit_found` model, fitted on runs under this fit; ``evidence``: see
    :data:`EVIDENCE_VARIANTS`.
    """
    if len(sets) < 2:
        raise brag.InputError("a documents fit needs at least two sets of documents")
    together = without_gate([o for outcomes in sets.values() for o in outcomes])
    if not together or not all(o.labelled for o in together):
        raise brag.InputError("a documents fit needs questions with gold answers")
    fitted = fit(together, m, hops, evidence, table)
    fitted = _fit_partly_observed(fitted, together, m, hops, evidence, table)
    meta = {
        "model": model,
        "name": brag.DOCUMENTS,
        **dict(meta or {}),
        "corpus": brag.DOCUMENTS,
        "pooled_from": list(sets),
        "k": 5,
        "m": m,
        "hops": hops,
        "evidence": evidence,
        "n_questions": len(together),
        "f1_threshold": 0.8,
        "note": f"fitted by calibrate.documents_fit on {', '.join(sets)}",
    }
    return _pooled_file({**fitted, **({"found": dict(found)} if found is not None else {})}, meta)


def _fit_partly_observed(
    fitted: dict[str, Any],
    outcomes: Sequence[Outcome],
    m: int,
    hops: int,
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
) -> dict[str, Any]:
    """``fitted`` with each action some sets observed and others did not, fitted on those that did.

    A second hop costs the most to observe, so not every set runs it; its entry (and cost) come
    from the questions it ran on (``fitted_on.subsets`` says how many), the other actions' from
    every question.
    """
    result = {**fitted, "actions": dict(fitted["actions"]), "counts": dict(fitted["counts"])}
    costs = dict(fitted["costs"]) if fitted.get("costs") is not None else None
    subsets = {}
    for action in table:
        some = [o for o in outcomes if action.label in o.answers]
        if action.label in fitted["actions"] or not some:
            continue
        alone = fit(some, m, hops, evidence, table)
        result["actions"][action.label] = alone["actions"][action.label]
        result["counts"][action.label] = alone["counts"][action.label]
        subsets[action.label] = len(some)
        known = (alone.get("costs") or {}).get(action.label)
        costs = {**costs, action.label: known} if costs is not None and known else None  # all, or none
    order = [a.label for a in table]
    result["actions"] = dict(sorted(result["actions"].items(), key=lambda item: order.index(item[0])))
    result.pop("costs", None)
    if subsets:
        result["fitted_on"] = {**result.get("fitted_on", {}), "subsets": subsets}
    return {**result, "costs": costs} if costs is not None else result


# The share of right answers a FoundModel may flag on the questions it is fitted on (it is
# checked on held-out sets: bench/documents_fit.py).
FOUND_RIGHT_FLAGGED = 0.03
FOUND_L2 = 1.0


def fit_found(rows: Sequence[tuple[Mapping[str, float], bool, bool]]) -> dict[str, Any]:
    """A :class:`brag.FoundModel` from runs: (signals, the documents answer it, the answer was right).

    A logistic model of "the documents answer this question" on ``brag.FOUND_SIGNALS``, its
    threshold the highest that flags at most ``FOUND_RIGHT_FLAGGED`` of the right answers.
    Needs both kinds of question.
    """
    answerable = np.array([bool(a) for _, a, _ in rows])
    if answerable.all() or not answerable.any():
        raise brag.InputError(
            "fitting 'not in your documents' needs questions the documents answer and ones they cannot"
        )
    names = brag.FOUND_SIGNALS
    x = np.array([[float(signals.get(n, 0.0)) for n in names] for signals, _, _ in rows])
    model = fit_logistic(x, answerable.astype(float), l2=FOUND_L2)
    coef = np.asarray(model["coef"]) / np.asarray(model["std"])
    intercept = model["intercept"] - float(coef @ np.asarray(model["mean"]))
    found = brag.FoundModel(intercept, dict(zip(names, coef.tolist(), strict=True)), 0.0)
    right = [found.p_found(signals) for signals, a, r in rows if a and r and brag.found_by_rule(signals)]
    threshold = float(np.quantile(right, FOUND_RIGHT_FLAGGED, method="lower")) if right else 0.5
    return {
        "intercept": round(intercept, 6),
        "weights": {n: round(w, 6) for n, w in found.weights.items()},
        "threshold": round(max(0.0, min(1.0, threshold)), 6),
        "fitted_on": {"questions": len(rows), "unanswerable": int((~answerable).sum()), "right": len(right)},
    }


def vote_losses(calibration: brag.Calibration, outcomes: Sequence[Outcome], hops: int) -> list[float]:
    """The log-loss of each vote's reliability against its right/wrong flag (:meth:`KindFit.loss_votes`).

    Each vote is typed as the runner would type it under ``calibration`` (its evidence level,
    the gate's verdict, the agreement level), and weighed by its own reliability where an
    evidence curve gives it one. A repeated answer is left out: its "reliability" encodes a
    likelihood ratio, not how often it is right.
    """
    actions = [a for a in calibration.offered() if all(a.label in o.answers for o in outcomes)]
    priors = calibration.source_priors(calibration.m)
    return [
        -(right * math.log(p) + (1 - right) * math.log(1 - p))
        for o in outcomes
        for action in actions
        for p, right in _vote_reliabilities(calibration, priors, action, o, hops)
    ]


def _vote_reliabilities(
    calibration: brag.Calibration, priors: Mapping, action: brag.Action, outcome: Outcome, hops: int
) -> list[tuple[float, float]]:
    """(reliability, right) of each of an action's votes on one question, typed under ``calibration``.

    A vote's own reliability where its curve gives one, else its type's mean under ``priors``
    (the calibration's ``source_priors``); kept off 0 and 1.
    """
    found = []
    for vote_type, right, own in fit_of(action).loss_votes(calibration, action, outcome, hops):
        a, b = priors[vote_type]
        found.append((min(max(a / (a + b) if own is None else own, 1e-6), 1 - 1e-6), float(right)))
    return found


# ------------------------------------------------------------------------------------------
# Readers: one documents fit across readers, and the few terms that are each reader's own
# ------------------------------------------------------------------------------------------

# Pseudo-votes at "as the common fit has it" (offset 0, scale 1) that pull each reader's terms:
# chosen by leaving one reader out (bench/models.py, bench/results/models.md).
READER_STRENGTH = 10.0


def reader_votes(
    calibration: brag.Calibration, outcomes: Sequence[Outcome], hops: int = 1
) -> dict[str, list[tuple[float, float]]]:
    """Per action, each vote's reliability logit under ``calibration`` and whether it was right.

    The votes :func:`vote_losses` scores, typed the same way (a vote's own reliability where
    its curve gives one, else its type's): what a reader's terms move.
    """
    priors = calibration.source_priors(calibration.m)
    found = {
        action.label: [
            (math.log(p / (1 - p)), right)
            for o in outcomes
            if action.label in o.answers
            for p, right in _vote_reliabilities(calibration, priors, action, o, hops)
        ]
        for action in calibration.offered()
    }
    return {label: rows for label, rows in found.items() if rows}


def fit_reader_terms(
    calibration: brag.Calibration,
    outcomes: Sequence[Outcome],
    strength: float = READER_STRENGTH,
    hops: int = 1,
) -> dict[str, brag.ReaderTerms]:
    """A reader's terms for each of ``calibration``'s actions, from its votes on ``outcomes``.

    A logistic regression of right on the vote's logit under ``calibration`` (offset and
    scale), pulled toward (0, 1) by ``strength`` pseudo-votes: few votes leave the common
    fit nearly as it is. Votes that all share one logit move the offset alone.
    """
    terms = {}
    for label, rows in reader_votes(calibration, outcomes, hops).items():
        z = np.array([logit for logit, _ in rows])
        y = np.array([right for _, right in rows])
        if np.ptp(z) > 1e-6:
            offset, scale = _toward_logistic(z[:, None], y, np.array([0.0, 1.0]), strength, True)
        else:  # no spread to scale: the level alone, each vote at its own logit
            (offset,), scale = (
                _toward_logistic(np.empty((len(z), 0)), y, np.zeros(1), strength, True, offset=z),
                1.0,
            )
        terms[label] = brag.ReaderTerms(round(float(offset), 6), round(max(float(scale), 0.05), 6))
    return terms


def with_reader_terms(calibration: brag.Calibration, terms: Mapping[str, brag.ReaderTerms]) -> dict[str, Any]:
    """``calibration`` with each action's entry under its terms, as a calibration file holds it."""
    actions = {
        label: terms[label].prior(p) if label in terms else p for label, p in calibration.actions.items()
    }
    return replace(calibration, actions=actions).to_dict()


def cross_reader_fit(
    readers: Mapping[str, Mapping[str, Sequence[Outcome]]],
    m: int,
    hops: int,
    *,
    found: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    evidence: str = "curve",
    table: Table = brag.ACTION_TABLE,
    strength: float = READER_STRENGTH,
) -> dict[str, Any]:
    """The documents fit across readers: ``readers`` maps each reader's name to its sets' outcomes.

    One :func:`documents_fit` over every reader's questions (its curves, found model and
    repeats hold for any reader), with each reader's own terms fitted on its own questions
    (:func:`fit_reader_terms`) in ``readers``. A reader it was not fitted on reads with the
    common fit (:meth:`brag.Calibration.for_reader`) until a self-test fits its terms.
    """
    if len(readers) < 2:
        raise brag.InputError("a fit across readers needs at least two readers")
    sets = {f"{reader}/{name}": outs for reader, by_set in readers.items() for name, outs in by_set.items()}
    common = documents_fit(
        sets, m, hops, model=CROSS_READER_MODEL, found=found, meta=meta, evidence=evidence, table=table
    )
    common = {**common, brag.ACROSS_READERS: list(readers)}
    base = brag.load_calibration(common, table)
    terms = {
        reader: fit_reader_terms(base, [o for outs in by_set.values() for o in outs], strength, hops)
        for reader, by_set in readers.items()
    }
    common["readers"] = {r: {a: asdict(t) for a, t in own.items()} for r, own in terms.items()}
    brag.load_calibration(common, table)  # fails loudly if the loader rejects it
    return common


CROSS_READER_MODEL = "any reader"  # the model a fit across readers names until made for one


# ------------------------------------------------------------------------------------------
# A corpus's own fit: the pooled fit refitted on questions about the corpus
# ------------------------------------------------------------------------------------------

# Pseudo-observations at the base value that each refitted rate gets. Chosen by leaving one
# labelled real-document set out at a time with the documents fit as the base
# (bench/documents_fit.py, bench/results/documents_fit.md): the held-out loss falls as the
# strength grows, because the questions a self-test keeps are easier than a user's and
# over-state the focused read; 100 is the smallest strength on the flat tail.
SELF_TEST_STRENGTH = 100.0
SELF_TEST = "self-test"  # fitted_on.kind, and the name, of a corpus's refit


def base_of(pooled: brag.Calibration, action: brag.Action) -> brag.ActionPrior:
    """What an action's refit starts from: its pooled entry, else the first pooled one of its shape.

    The focused read has no pooled entry (no labelled set ran it); it starts from the read of
    the whole window, whose evidence score it shares, and its own questions move it from there.
    """
    if action.label in pooled.actions:
        return pooled.actions[action.label]
    shape = action.kind.fit_shape  # a kind is known by what it declares, never by its class
    twin = next((a for a in pooled.offered() if a.kind.fit_shape == shape), None)
    return pooled.actions[twin.label] if twin is not None else pooled.prior_of(action)


def refit(
    pooled: brag.Calibration | Mapping[str, Any],
    outcomes: Sequence[Outcome],
    strength: float = SELF_TEST_STRENGTH,
    hops: int = 1,
    curve_strength: float | None = None,
) -> dict[str, Any]:
    """``pooled`` refitted on ``outcomes`` (labelled): a loadable calibration's actions, eta, counts, costs.

    Kept from the pooled fit: eta and each read's evidence score (its discrimination, which
    transfers between corpora). Refitted, each shrunk toward its pooled value with ``strength``
    pseudo-observations: every action's q and rho, each evidence level's share and reliability,
    a hop's branches, each closed-book agreement level's share and reliability
    (:meth:`KindFit.fit`, the estimator a labelled fit uses from the row's prior), and each
    evidence curve, pulled toward the pooled one by ``curve_strength`` (default
    ``CURVE_STRENGTH``) and kept unless the refit predicts better (:func:`refit_curve`). Every action
    the outcomes observed gets an entry; the base's others (a second hop, which a self-test does
    not run) keep theirs, and their costs. The outcomes' labels name ``pooled``'s rows (its table).
    """
    pooled = brag.load_calibration(pooled)
    _check_labelled(outcomes)
    observed = observed_actions(outcomes, pooled.table)
    counts = {a.label: _tally(outcomes, a.label) for a in observed}
    actions = {
        a.label: a.kind.entry_dict(
            fit_of(a).fit(
                outcomes,
                a.label,
                Base(
                    base_of(pooled, a),
                    strength,
                    curve_strength=CURVE_STRENGTH if curve_strength is None else curve_strength,
                ),
                hops,
                pooled.eta,
                dict(counts[a.label]),  # the fit may extend its copy; the refit's counts stay tallies
                observed,
            )
        )
        for a in observed
    }
    kept = [a for a in pooled.offered() if a.label not in actions]  # not observed: as the base has them
    actions.update({a.label: a.kind.entry_dict(pooled.prior_of(a)) for a in kept})
    fitted: dict[str, Any] = {
        "version": brag.CALIBRATION_VERSION,
        "m": pooled.m,
        "eta": pooled.eta,
        "actions": {a.label: actions[a.label] for a in pooled.table if a.label in actions},
        "counts": counts,
    }
    costs = fit_costs(outcomes, observed)
    if costs is not None and kept:
        base_costs = pooled.costs or {}
        costs = {**costs, **{a.label: asdict(base_costs[a.label]) for a in kept if a.label in base_costs}}
        costs = costs if all(a.label in costs for a in kept) else None
    return {**fitted, "costs": costs} if costs is not None else fitted


def self_test_fit(
    pooled: brag.Calibration | Mapping[str, Any],
    outcomes: Sequence[Outcome],
    *,
    corpus: str,
    model: str | None = None,
    strength: float = SELF_TEST_STRENGTH,
    hops: int = 1,
    k: int | None = None,
    meta: Mapping[str, Any] | None = None,
    curve_strength: float | None = None,
    adapt: str = "refit",
    reader_strength: float | None = None,
) -> dict[str, Any]:
    """A corpus's calibration: :func:`refit` of the model's pooled fit on its self-test questions.

    ``adapt="terms"`` moves a base fitted across readers by this reader's terms alone
    (:func:`reader_adapted`); the default, a refit, won on held-out readers (bench/results/models.md).

    ``outcomes``: every action on the self-test questions (ids ``self-N``) and on any questions
    the user labelled; ``corpus``: the corpus's fingerprint; ``model``: the reader's name
    (default: the pooled fit's); ``meta``: what the self-test recorded (generator, yield), kept
    in ``fitted_on``.
    """
    base = brag.load_calibration(pooled)
    by_terms = bool(outcomes) and base.across_readers and adapt == "terms"
    if by_terms:
        fitted = reader_adapted(base, outcomes, hops, reader_strength)
    else:
        fitted = refit(base, outcomes, strength, hops, curve_strength) if outcomes else _as_it_is(base)
    own = sum(not o.id.startswith("self-") for o in outcomes)
    result = {
        "version": brag.CALIBRATION_VERSION,
        "source": "fitted",
        "fitted": True,
        "model": model or base.meta.get("model"),
        "name": SELF_TEST,
        "corpus": corpus,
        "refit_of": base.meta.get("name") or base.meta.get("corpus"),
        "shrinkage": strength,
        "k": k if k is not None else base.meta.get("k", 5),  # the passages its reads held
        "m": base.m,
        "hops": hops,
        "n_questions": len(outcomes),
        "f1_threshold": base.meta.get("f1_threshold", 0.8),
        "note": "the shipped fit refitted on questions written from this corpus (calibrate.self_test_fit)",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        **fitted,
        "fitted_on": {
            "kind": SELF_TEST,
            "questions": len(outcomes) - own,
            "labelled": own,
            **({"adapted": "reader terms"} if by_terms else {}),
            **dict(meta or {}),
        },
        "gate": None,
        **({"found": base.found.to_dict()} if base.found is not None else {}),
    }
    brag.load_calibration(result, base.table)  # fails loudly if the loader rejects the fit
    return result


def reader_adapted(
    base: brag.Calibration, outcomes: Sequence[Outcome], hops: int = 1, strength: float | None = None
) -> dict[str, Any]:
    """``base`` under the reader terms its self-test outcomes fit, as :func:`refit` returns a fit.

    Its curves, repeats, eta and found model are the readers' common ones; each action's
    reliabilities move by :func:`fit_reader_terms` (shrunk toward the base's); an action's cost
    is the one the self-test measured, else the base's.
    """
    _check_labelled(outcomes)
    strength = READER_STRENGTH if strength is None else strength
    adapted = with_reader_terms(base, fit_reader_terms(base, outcomes, strength, hops))
    observed = observed_actions(outcomes, base.table)
    base_costs = {label: asdict(cost) for label, cost in (base.costs or {}).items()}
    costs = {**base_costs, **(fit_costs(outcomes, [a for a in observed if a.label in base.actions]) or {})}
    costs = costs if set(costs) == set(base.actions) else None  # every action's, or none
    fitted = {key: adapted[key] for key in ("version", "m", "eta", "actions")}
    fitted["counts"] = {a.label: _tally(outcomes, a.label) for a in observed}
    return {**fitted, "costs": costs} if costs is not None else fitted


def _check_labelled(outcomes: Sequence[Outcome]) -> None:
    if not outcomes or not all(o.labelled for o in outcomes):
        raise brag.InputError("a refit needs questions with known answers")


def _as_it_is(base: brag.Calibration) -> dict[str, Any]:
    """A refit on no questions: ``base``'s entries, eta and costs, as :func:`refit` returns them."""
    found = base.to_dict()
    return {key: found[key] for key in ("version", "m", "eta", "actions", "costs") if key in found} | {
        "counts": {}
    }


def _toward(successes: float, trials: float, base: float, strength: float) -> float:
    """:func:`shrunk` toward ``base``; ``base`` itself when there is nothing to go on."""
    return base if trials + strength <= 0 else shrunk(successes, trials, base, strength)


def _beta_pair(mean: float) -> tuple[float, float]:
    beta = _beta(min(max(mean, 1e-4), 1 - 1e-4))
    return beta["a"], beta["b"]


def _branch_toward(
    base: brag.Branch, own: Mapping[str, Any], outcomes: Sequence[Outcome], strength: float
) -> brag.Branch:
    """A read's ``same`` branch: ``own``'s and ``base``'s reliabilities averaged in log-odds.

    Weighted by the questions against ``strength``, as a hop's branch is refitted.
    """
    weight = len(outcomes) / (len(outcomes) + strength) if strength else 1.0
    own_odds = own["rho"]["a"] / own["rho"]["b"]
    base_odds = base.mean / (1 - base.mean)
    odds = math.exp(weight * math.log(own_odds) + (1 - weight) * math.log(base_odds))
    pi = weight * own["pi"] + (1 - weight) * base.pi
    return brag.Branch(round(pi, 6), *_beta_pair(odds / (1 + odds)))


def _refit_levels(split: brag.EvidenceSplit, votes: Sequence[Vote], strength: float) -> brag.EvidenceSplit:
    """``split``'s score and threshold, with its levels' shares and reliabilities from ``votes``.

    ``hi`` stays at least as reliable as ``lo``: where the votes say otherwise the two levels
    share their weighted mean.
    """
    tallies = {level.name: [0, 0.0] for level in split.levels}
    for features, right in votes:
        level = split.level(features)
        if level is not None:
            tallies[level.name][0] += 1
            tallies[level.name][1] += right
    total = sum(n for n, _ in tallies.values())
    shares = [_toward(tallies[lv.name][0], total, lv.pi, strength) for lv in split.levels]
    rhos = [_toward(tallies[lv.name][1], tallies[lv.name][0], lv.mean, strength) for lv in split.levels]
    weights = [tallies[lv.name][0] + strength for lv in split.levels]
    lo_first = _non_decreasing(rhos[::-1], weights[::-1])
    hi_rho, lo_rho = lo_first[1], lo_first[0]
    hi_pi = shares[0] / sum(shares)
    return replace(
        split,
        hi=brag.EvidenceLevel("hi", round(hi_pi, 6), *_beta_pair(hi_rho)),
        lo=brag.EvidenceLevel("lo", round(1 - hi_pi, 6), *_beta_pair(lo_rho)),
    )


# ------------------------------------------------------------------------------------------
# What calibration observes of each vote kind, and how it fits it
# ------------------------------------------------------------------------------------------

Reads = list[tuple[str, float]]  # (answer, right) of every read of a question so far


@dataclass(frozen=True)
class Base:
    """What a fit starts from: an entry and how many observations it counts for.

    A labelled fit starts from the action's row (its kind's hand-set prior, ``PRIOR_STRENGTH``,
    ``from_row``); a self-test refit from the pooled fit's entry (``SELF_TEST_STRENGTH``).
    """

    prior: brag.ActionPrior
    strength: float
    from_row: bool = False  # the row's prior: one guess for every model, no data behind it
    curve_strength: float = 0.0  # the pull toward its evidence curve, when it has one (CURVE_STRENGTH)


class KindFit:
    """Calibration's side of a :class:`brag.VoteKind`: what a run of it records, and its fit.

    ``runs``: how often calibration runs it per question; ``observe``: what one run adds to an
    :class:`Outcome`; ``fit``: its calibration entry from the outcomes; ``evidence_votes``: the
    votes its evidence levels are fitted on (None: it has none); ``em_votes``: its votes as the
    EM's vote model sees them; ``loss_votes``: its votes, typed under a calibration, with
    right/wrong, as :func:`vote_losses` scores them.
    """

    def runs(self, hops: int) -> int:
        """How often calibration runs it on each question."""
        return 1

    def observe(
        self, outcome: Outcome, label: str, seen: brag.Observation, right: bool, reads: Reads
    ) -> None:
        """Record one run of it (``seen``: its step's observation) in ``outcome``."""
        raise NotImplementedError

    def fit(
        self,
        outcomes: Sequence[Outcome],
        label: str,
        base: Base,
        hops: int,
        eta: float,
        counts: dict[str, Any],
        observed: Table = (),
    ) -> brag.ActionPrior:
        """Its entry from ``outcomes``: each value shrunk toward ``base``'s with its strength.

        The one estimator of its kind: a labelled fit starts from the row's prior, a self-test
        refit from the pooled fit, so whatever it fits is fitted and refitted the same way.
        ``counts``: its tallies (n, answered, correct), which the fit may extend; ``eta`` the
        calibration's, at which a hop's branches are read; ``observed``: every action the
        outcomes observed (a read's repeats are counted against the others).
        """
        raise NotImplementedError

    def evidence_votes(self, outcomes: Sequence[Outcome], label: str, hops: int) -> list[Vote] | None:
        """The votes its evidence levels are fitted on: (features, right); None: it has none."""
        return None

    def em_votes(self, votes: _Votes, label: str, hops: int) -> None:
        """Add its votes on one question to ``votes``, in the EM's vote types."""
        raise NotImplementedError

    def loss_votes(
        self, calibration: brag.Calibration, action: brag.Action, outcome: Outcome, hops: int
    ) -> list[tuple[brag.VoteType, float, float | None]]:
        """Its votes on one question, typed under ``calibration``, with right/wrong and own rho."""
        raise NotImplementedError


class ReadFit(KindFit):
    """A read: its answer, its evidence features; q and rho (per gate verdict), evidence levels."""

    def observe(
        self, outcome: Outcome, label: str, seen: brag.Observation, right: bool, reads: Reads
    ) -> None:
        """Record one run of it (``seen``: its step's observation) in ``outcome``."""
        outcome.answers[label] = seen.answer
        outcome.evidence.setdefault(label, dict(seen.evidence or {}))
        reads.append((seen.answer, right))

    def fit(
        self,
        outcomes: Sequence[Outcome],
        label: str,
        base: Base,
        hops: int,
        eta: float,
        counts: dict[str, Any],
        observed: Table = (),
    ) -> brag.ActionPrior:
        """Q and rho toward base's, per gate verdict when the gate judged its windows.

        Each verdict's toward the whole; its evidence levels' shares and reliabilities under
        base's score, when base has one (a labelled fit then chooses its own:
        :func:`fit_evidence_levels`).
        """
        whole_q = _toward(counts["answered"], counts["n"], base.prior.q, base.strength)
        whole_rho = _toward(counts["correct"], counts["answered"], base.prior.mean, base.strength)
        q, rho, weak = whole_q, whole_rho, None
        judged = [o for o in outcomes if o.weak.get(label) is not None]
        for verdict, key in ((False, "strong"), (True, "weak")) if judged else ():
            part = counts[key] = _tally([o for o in judged if o.weak[label] is verdict], label)
            part_q = _toward(part["answered"], part["n"], whole_q, base.strength)
            part_rho = _toward(part["correct"], part["answered"], whole_rho, base.strength)
            if verdict:
                weak = brag.ActionPrior(round(part_q, 6), *_beta_pair(part_rho))
            else:
                q, rho = part_q, part_rho
        evidence, curve, same = base.prior.evidence, base.prior.curve, None
        votes = self.evidence_votes(outcomes, label, hops) or []
        if evidence is not None:
            evidence = _refit_levels(evidence, votes, base.strength)
        if curve is not None and not base.from_row:
            curve = refit_curve(curve, votes, base.curve_strength)
        if base.prior.same is not None:
            own = fit_repeats(outcomes, label, eta, observed or None)
            same = (
                base.prior.same
                if own is None
                else _branch_toward(base.prior.same, own, outcomes, base.strength)
            )
        return brag.ActionPrior(
            round(q, 6), *_beta_pair(rho), weak=weak, evidence=evidence, curve=curve, same=same
        )

    def evidence_votes(self, outcomes: Sequence[Outcome], label: str, hops: int) -> list[Vote] | None:
        """The votes its evidence levels are fitted on: (features, right); None: it has none."""
        return [(o.evidence.get(label) or {}, float(o.correct[label])) for o in outcomes if o.answers[label]]

    def em_votes(self, votes: _Votes, label: str, hops: int) -> None:
        """Add its votes on one question to ``votes``, in the EM's vote types."""
        mine = votes.index(votes.outcome.answers[label])
        votes.slots[label] = mine
        if mine is not None:
            votes.votes.append((brag.VoteType(label, "weak" if votes.outcome.weak.get(label) else ""), mine))
            votes.earlier.append(mine)

    def loss_votes(
        self, calibration: brag.Calibration, action: brag.Action, outcome: Outcome, hops: int
    ) -> list[tuple[brag.VoteType, float, float | None]]:
        """Its votes on one question, typed under ``calibration``, with right/wrong."""
        label = action.label
        if not outcome.answers[label]:
            return []
        weak = calibration.gate is not None and bool(outcome.weak.get(label))
        evidence = outcome.evidence.get(label) or {}
        prior = calibration.actions[label]
        vote_type = action.kind.vote_type(label, prior, brag.VoteFacts(evidence, weak=weak))
        return [(vote_type, outcome.correct[label], action.kind.reliability(prior, vote_type, evidence))]


class HopFit(ReadFit):
    """A second hop: each of its reads against the answers before it; a read's fit and its branches."""

    def runs(self, hops: int) -> int:
        """How often calibration runs it on each question."""
        return hops

    def observe(
        self, outcome: Outcome, label: str, seen: brag.Observation, right: bool, reads: Reads
    ) -> None:
        """Record one run of it (``seen``: its step's observation) in ``outcome``."""
        answer = seen.answer
        earlier = [a for a, _ in reads if a]
        mine = outcome.hops.setdefault(label, [])
        mine.append(
            {
                "answer": answer,
                "correct": right,
                "repeats": bool(answer) and any(brag.same_answer(answer, a) for a in earlier),
                "after_answer": bool(earlier),
                "after_right": any(r for _, r in reads),
                "evidence": dict(seen.evidence or {}),
            }
        )
        outcome.answers[label] = mine[0]["answer"]  # its first read stands for it as a source
        reads.append((answer, right))

    def fit(
        self,
        outcomes: Sequence[Outcome],
        label: str,
        base: Base,
        hops: int,
        eta: float,
        counts: dict[str, Any],
        observed: Table = (),
    ) -> brag.ActionPrior:
        """A read's fit, and its branches: how often it repeats, how often a new answer is right.

        The ``same`` branch's reliability encodes a likelihood ratio, not a rate of right
        answers (:func:`fit_second_hop`): from a base that has one, the fit is a weighted mean
        of base's and these outcomes' own in log-odds (its weight the reads after an answer,
        against base's strength); the row's prior has none, so the outcomes' own stands.
        """
        # Its branches are its own: the read's fit of a repeat (a read of the question's window) is not.
        unrepeated = replace(base, prior=replace(base.prior, same=None))
        read = super().fit(outcomes, label, unrepeated, hops, eta, counts, observed)
        own_same, new, counts["hops"] = fit_second_hop(outcomes, label, hops, eta, base)
        same = brag.Branch(own_same["pi"], own_same["rho"]["a"], own_same["rho"]["b"])
        if base.prior.same is not None:
            reads = [h for o in outcomes for h in o.hops.get(label, [])[:hops]]
            answered_after = sum(1 for h in reads if h["after_answer"] and h["answer"])
            strength = base.strength
            weight = answered_after / (answered_after + strength) if strength else 1.0
            own_odds = same.a / same.b  # the likelihood ratio times eta
            base_odds = base.prior.same.mean / (1 - base.prior.same.mean)
            odds = math.exp(weight * math.log(own_odds) + (1 - weight) * math.log(base_odds))
            same = brag.Branch(same.pi, *_beta_pair(odds / (1 + odds)))
        _, base_new = brag.Hop.branches(base.prior)
        return replace(read, same=same, new=brag.Branch(base_new.pi, new["rho"]["a"], new["rho"]["b"]))

    def evidence_votes(self, outcomes: Sequence[Outcome], label: str, hops: int) -> list[Vote] | None:
        """The votes its evidence levels are fitted on: (features, right); None: it has none."""
        return [
            (h.get("evidence") or {}, float(h["correct"]))
            for o in outcomes
            for h in o.hops.get(label, [])[:hops]
            if h["answer"] and not h["repeats"]
        ]

    def em_votes(self, votes: _Votes, label: str, hops: int) -> None:
        """Add its votes on one question to ``votes``, in the EM's vote types."""
        slots = votes.hop_slots[label] = []
        for hop in votes.outcome.hops.get(label, []):
            mine = votes.index(hop["answer"])
            slots.append((mine, list(votes.earlier)))
            if mine is not None:
                if len(slots) <= hops:
                    votes.votes.append((brag.VoteType(label, "same" if hop["repeats"] else "new"), mine))
                votes.earlier.append(mine)
        votes.slots[label] = slots[0][0] if slots else votes.index(votes.outcome.answers[label])

    def loss_votes(
        self, calibration: brag.Calibration, action: brag.Action, outcome: Outcome, hops: int
    ) -> list[tuple[brag.VoteType, float, float | None]]:
        """Its votes on one question, typed under ``calibration``, with right/wrong."""
        prior, kind = calibration.actions[action.label], action.kind
        typed = [
            (kind.vote_type(action.label, prior, brag.VoteFacts(hop.get("evidence") or {})), hop)
            for hop in outcome.hops.get(action.label, [])[:hops]
            if hop["answer"] and not hop["repeats"]
        ]
        return [
            (t, hop["correct"], kind.reliability(prior, t, hop.get("evidence") or {})) for t, hop in typed
        ]


class SamplesFit(KindFit):
    """Closed-book samples: their mode and agreement level; q and each level's share and reliability."""

    def observe(
        self, outcome: Outcome, label: str, seen: brag.Observation, right: bool, reads: Reads
    ) -> None:
        """Record one run of it (``seen``: its step's observation) in ``outcome``."""
        outcome.answers[label] = seen.answer
        outcome.agreement[label] = seen.details["agreement"]

    def fit(
        self,
        outcomes: Sequence[Outcome],
        label: str,
        base: Base,
        hops: int,
        eta: float,
        counts: dict[str, Any],
        observed: Table = (),
    ) -> brag.ActionPrior:
        """Q toward base's, and per agreement level its share and reliability (non-decreasing in g).

        From a fitted base, each level toward base's level. From the row's prior (one guess for
        every model), each level's reliability toward the model's own precision over all levels
        (:func:`closed_book_reliabilities`) and the shares Dirichlet(1): a weak model rarely
        reaches high agreement, and a hand-set level met by one or two votes would stand.
        """
        answered = [o for o in outcomes if o.answers[label]]
        counts["levels"], tallies = {}, []
        for level in base.prior.levels:
            at_g = [o for o in answered if o.agreement.get(label) == level.g]
            right = sum(o.correct[label] for o in at_g)
            counts["levels"][str(level.g)] = {"n": len(at_g), "correct": round(right, 4)}
            tallies.append((right, len(at_g)))
        q = round(_toward(counts["answered"], counts["n"], base.prior.q, base.strength), 6)
        shares, kappas = (_row_levels if base.from_row else _levels_toward)(base, tallies, len(answered))
        levels = tuple(
            brag.Level(level.g, pi, *_beta_pair(kappa))
            for level, pi, kappa in zip(base.prior.levels, shares, kappas, strict=True)
        )
        return brag.ActionPrior(q, base.prior.a, base.prior.b, levels=levels)

    def em_votes(self, votes: _Votes, label: str, hops: int) -> None:
        """Add its votes on one question to ``votes``, in the EM's vote types."""
        mine = votes.slots[label] = votes.index(votes.outcome.answers[label])
        if mine is not None:
            votes.votes.append((brag.VoteType(label, str(votes.outcome.agreement.get(label, 0))), mine))

    def loss_votes(
        self, calibration: brag.Calibration, action: brag.Action, outcome: Outcome, hops: int
    ) -> list[tuple[brag.VoteType, float, float | None]]:
        """Its votes on one question, typed under ``calibration``, with right/wrong."""
        g = outcome.agreement.get(action.label, 0)
        if not (outcome.answers[action.label] and g):
            return []
        prior = calibration.actions[action.label]
        vote_type = action.kind.vote_type(
            action.label, prior, brag.VoteFacts(agreement=min(g, calibration.m))
        )
        return [(vote_type, outcome.correct[action.label], None)]


def _row_levels(
    base: Base, tallies: Sequence[tuple[float, int]], answered: int
) -> tuple[list[float], list[float]]:
    """Closed-book levels from the row's prior: Dirichlet(1) shares, each toward the model's precision."""
    m = len(tallies)
    shares = [round((n + 1) / (answered + m), 6) for _, n in tallies]
    total = sum(shares)  # rounding may leave the sum a hair off 1
    return [round(pi / total, 6) for pi in shares], closed_book_reliabilities(tallies)


def _levels_toward(
    base: Base, tallies: Sequence[tuple[float, int]], answered: int
) -> tuple[list[float], list[float]]:
    """Closed-book levels toward a fitted base's: each share and reliability, non-decreasing in g."""
    strength, levels = base.strength, base.prior.levels
    shares = [_toward(n, answered, lv.pi, strength) for lv, (_, n) in zip(levels, tallies, strict=True)]
    kappas = [_toward(right, n, lv.mean, strength) for lv, (right, n) in zip(levels, tallies, strict=True)]
    total = sum(shares)
    return [round(pi / total, 6) for pi in shares], _non_decreasing(
        kappas, [n + strength for _, n in tallies]
    )


# The fitter of each calibration entry's shape, which a kind declares (VoteKind.fit_shape).
FITS: dict[str, KindFit] = {"read": ReadFit(), "hop": HopFit(), "samples": SamplesFit()}


def fit_of(action: brag.Action) -> KindFit:
    """The fitter of the entry shape an action's kind declares (:attr:`brag.VoteKind.fit_shape`)."""
    found = FITS.get(action.kind.fit_shape)
    if found is None:
        raise brag.InputError(
            f"action {action.label}: calibration cannot fit a {action.kind.fit_shape!r} entry"
        )
    return found


def outcomes_path(calibration_path: str | os.PathLike[str]) -> Path:
    """Where the outcomes of the fit in ``calibration_path`` are kept: ``NAME.outcomes.jsonl``."""
    path = Path(calibration_path)
    return path.with_name(f"{path.stem}.outcomes.jsonl")


def read_outcomes(calibration_path: str | os.PathLike[str]) -> list[Outcome]:
    """The outcomes kept beside a calibration file, in question order."""
    path = outcomes_path(calibration_path)
    if not path.is_file():
        raise brag.InputError(f"{path} is missing: pool needs the outcomes each calibration was fitted on")
    return list(read_progress(path, None).values())


if __name__ == "__main__":
    # ``python calibrate.py ...``: the command lines are bragkit's, which import this module as
    # ``calibrate`` (the fitting API imports nothing from bragkit; bragkit builds on it).
    from bragkit.calibrate_cli import main

    sys.exit(main())
