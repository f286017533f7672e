"""The seam a new way to read plugs into: one class and one row, no product file edited.

Two reads a newcomer might add, each kept here as a test of the seam (neither ships): a read
whose window is the question's passages reranked from a wider pool, and the top passage read m
times at a temperature, its mode one vote typed by how many samples agree. Each is a kind
declaring its traits and a row the controller is given (``BRAG(actions=...)``); the runner, the
gate, calibration, the refit and the page act on what it declares.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Any, ClassVar
from unittest import mock

import pytest
from conftest import PRIORS, ScriptedLLM

import brag
import calibrate
from brag import BRAG, Corpus
from bragkit.serving import presentation

QUESTION = "Where was Lina Berg born?"


class RerankRead(brag.Read):
    """A read of the question's top passages reranked from a wider pool: the lowest-scored first."""

    name = "rerank"
    pools: ClassVar[list[brag.Retrieval]] = []  # every pool it retrieved, for the tests

    def window(self, run: brag.WindowContext, action: brag.Action) -> brag.Window:
        """The pool's passages in reverse (a stand-in for a cross-encoder's order), k of them."""
        pool = run.retrieve(run.question, 2 * run.brag.k)
        RerankRead.pools.append(pool)
        return run.window([i for i, _ in pool.hits[::-1]][: run.brag.k], pool)


class SampledRead(brag.Samples):
    """The top passage read ``m`` times at the controller's temperature; the mode is one vote.

    Its votes are typed by agreement, like closed-book samples, so it fits as they do; but it
    reads a passage, the gate judges that passage, and its follow-up query finds a next hop.
    """

    name = "sampled-read"
    reads_passages = True
    gated = True
    sets_next_hop = True

    def window(self, run: brag.WindowContext, action: brag.Action) -> brag.Window:
        """The question's top passage."""
        return run.window([i for i, _ in run.first_hop.hits][:1])

    def step(self, run: brag.StepContext, action: brag.Action, window: brag.Window) -> brag.Observation:
        """``m`` reads of the top passage; the mode and its agreement; the mode's follow-up query."""
        messages = action.messages(run.question, run.passages(window))
        options = {"max_tokens": run.brag.max_tokens, "stop": brag.READ_STOP}
        reply = run.ask(messages, n=run.brag.m, temperature=run.brag.temperature, **options)
        readings = [brag.parse_reading(text) for text in reply.texts]
        mode, g = brag.closed_book_mode([answer for answer, _ in readings])
        follow_up = next((query for answer, query in readings if answer == mode), readings[0][1])
        vote_type = self.vote_type(action.label, run.brag.priors[action.label], brag.VoteFacts(agreement=g))
        candidate = run.vote(vote_type, mode) if g else None
        details = {"samples": list(reply.texts), "agreement": g}
        return brag.Observation(
            mode, str(vote_type), candidate, window.passages, follow_up=follow_up, details=details
        )

    def cells(self, label: str, seen: dict[str, Any]) -> tuple[str, str, str]:
        """What it read (its passage), and the samples' mode and agreement."""
        _, answer, evidence = super().cells(label, seen)
        return "; ".join(brag.passage_labels(seen.get("passages", []))), answer, evidence


RR = brag.Action(
    "RR", "reading the reranked top passages", RerankRead(), brag.read_messages, 1, 12.0, 0.8, 0.6
)
SR = brag.Action(
    "SR", "reading the top passage m times", SampledRead(), brag.read_messages, 1, 12.0, 0.8, passages=1
)
# The shipped table and the two new rows: what a user adding them passes to the controller.
TABLE = (*brag.ACTION_TABLE, RR, SR)


def corpus() -> Corpus:
    return Corpus(
        [
            {
                "title": "Lina Berg",
                "text": "Lina Berg was born to architects; Lina Berg designed the Glass Tower.",
            },
            {"title": "Oslo", "text": "Lina Berg lived in Oslo."},
            {"title": "Home", "text": "Lina grew up in Bergen."},
        ]
    )


class Reader(ScriptedLLM):
    """The tests' scripted reader, answering a read sampled n times with n texts."""

    def complete(self, messages, *, n=1, **options):
        if n == 1 or messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS:
            return super().complete(messages, n=n, **options)
        one = super().complete(messages, **options)
        self.requests[-1]["n"] = n
        return brag.Completion(one.texts * n, one.prompt_tokens, one.completion_tokens * n)


