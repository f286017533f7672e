"""The seam a new way to read plugs into: one class and one row, no product file edited.

Two reads a newcomer might add, each kept here as a test of the seam (neither ships): a read
whose window is reranked before the prompt holds it, and the top passage read m times at a
temperature, its mode one vote weighed by how many samples agree. Each is a kind declaring its
traits and a row of ``brag.ACTION_TABLE``; the runner, the gate, calibration, the refit and the
page act on what it declares.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
from conftest import PRIORS, ScriptedLLM

import brag
import calibrate
from brag import BRAG, Corpus
from bragkit.serving import presentation

QUESTION = "Where was Lina Berg born?"


class RerankRead(brag.Read):
    """A read whose window is the question's top passages reranked: the lowest-ranked first."""

    name = "rerank"

    def window(self, run: brag.StepContext, action: brag.Action) -> list[int]:
        """The top passages in reverse (a stand-in for a cross-encoder's order)."""
        return super().window(run, action)[::-1]


class SampledRead(brag.Samples):
    """The top passage read ``m`` times at the controller's temperature; the mode is one vote.

    Its votes are typed by agreement, like closed-book samples, so it fits as they do; but it
    reads a passage, the gate judges that passage, and its follow-up query finds a next hop.
    """

    name = "sampled-read"
    reads_passages = True
    gated = True
    sets_next_hop = True

    def window(self, run: brag.StepContext, action: brag.Action) -> list[int]:
        """The question's top passage."""
        return [i for i, _ in run.first_hop.hits][:1]

    def step(self, run: brag.StepContext, action: brag.Action) -> brag.Observation:
        """``m`` reads of the top passage; the mode and its agreement; the mode's follow-up query."""
        window, m = self.window(run, action), run.brag.m
        messages = action.messages(run.question, run.passages(window))
        options = {"max_tokens": run.brag.max_tokens, "stop": brag.READ_STOP}
        reply = run.ask(messages, n=m, temperature=run.brag.temperature, **options)
        readings = [brag.parse_reading(text) for text in reply.texts]
        mode, g = brag.closed_book_mode([answer for answer, _ in readings])
        follow_up = next((query for answer, query in readings if answer == mode), readings[0][1])
        vote_type = self.vote_type(action.label, run.brag.priors[action.label], {"agreement": g})
        candidate = run.vote(vote_type, mode) if g else None
        details = {"samples": list(reply.texts), "agreement": g}
        seen = run.seen(window)
        return brag.Observation(mode, str(vote_type), candidate, seen, follow_up=follow_up, details=details)

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


@pytest.fixture
def table(monkeypatch):
    """The shipped table and the two new rows: what a user adding them would have."""
    monkeypatch.setattr(brag, "ACTION_TABLE", (*brag.ACTION_TABLE, RR, SR))


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


def test_a_reranked_read_reports_its_passages_in_prompt_order_each_with_its_own_score(table):
    llm, docs = reader(), corpus()
    controller = BRAG(llm, calibration=PRIORS, lam=0.0, k=3, extra_actions=("RR",))
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


def test_a_reranked_read_refits_from_the_pooled_read_and_counts_in_eta(table):
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
    fitted = calibrate.fit_counts(outcomes, m=5)
    assert fitted["counts"]["eta"]["wrong_vote_trials"] == 20  # CB against RR and against SR
    assert fitted["counts"]["eta"]["repeats"] == 10
    assert set(fitted["actions"]["SR"]["levels"]) == {"1", "2", "3", "4", "5"}


def test_a_sampled_read_is_judged_by_the_gate_and_a_hop_follows_it(table):
    llm, docs = reader(), corpus()
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    calibration["gate"] = {"k": 3, "signals": [{"name": "max_score", "orientation": 1, "threshold": 0.0}]}
    controller = BRAG(llm, calibration=calibration, lam=0.0, k=3, extra_actions=("SR",))
    _, report = controller.run(QUESTION, docs, actions=["SR", "R2"])
    seen = step_of(report, "SR")
    assert [s["action"] for s in report["steps"] if s["action"]] == ["SR", "R2"]  # the hop followed it
    assert seen["agreement"] == 5 and seen["vote_type"] == "SR_5" and len(seen["passages"]) == 1
    assert seen["gate"] is not None and "SR" in report["gate"]  # the gate judged its window
    sampled = next(r for r in llm.requests if r["n"] == 5)
    assert sampled["temperature"] == controller.temperature
    assert step_of(report, "R2")["query"] == "Glass Tower Oslo"  # its follow-up query found the hop


def test_new_rows_load_the_shipped_calibrations_and_show_on_the_page(table):
    for name, calibration in brag.shipped_calibrations().items():
        offered = [a.label for a in BRAG(reader(), calibration=calibration).offered]
        assert "RR" not in offered and "SR" not in offered, name  # no entry, not offered unasked
    assert presentation.action_text("SR") == "SR: reading the top passage m times"
    controller = BRAG(reader(), calibration=PRIORS, lam=0.0, k=3, extra_actions=("RR", "SR"))
    _, report = controller.run(QUESTION, corpus(), actions=["RR", "SR"])
    frame = presentation.steps_frame(report)
    assert {"RR", "SR"} <= set(frame.columns)
    read = dict(zip(frame["Action"], frame["What it read"], strict=True))
    assert read["SR"] == "Lina Berg" and read["RR"] == "Home; Oslo; Lina Berg"  # each kind's own cells
    assert calibrate.prior_values()["q"]["SR"] == 0.8 and "SR" in calibrate.default_actions()


class Peeking(brag.Read):
    """A read that looks at what its context offers and tries to change the run through it."""

    offered: ClassVar[set[str]] = set()

    def step(self, run: brag.StepContext, action: brag.Action) -> brag.Observation:
        Peeking.offered = {name for name in dir(run) if not name.startswith("_")}
        run.read_ids.append(2)  # copies: the run's own state does not change
        run.weak[action.label] = True
        return super().step(run, action)


def test_a_step_sees_the_run_only_through_its_context(monkeypatch):
    row = brag.Action("PK", "peeking", Peeking(), brag.read_messages, 1, 12.0, 0.8, 0.6, passages=1)
    monkeypatch.setattr(brag, "ACTION_TABLE", (*brag.ACTION_TABLE, row))
    controller = BRAG(reader(), calibration=PRIORS, lam=0.0, k=3, extra_actions=("PK",))
    _, report = controller.run(QUESTION, corpus(), actions=["PK", "R2"])
    protocol = {n for n in vars(brag.StepContext) if not n.startswith("_")}
    assert Peeking.offered == protocol | set(brag.StepContext.__annotations__)
    peeked, hop = (s["observation"] for s in report["steps"] if s["action"])
    # The hop holds what was read (one passage) and its new ones: no passage was added by the step.
    assert hop["new_passages"] and len(hop["passages"]) - len(hop["new_passages"]) == len(peeked["passages"])
    assert peeked["vote_type"] == "PK"  # typed on a strong window: the gate's verdict is the run's