def reader() -> Reader:
    return Reader(
        read=lambda prompt: "Answer: Bergen\nFollow-up query: Glass Tower Oslo",
        closed_book=lambda prompt, n: ["Bergen"] * n,
    )


def titles_in_prompt(messages: list[dict[str, str]], titles: list[str]) -> list[str]:
    """The passages' titles in the order the prompt's last turn shows them."""
    body = messages[-1]["content"]
    return sorted(titles, key=lambda title: body.index(f"] {title}"))


def step_of(report: dict[str, Any], label: str) -> dict[str, Any]:
    return next(s["observation"] for s in report["steps"] if s["action"] == label)


def test_a_reranked_read_reports_its_passages_in_prompt_order_each_with_its_own_score():
    llm, docs = reader(), corpus()
    controller = BRAG(llm, calibration=PRIORS, lam=0.0, k=3, extra_actions=("RR",), actions=TABLE)
    RerankRead.pools.clear()
    _, report = controller.run(QUESTION, docs, actions=["RR"])
    seen = step_of(report, "RR")
    titles = [p["title"] for p in seen["passages"]]
    hits = docs.retrieve(QUESTION, 3).hits
    assert titles != [docs[i].title for i, _ in hits]  # the rerank changed the order
    assert titles_in_prompt(llm.requests[-1]["messages"], titles) == titles  # prompt order = report order
    by_id = dict(hits)
    assert seen["scores"] == [round(by_id[p["id"]], 4) for p in seen["passages"]]  # looked up by id
    assert seen["scores"] != sorted(seen["scores"], reverse=True)
    assert seen["evidence"]["span"] == 1.0  # the answer is in the passage shown first
    assert report["answer"] == "Bergen" and seen["vote_type"] == "RR"
    # Its window was built once, from one pool, and its evidence is its own first passage's.
    assert len(RerankRead.pools) == 1 and RerankRead.pools[0].query == QUESTION
    assert seen["evidence"]["margin"] == 0.0  # the passage it shows first did not lead its pool
    _, plain = controller.run(QUESTION, docs, actions=["R1"])
    assert step_of(plain, "R1")["evidence"]["margin"] > 0  # the question's top passage did
    assert step_of(plain, "R1")["evidence"]["top_coverage"] != seen["evidence"]["top_coverage"]


def test_the_lookahead_prices_each_read_by_its_own_windows_signals():
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    # One curve for both reads: a read is likelier right the more its first passage led.
    curve = brag.EvidenceCurve((("margin", 6.0),), -1.0, (("margin", 0.3),), ((1.0, 0.0),), 0.8)
    entry = {**calibration["actions"]["R1"], "curve": brag.curve_to_dict(curve)}
    calibration["actions"].update(R1=entry, RR=entry)
    controller = BRAG(reader(), calibration=calibration, lam=0.0, k=3, actions=TABLE)
    first = controller.ask(QUESTION, corpus()).steps[0]
    assert {"R1", "RR"} <= set(first.available)
    assert first.scores["R1"] > first.scores["RR"]  # the same prior, but R1's window leads with the top


def test_a_reranked_read_refits_from_the_pooled_read_and_counts_in_eta():
    pooled = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-pooled.json")
    assert pooled.actions["R1"].evidence is not None
    assert calibrate.base_of(pooled, RR) == pooled.actions["R1"]  # its evidence levels with it
    assert calibrate.base_of(pooled, SR) == pooled.actions["CB"]  # votes by agreement, as CB's
    cb = brag.action_named("CB")
    assert calibrate._independent(RR, cb) and calibrate._independent(SR, cb)
    assert not calibrate._independent(RR, brag.action_named("R1"))  # they read the same passages
    assert not calibrate._independent(SR, brag.action_named("R2"))  # a hop is read against it
    outcomes = [
        calibrate.Outcome(
            f"q{i}",
            {"RR": "Oslo", "SR": "Oslo", "CB": "Oslo" if i % 2 else "Paris"},
            {"RR": False, "SR": False, "CB": False},
            agreement={"SR": 3, "CB": 2},
        )
        for i in range(10)
    ]
    assert calibrate.fit_counts(outcomes, m=5)["actions"] == {"CB": mock.ANY}  # the shipped rows only
    fitted = calibrate.fit_counts(outcomes, m=5, table=TABLE)
    assert fitted["counts"]["eta"]["wrong_vote_trials"] == 20  # CB against RR and against SR
    assert fitted["counts"]["eta"]["repeats"] == 10
    assert set(fitted["actions"]["SR"]["levels"]) == {"1", "2", "3", "4", "5"}


def test_a_refit_of_a_calibration_with_rows_of_its_own_keeps_them():
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    calibration["actions"]["RR"] = calibration["actions"]["R1"]
    base = brag.load_calibration(calibration, TABLE)
    outcomes = [
        calibrate.Outcome(f"q{i}", {"R1": "Oslo", "RR": "Oslo"}, {"R1": i % 3 > 0, "RR": i % 2 > 0})
        for i in range(12)
    ]
    for fitted in (calibrate.refit(base, outcomes), calibrate.self_test_fit(base, outcomes, corpus="c")):
        assert set(fitted["actions"]) >= {"R1", "RR"} and fitted["counts"]["RR"]["correct"] == 6
    assert brag.load_calibration(base) is base  # a loaded calibration keeps its own rows


def test_a_sampled_read_is_judged_by_the_gate_and_a_hop_follows_it():
    llm, docs = reader(), corpus()
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    calibration["gate"] = {"k": 3, "signals": [{"name": "max_score", "orientation": 1, "threshold": 0.0}]}
    controller = BRAG(llm, calibration=calibration, lam=0.0, k=3, extra_actions=("SR",), actions=TABLE)
    _, report = controller.run(QUESTION, docs, actions=["SR", "R2"])
    seen = step_of(report, "SR")
    assert [s["action"] for s in report["steps"] if s["action"]] == ["SR", "R2"]  # the hop followed it
    assert seen["agreement"] == 5 and seen["vote_type"] == "SR_5" and len(seen["passages"]) == 1
    assert seen["gate"] is not None and "SR" in report["gate"]  # the gate judged its window
    sampled = next(r for r in llm.requests if r["n"] == 5)
    assert sampled["temperature"] == controller.temperature
    assert step_of(report, "R2")["query"] == "Glass Tower Oslo"  # its follow-up query found the hop


def test_new_rows_load_the_shipped_calibrations_and_show_on_the_page():
    for name, calibration in brag.shipped_calibrations().items():
        offered = [a.label for a in BRAG(reader(), calibration=calibration, actions=TABLE).offered]
        assert "RR" not in offered and "SR" not in offered, name  # no entry, not offered unasked
    assert presentation.action_text("SR", TABLE) == "SR: reading the top passage m times"
    controller = BRAG(reader(), calibration=PRIORS, lam=0.0, k=3, extra_actions=("RR", "SR"), actions=TABLE)
    _, report = controller.run(QUESTION, corpus(), actions=["RR", "SR"])
    frame = presentation.steps_frame(report, TABLE)
    assert {"RR", "SR"} <= set(frame.columns)
    read = dict(zip(frame["Action"], frame["What it read"], strict=True))
    assert read["SR"] == "Lina Berg" and read["RR"] == "Home; Oslo; Lina Berg"  # each kind's own cells
    assert calibrate.prior_values(TABLE)["q"]["SR"] == 0.8 and "SR" in calibrate.default_actions(TABLE)


def test_a_calibration_of_new_rows_is_read_with_them_and_only_the_rows_given_are_offered():
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    calibration["actions"]["RR"] = calibration["actions"]["R1"]
    with pytest.raises(brag.CalibrationError, match="read with them"):
        brag.load_calibration(calibration)  # the shipped rows know no RR
    loaded = brag.load_calibration(calibration, TABLE)
    assert "RR" in [a.label for a in loaded.offered()]
    offered = BRAG(reader(), calibration=loaded, actions=TABLE).offered
    assert [a.label for a in offered] == ["R1", "R2", "CB", "RR"]
    # Fewer rows than the calibration's entries: only those given are offered, the rest ignored.
    fewer = BRAG(reader(), calibration=loaded, actions=(brag.action_named("R1"), RR))
    assert [a.label for a in fewer.offered] == ["R1", "RR"]
    assert [s.action for s in fewer.ask(QUESTION, corpus()).steps if s.action] <= ["R1", "RR"]


@pytest.mark.parametrize(
    "actions, message",
    [
        ((RR, RR), "RR named twice"),
        ((*brag.ACTION_TABLE, replace(brag.action_named("CB"), does="again")), "CB named twice"),
        ((), "a sequence of brag.Action rows"),
        (("R1",), "a sequence of brag.Action rows"),
        (RR, "a sequence of brag.Action rows"),
    ],
)
def test_rows_that_cannot_be_a_table_are_refused_at_construction(actions, message):
    with pytest.raises(brag.InputError, match=message):
        BRAG(reader(), calibration=PRIORS, actions=actions)


def test_extra_actions_name_rows_of_the_controller():
    with pytest.raises(brag.InputError, match="extra_actions: RR not in the actions"):
        BRAG(reader(), calibration=PRIORS, extra_actions=("RR",))  # not among the shipped rows


class Counting(brag.Read):
    """A read that counts how often the runner asks it for its window."""

    built: ClassVar[int] = 0

    def window(self, run: brag.WindowContext, action: brag.Action) -> brag.Window:
        Counting.built += 1
        return super().window(run, action)


class CountingHop(brag.Hop):
    """A hop that counts how often the runner asks it for its window."""

    built: ClassVar[int] = 0

    def window(self, run: brag.WindowContext, action: brag.Action) -> brag.Window:
        CountingHop.built += 1
        return super().window(run, action)


def test_each_window_is_built_once_and_a_hops_once_for_each_next_hop():
    rows = (
        brag.Action("R1", "counted read", Counting(), brag.read_messages, 1, 12.0, 0.8, 0.6),
        brag.Action("R2", "counted hop", CountingHop(), brag.read_messages, 2, 12.0, 0.7, 0.6),
        brag.action_named("CB"),
    )
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    calibration["gate"] = {"k": 3, "signals": [{"name": "max_score", "orientation": 1, "threshold": 0.0}]}
    Counting.built = CountingHop.built = 0
    controller = BRAG(reader(), calibration=calibration, lam=0.0, k=2, actions=rows)
    report = controller.ask(QUESTION, corpus(), actions=["R1", "CB", "R2"])
    assert [s.action for s in report.steps if s.action] == ["R1", "CB", "R2"]
    assert Counting.built == 1  # judged by the gate, priced at every decision, read: one window
    assert CountingHop.built == 2  # R1's follow-up query, then R2's own (it sets the next hop too)
    r1 = report.steps[0].observation
    assert r1.details["gate"] == report.gate["R1"] and r1.passages == report.steps[0].observation.passages


class Peeking(brag.Read):
    """A read that looks at what its contexts offer and tries to change the run through them."""

    offered: ClassVar[dict[str, set[str]]] = {}

    def window(self, run: brag.WindowContext, action: brag.Action) -> brag.Window:
        Peeking.offered["window"] = {name for name in dir(run) if not name.startswith("_")}
        assert isinstance(run.read_ids, tuple)  # a copy it cannot change the run through
        return super().window(run, action)

    def step(self, run: brag.StepContext, action: brag.Action, window: brag.Window) -> brag.Observation:
        Peeking.offered["step"] = {name for name in dir(run) if not name.startswith("_")}
        with pytest.raises(dataclasses.FrozenInstanceError):
            window.gate = {"weak": True}  # type: ignore[misc]  # the window is the run's: frozen
        return super().step(run, action, window)


def test_a_kind_sees_the_run_only_through_its_contexts():
    row = brag.Action("PK", "peeking", Peeking(), brag.read_messages, 1, 12.0, 0.8, 0.6, passages=1)
    table = (*brag.ACTION_TABLE, row)
    controller = BRAG(reader(), calibration=PRIORS, lam=0.0, k=3, extra_actions=("PK",), actions=table)
    _, report = controller.run(QUESTION, corpus(), actions=["PK", "R2"])
    for name, protocol in (("window", brag.WindowContext), ("step", brag.StepContext)):
        members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
        assert Peeking.offered[name] == members, name
    assert {"ask", "vote", "read"} & Peeking.offered["window"] == set()  # building a window calls nothing
    peeked, hop = (s["observation"] for s in report["steps"] if s["action"])
    # The hop holds what was read (one passage) and its new ones.
    assert hop["new_passages"] and len(hop["passages"]) - len(hop["new_passages"]) == len(peeked["passages"])
    assert peeked["vote_type"] == "PK"
