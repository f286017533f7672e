"""End to end: BRAG.run with a scripted LLM over a small corpus."""

import json
import math
import re
from collections import Counter
from dataclasses import replace

import pytest
from conftest import PRIORS, ScriptedLLM, last_block, without

import brag
from brag import BRAG, Corpus, Passage, RunAborted, expand_query, is_degenerate_query

PASSAGES = [
    {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
    {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect, born in Bergen in 1950."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway and its largest city."},
    {"title": "Bergen", "text": "Bergen is a city on the west coast of Norway."},
    {"title": "Fjord", "text": "A fjord is a long, narrow inlet with steep sides."},
]
QUESTION = "In which city was the designer of the Glass Tower born?"


def two_hop_reader(prompt: str) -> str:
    """Knows the answer only when it has read the Lina Berg passage; writes no useful query."""
    block = last_block(prompt)
    if "born in Bergen" in block:
        return "Answer: Bergen\nFollow-up query: "
    return "Answer: NONE\nFollow-up query: " + QUESTION


def test_two_hop_question_is_answered_through_the_fallback_query():
    # Closed-book samples that disagree are a weak vote (g = 1), so the read answer wins;
    # lambda = 0 so that the controller takes every action that can still gain anything.
    llm = ScriptedLLM(
        read=two_hop_reader, closed_book=lambda p, n: ["Oslo", "Rome", "Lima", "NONE", "Bern"][:n]
    )
    answer, report = BRAG(llm, calibration=PRIORS, k=1, lam=0.0, cost="calls").run(QUESTION, Corpus(PASSAGES))
    assert answer == "Bergen"
    steps = [s for s in report["steps"] if s["action"]]
    assert [s["action"] for s in steps][:2] == ["R1", "R2"]
    r1, r2 = steps[0]["observation"], steps[1]["observation"]
    assert r1["answer"] == "" and r1["candidate"] is None
    assert r1["follow_up_fallback"] is True and "Lina Berg" in r1["follow_up_query"]
    assert r2["new_passages"] == [1] and r2["answer"] == "Bergen"
    assert [p["id"] for p in r2["passages"]] == [0, 1]
    cb = steps[2]["observation"]
    assert cb["agreement"] == 1 and report["p_err"] < 0.5


def test_unanimous_closed_book_outweighs_a_single_read():
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    answer, report = BRAG(llm, calibration=PRIORS, k=1, lam=0.0, hops=1, cost="calls").run(
        QUESTION, Corpus(PASSAGES)
    )
    # kappa_5 = 0.7 against rho_R2 = 0.6 in the priors.
    assert [s["action"] for s in report["steps"] if s["action"]] == ["R1", "R2", "CB"]
    assert answer == "Oslo"


def test_lookahead_skips_a_call_that_cannot_pay_for_itself():
    # After the read says Bergen, one closed-book call changes P_err by about 0.01 in
    # expectation: worth it at lambda = 0 (above), not at lambda = 0.05.
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    answer, report = BRAG(llm, calibration=PRIORS, k=1, lam=0.05, cost="calls").run(
        QUESTION, Corpus(PASSAGES)
    )
    assert [s["action"] for s in report["steps"] if s["action"]] == ["R1", "R2"]
    assert answer == "Bergen" and 0 < report["steps"][-1]["score"] <= 0.05


def test_totals_equal_what_the_llm_reported_and_report_is_json():
    llm = ScriptedLLM(
        read=two_hop_reader,
        closed_book=lambda p, n: ["Bergen", "Oslo", "Bergen", "x", "NONE"][:n],
        prompt_tokens=123,
        completion_tokens=9,
    )
    _, report = BRAG(llm, calibration=PRIORS, k=1, lam=0.0, cost="calls").run(QUESTION, Corpus(PASSAGES))
    totals = report["totals"]
    assert totals["llm_calls"] == len(llm.requests) == 3
    assert totals["prompt_tokens"] == 123 * 3
    assert totals["completion_tokens"] == 9 * (1 + 1 + 5)
    assert totals["cached_calls"] == 0 and totals["tokens_estimated"] is False
    assert report["stop_reason"].startswith("no action left")
    cb = next(s for s in report["steps"] if s["action"] == "CB")["observation"]
    assert cb["answer"] == "Bergen" and cb["agreement"] == 2
    assert llm.requests[-1]["n"] == 5 and llm.requests[-1]["temperature"] > 0
    final = report["steps"][-1]
    assert final["action"] is None
    assert final["posterior"]["candidates"][0]["answer"] == "Bergen"
    assert final["posterior"]["candidates"][0]["votes"] == 2
    probs = [c["p"] for c in final["posterior"]["candidates"]]
    assert sum(probs) + final["posterior"]["residual"] == pytest.approx(1.0, abs=1e-5)
    for step in report["steps"]:
        assert set(step["rates"]) == {"R1", "R2", "CB"} and step["policy_us"] >= 0
    assert json.loads(json.dumps(report)) == report


def test_r2_without_new_passages_is_never_offered():
    # Re-reading one window would count one piece of evidence twice, and it has no expected gain.
    llm = ScriptedLLM(read=lambda p: "Answer: Oslo\nFollow-up query: Norway capital city")
    small = Corpus(PASSAGES[:3])
    _, report = BRAG(llm, calibration=PRIORS, k=5, lam=0.0, cost="calls").run(
        "What is the capital of Norway?", small
    )
    assert all("R2" not in step["available"] for step in report["steps"])
    assert [s["action"] for s in report["steps"]] == ["R1", "CB", None]
    assert report["totals"]["llm_calls"] == len(llm.requests) == 2  # R1 and CB only
    assert report["steps"][-1]["posterior"]["candidates"][0]["votes"] == 1


def test_hops_follow_the_latest_query_and_extend_the_window():
    # A three-hop chain: each read names the next entity; only the last passage holds the answer.
    chain = [
        {"title": "Glass Tower", "text": "The Glass Tower was designed by Lina Berg."},
        {"title": "Lina Berg", "text": "Lina Berg studied under Ole Dahl."},
        {"title": "Ole Dahl", "text": "Ole Dahl was born in Tromsø."},
        *[{"title": f"Filler {i}", "text": f"Filler passage {i} about fjords."} for i in range(6)],
    ]

    def reader(prompt: str) -> str:
        block = last_block(prompt)
        if "born in Tromsø" in block:
            return "Answer: Tromsø\nFollow-up query: Tromsø"
        if "Ole Dahl" in block:
            return "Answer: NONE\nFollow-up query: Ole Dahl"
        return "Answer: NONE\nFollow-up query: Lina Berg"

    llm = ScriptedLLM(read=reader)
    question = "Where was the teacher of the Glass Tower's architect born?"
    answer, report = BRAG(llm, calibration=PRIORS, k=1, hops=3, lam=0.0).run(
        question, Corpus(chain), actions=["R1", "R2", "R2", "R2"]
    )
    reads = [s["observation"] for s in report["steps"] if s["action"]]
    assert [r["answer"] for r in reads[:3]] == ["", "", "Tromsø"] and answer == "Tromsø"
    assert [[p["title"] for p in r["passages"]] for r in reads[:3]] == [
        ["Glass Tower"],
        ["Glass Tower", "Lina Berg"],  # old passages first, so the prompt extends the last one
        ["Glass Tower", "Lina Berg", "Ole Dahl"],
    ]
    assert [r.get("query") for r in reads[1:3]] == ["Lina Berg", "Ole Dahl"]
    assert reads[2]["vote_type"] == "R2_new" and reads[3]["vote_type"] == "R2_same"
    with_one_hop = BRAG(ScriptedLLM(read=reader), calibration=PRIORS, k=1, hops=1, lam=0.0)
    _, short = with_one_hop.run(question, Corpus(chain), actions=["R1", "R2", "R2", "R2"])
    assert [s["action"] for s in short["steps"]] == ["R1", "R2", None]  # hops bounds the R2 runs


def test_deterministic_for_equal_inputs():
    def run():
        llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
        answer, report = BRAG(llm, calibration=PRIORS, k=1).run(QUESTION, Corpus(PASSAGES))
        # Timings differ between runs; everything else must not.
        return answer, without(report, {"policy_us", "llm_seconds", "wall_time_s", "llm_wait_s"})

    assert run() == run()


def test_on_step_sees_every_decision_before_it_runs():
    seen = []
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)

    def on_step(step):
        seen.append((step["step"], step["action"], len(llm.requests)))

    _, report = BRAG(llm, calibration=PRIORS, k=1, lam=0.0).run(QUESTION, Corpus(PASSAGES), on_step=on_step)
    assert [a for _, a, _ in seen] == [s["action"] for s in report["steps"]]
    assert [calls for _, _, calls in seen] == list(range(len(seen)))  # called before the LLM call


def test_no_candidate_gives_empty_answer_and_says_so():
    llm = ScriptedLLM(read=lambda p: "NONE")
    answer, report = BRAG(llm, calibration=PRIORS, lam=0.0, k=2).run("What is unknowable?", Corpus(PASSAGES))
    assert answer == "" and report["answered"] is False and "no candidate" in report["note"]
    assert report["totals"]["llm_calls"] == 2 + brag.DEFAULT_HOPS  # every action tried: R1, each hop, CB


class FailingLLM(ScriptedLLM):
    def complete(self, messages, **kwargs):
        if len(self.requests) == 1:
            self.requests.append({})
            raise ConnectionError("endpoint unreachable")
        return super().complete(messages, **kwargs)


def test_failure_mid_run_keeps_the_partial_report():
    llm = FailingLLM(read=lambda p: "Answer: Oslo\nFollow-up query: Oslo city")
    with pytest.raises(RunAborted, match="endpoint unreachable") as err:
        BRAG(llm, calibration=PRIORS, lam=0.0, cost="calls").run(QUESTION, Corpus(PASSAGES))
    report = err.value.report
    assert report["totals"]["llm_calls"] == 1
    assert report["answer"] == "Oslo"
    assert report["stop_reason"].startswith("error")
    assert isinstance(err.value.__cause__, ConnectionError)


@pytest.mark.parametrize("question", ["", "   ", None])
def test_empty_question_is_a_value_error(question):
    with pytest.raises(ValueError, match="question is empty"):
        BRAG(ScriptedLLM(read=str), calibration=PRIORS).run(question, Corpus(PASSAGES))


def test_non_corpus_and_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match=r"brag\.Corpus"):
        BRAG(ScriptedLLM(read=str), calibration=PRIORS).run("q?", PASSAGES)
    with pytest.raises(ValueError, match="lam"):
        BRAG(ScriptedLLM(read=str), calibration=PRIORS, lam=-1)
    with pytest.raises(ValueError, match="k must be"):
        BRAG(ScriptedLLM(read=str), calibration=PRIORS, k=0)
    with pytest.raises(ValueError, match="calibration"):
        BRAG(ScriptedLLM(read=str), calibration='{"version": 1}')


def test_degenerate_queries_and_expansion():
    assert is_degenerate_query("", QUESTION)
    assert is_degenerate_query(QUESTION.upper(), QUESTION)
    assert is_degenerate_query("Glass Tower designer", QUESTION)
    assert not is_degenerate_query("Lina Berg birthplace", QUESTION)
    read = [Passage("Glass Tower", "The Glass Tower in Oslo was designed by Lina Berg.")]
    expanded = expand_query(QUESTION, read)
    assert expanded.startswith(QUESTION) and "Lina Berg" in expanded and "Oslo" in expanded
    assert expanded.count("Glass Tower") == 1


def test_a_fixed_schedule_runs_exactly_those_actions():
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    _, report = BRAG(llm, calibration=PRIORS, k=1, lam=10.0).run(
        QUESTION, Corpus(PASSAGES), actions=["R1", "R2"]
    )
    assert [s["action"] for s in report["steps"]] == ["R1", "R2", None]
    assert report["stop_reason"] == "schedule done" and len(llm.requests) == 2
    _, report = BRAG(llm, calibration=PRIORS, k=1).run(
        QUESTION, Corpus(PASSAGES), actions=["R2", "CB"]
    )  # R2 needs R1
    assert [s["action"] for s in report["steps"]] == ["CB", None]
    with pytest.raises(ValueError, match="actions must be drawn"):
        BRAG(llm, calibration=PRIORS).run(QUESTION, Corpus(PASSAGES), actions=["R3"])


def test_a_perfect_reader_answers_at_least_80_percent_with_the_prior_it_gets(shared_data):
    """The acceptance check through the Python API.

    An uncalibrated endpoint gets the hand-set prior on a named benchmark corpus (on the
    caller's own documents, the fit across readers); with a reader that is right whenever the
    supporting passages are in its prompt, BRAG reads until it is.
    """
    from perfect_reader import PerfectReader, calls_it_needs

    import calibrate
    from bragkit.llms import make_llm

    items = calibrate.read_labelled(shared_data / "hotpotqa" / "hotpotqa_ircot500.json")[300:360]
    corpus = Corpus((shared_data / "hotpotqa" / "hotpotqa_ircot500_corpus.json").read_text())
    prior = brag.shipped_calibration("http://127.0.0.1/v1#perfect", "HotpotQA")
    with PerfectReader(items) as server:
        controller = BRAG(make_llm(server.url + "#perfect"), calibration=prior)
        assert controller.calibration.meta["source"] == "prior"
        answers = [controller.run(item.question, corpus) for item in items]
        requests = len(server.chat_requests)
    right = sum(brag.exact_match(answer, item.gold) for (answer, _), item in zip(answers, items, strict=True))
    status = answers[0][1]["config"]["calibration"]["status"]
    assert "uncalibrated" in status and "run /calibrate" in status
    assert right >= 0.8 * len(items), right
    # ... and with the calls it needs: none after the supporting passages were all read, one
    # closed-book call at most, each hop searching what the reader said was missing.
    wasted = {
        item.id: calls_it_needs(report, set(item.supporting))
        for (_, report), item in zip(answers, items, strict=True)
    }
    assert not any(wasted.values()), {k: v for k, v in wasted.items() if v}
    assert requests == sum(report["totals"]["llm_calls"] for _, report in answers)
    # Priced in tokens, the prior makes closed-book (a short prompt) the first call; priced in
    # calls, a read is worth more per call, and closed-book comes only once reads have failed.
    with PerfectReader(items) as server:
        per_call = BRAG(make_llm(server.url + "#perfect"), calibration=prior, cost="calls")
        by_calls = [per_call.run(item.question, corpus)[1] for item in items]
    for report, item in zip(by_calls, items, strict=True):
        actions = [s["action"] for s in report["steps"] if s["action"]]
        assert actions[0] == "R1" and not calls_it_needs(report, set(item.supporting)), (item.id, actions)


def weak_reads() -> dict:
    """The hand-set priors with reads right one time in five."""
    calibration = brag.load_calibration(PRIORS).to_dict()
    for action in ("R1", "R2"):
        calibration["actions"][action]["rho"] = {"a": 2.0, "b": 8.0}
    return calibration


def test_an_answer_no_passage_holds_is_a_guess_with_its_runner_up_and_the_report_says_so():
    # "Who wrote Hamlet?" over a corpus that never mentions Hamlet: the read names someone
    # anyway, and closed-book names someone else.
    llm = ScriptedLLM(
        read=lambda prompt: "Answer: Charles Babbage\nFollow-up query: Hamlet author",
        closed_book=lambda prompt, n: ["William Shakespeare", "William Shakespeare", "NONE", "Oslo", "x"][:n],
    )
    controller = BRAG(llm, calibration=weak_reads(), k=2)
    answer, report = controller.run("Who wrote Hamlet?", Corpus(PASSAGES), actions=["R1", "CB"])
    confidence, candidates = report["confidence"], report["steps"][-1]["posterior"]["candidates"]
    best, second = sorted(candidates, key=lambda c: -c["p"])[:2]
    assert answer == best["answer"] and confidence["p_correct"] == pytest.approx(best["p"], abs=1e-6)
    assert confidence["guess"] is True and confidence["supported"] is False  # neither name is in PASSAGES
    assert confidence["runner_up"] == {"answer": second["answer"], "p": second["p"]}
    # The best answer is closed-book's alone: no read of the documents gave it (found_by_rule).
    assert best["answer"] == "William Shakespeare" and report["found_in_documents"] is False
    assert confidence["found"]["signals"]["closed_book_only"] == 1.0
    assert confidence["summary"] == (
        f"{brag.NOT_FOUND}: what follows is a guess, not an answer from them; "
        f"a guess: {best['p']:.0%}; runner-up: {second['answer']} ({second['p']:.0%}); "
        "no passage read contains this answer: the corpus does not seem to hold it"
    )


def test_a_weak_single_read_is_called_a_guess_and_a_read_answer_in_its_passage_is_supported():
    llm = ScriptedLLM(read=two_hop_reader)
    controller = BRAG(llm, calibration=weak_reads(), k=5)
    answer, report = controller.run(QUESTION, Corpus(PASSAGES), actions=["R1"])
    confidence = report["confidence"]
    assert answer == "Bergen" and confidence["supported"] is True  # "born in Bergen" was read
    assert confidence["guess"] is True and confidence["p_correct"] < brag.GUESS_BELOW
    assert confidence["summary"] == f"a guess: {confidence['p_correct']:.0%}"  # one candidate: no runner-up
    assert confidence["runner_up"] is None


def test_a_confident_answer_is_not_called_a_guess():
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda prompt, n: ["Bergen"] * n)
    answer, report = BRAG(llm, calibration=PRIORS, k=5, lam=0.0, cost="calls").run(QUESTION, Corpus(PASSAGES))
    confidence = report["confidence"]
    assert answer == "Bergen" and confidence["supported"] is True
    assert confidence["p_correct"] >= brag.GUESS_BELOW and confidence["guess"] is False
    assert confidence["summary"] == f"P(correct) ≈ {confidence['p_correct']:.0%}"


def shown(*passages):
    return [brag._ShownPassage.of(p) for p in passages]


def test_the_answer_is_quoted_from_the_first_passage_read_that_holds_it():
    words = " ".join(f"w{i}" for i in range(30))
    passages = [
        brag.Passage("a.pdf, p. 1", "Nothing to see."),
        brag.Passage("a.pdf, p. 3", f"{words} Lina Berg was born in BERGEN, Norway. {words}"),
        brag.Passage("b.md", "Bergen again."),
    ]
    source = brag._source_of("Bergen", shown(*passages))
    assert source == {
        "passage": "a.pdf, p. 3",
        "quote": "… w23 w24 w25 w26 w27 w28 w29 Lina Berg was born in BERGEN, Norway. "
        "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 …",
    }
    assert brag._source_of("Berg", shown(brag.Passage("x", "Bergen only."))) is None  # whole words only
    assert brag._source_of("New York", shown(brag.Passage("x", "in New\nYork.")))["quote"] == "in New York."


def test_a_quote_is_cut_in_characters_when_its_words_are_huge():
    text = "x" * 5_000 + " Lina Berg was born in Bergen. " + "y" * 50_000
    source = brag._source_of("Bergen", shown(brag.Passage("a", text)))
    assert "was born in Bergen." in source["quote"] and len(source["quote"]) <= 2 * brag.QUOTE_CHARS + 40
    assert source["quote"].startswith("… ") and source["quote"].endswith(" …")


def test_no_prompt_holds_more_of_a_passage_or_title_than_a_read_should():
    # A caller's passages: a 1 MB title and a 1 MB text. The title is cut when the corpus is made,
    # the text in the prompt (retrieval still reads it whole), so every read stays small.
    corpus = Corpus(
        [
            {"title": "T" * 1_000_000, "text": "The Glass Tower was designed by Lina Berg."},
            {"title": "Lina Berg", "text": "Lina Berg was born in Bergen. " + "z " * 500_000 + "tail-word"},
            "Oslo is the capital of Norway.",
        ]
    )
    assert len(corpus[0].title) == brag.MAX_TITLE_CHARS and corpus[0].title.endswith("…")
    assert corpus.retrieve("tail-word", 1).hits[0][0] == 1
    prompts: list[str] = []

    def reader(prompt: str) -> str:
        prompts.append(prompt)
        return "Answer: Bergen\nFollow-up query: Lina Berg"

    answer, report = BRAG(ScriptedLLM(read=reader), calibration=PRIORS, k=2).run(
        "Where was the architect of the Glass Tower born?", corpus
    )
    assert answer == "Bergen" and prompts
    room = 2 * (brag.MAX_PROMPT_PASSAGE_CHARS + 10) + 3_000  # two passages, the examples, the question
    assert max(len(p) for p in prompts) < room
    assert len(json.dumps(report)) < 100_000


class FailingRetriever(Corpus):
    """A retriever whose search service is down: its first retrieval raises."""

    def retrieve(self, query, k=5):
        raise ConnectionError("search service unreachable")


def test_a_retriever_failing_before_the_first_call_is_a_run_aborted_with_its_report():
    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    with pytest.raises(RunAborted, match="retrieval failed: search service unreachable") as err:
        BRAG(llm, calibration=PRIORS).run(QUESTION, FailingRetriever(PASSAGES))
    assert err.value.report["totals"]["llm_calls"] == 0 and err.value.report["steps"] == []
    assert err.value.report["stop_reason"] == "error: search service unreachable"
    assert llm.requests == []


def test_counts_are_checked_with_messages_that_say_what_is_allowed():
    llm = ScriptedLLM(read=two_hop_reader)
    assert BRAG(llm, calibration=PRIORS, hops=0).hops == 0  # no second hop: allowed, and said so
    with pytest.raises(ValueError, match=r"hops must be a whole number >= 0, got -1"):
        BRAG(llm, calibration=PRIORS, hops=-1)
    with pytest.raises(ValueError, match=r"k must be a positive integer, got 0"):
        BRAG(llm, calibration=PRIORS, k=0)
    with pytest.raises(ValueError, match=r"m must be a positive integer, got True"):
        BRAG(llm, calibration=PRIORS, m=True)


def test_a_controller_is_frozen_so_its_costs_always_match_its_settings():
    import dataclasses

    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    controller = BRAG(llm, calibration=PRIORS, k=5, m=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        controller.k = 2
    smaller = dataclasses.replace(controller, k=2, m=3)
    assert smaller.priced_costs == BRAG(llm, calibration=PRIORS, k=2, m=3).priced_costs
    assert smaller.priced_costs != controller.priced_costs
    _, report = smaller.run(QUESTION, Corpus(PASSAGES))
    assert report["config"]["k"] == 2 and report["config"]["m"] == 3
    assert report["config"]["cost"]["per_action"] == {a: round(c, 6) for a, c in smaller.priced_costs.items()}


def test_a_backend_without_a_name_goes_by_its_class_name_everywhere(tmp_path):
    import calibrate
    from bragkit import llms

    llm = ScriptedLLM(read=two_hop_reader, closed_book=lambda p, n: ["Oslo"] * n)
    assert brag.llm_name(llm) == "ScriptedLLM" and not hasattr(llm, "name")
    # A fit made for this backend names it so; the controller then knows the fit is its own.
    fitted = {
        **json.loads(PRIORS.read_text()),
        "fitted": True,
        "model": brag.llm_name(llm),
        "corpus": "Towers",
    }
    _, report = BRAG(llm, calibration=fitted).run(QUESTION, Corpus(PASSAGES))
    assert report["config"]["calibration"]["status"] == "fitted for this model on Towers"
    assert llms.CachedLLM(llm, tmp_path / "cache.sqlite").model == "ScriptedLLM"
    assert calibrate.progress_key(llm, Corpus(PASSAGES), 5, 5, 2, 0, 0.8) != calibrate.progress_key(
        llms.CachedLLM(llm, tmp_path / "other.sqlite", model="another"), Corpus(PASSAGES), 5, 5, 2, 0, 0.8
    )


def test_every_action_in_the_table_has_a_kind_a_prompt_and_a_price():
    assert brag.action_labels() == tuple(a.label for a in brag.ACTION_TABLE)
    for action in brag.ACTION_TABLE:
        assert action.kind in brag.VOTE_KINDS, action.label
        messages = action.messages("Where was she born?", [brag.Passage("Lina Berg", "Born in Oslo.")])
        assert messages[-1]["role"] == "user" and "Where was she born?" in messages[-1]["content"]
    # The prior measured no costs: each is estimated from its prompt, relative to one R1 read.
    costs, source = brag.action_costs(brag.load_calibration(), "tokens", k=5, m=5, actions=brag.ACTION_TABLE)
    assert source.startswith("estimated") and costs["R1"] == 1.0
    assert costs["R2"] > costs["R1"] > costs["CB"]  # twice the passages; no passages at all
    assert costs["RT"] < 0.5 * costs["R1"]  # one passage of five
    wider, _ = brag.action_costs(brag.load_calibration(), "tokens", k=5, m=20)
    assert wider["CB"] > costs["CB"] and wider["R2"] == costs["R2"]  # samples scale CB alone


# ------------------------------------------------- issue 42: an action is one row

# One new action of each kind: a row and its prompt, nothing else.
NEW_ACTIONS = {
    "read": brag.Action(
        "R0", "reading the top two", brag.READ, brag.read_messages, 1, 12.0, 0.8, 0.6, passages=2
    ),
    "hop": brag.Action("H2", "a hop of its own", brag.HOP, brag.read_messages, 2, 12.0, 0.5, 0.4),
    "samples": brag.Action(
        "CB2", "more samples", brag.SAMPLES, lambda q, _: brag.closed_book_messages(q), 0, 4.0, 0.9
    ),
}
TIMING = {"wall_time_s", "policy_us", "llm_wait_s", "llm_seconds"}


def three_passages() -> Corpus:
    return Corpus(
        [
            {"title": "Lina Berg", "text": "Lina Berg designed the Glass Tower."},
            {"title": "Tower", "text": "The Glass Tower stands in Oslo; Lina Berg was born in Bergen."},
            {"title": "Oslo", "text": "Oslo is the capital of Norway."},
        ]
    )


def reader_and_samples() -> ScriptedLLM:
    return ScriptedLLM(
        read=lambda prompt: "Answer: Bergen\nFollow-up query: Glass Tower Oslo",
        closed_book=lambda prompt, n: ["Bergen"] * n,
    )


@pytest.mark.parametrize("kind", list(NEW_ACTIONS))
def test_an_action_of_each_kind_is_one_row_and_an_old_calibration_runs_as_before(kind):
    question, action = "Where was Lina Berg born?", NEW_ACTIONS[kind]
    before = [
        without(
            BRAG(reader_and_samples(), calibration=PRIORS, lam=lam, k=2).run(question, three_passages())[1],
            TIMING,
        )
        for lam in (0.0, 0.05)
    ]
    table = (*brag.ACTION_TABLE, action)
    # A calibration without the action: offered as before, and every report the same.
    for lam, expected in zip((0.0, 0.05), before, strict=True):
        plain = BRAG(reader_and_samples(), calibration=PRIORS, lam=lam, k=2, actions=table)
        assert action not in plain.offered
        assert without(plain.run(question, three_passages())[1], TIMING) == expected
    # Turned on: weighed by its kind's prior, priced from its own prompt, and the report says so.
    llm = reader_and_samples()
    on = BRAG(llm, calibration=PRIORS, lam=0.0, k=2, extra_actions=(action.label,), actions=table)
    assert on.offered[-1] == action and on.priors[action.label] == action.kind.prior(action, on.m)
    assert on.priced_costs[action.label] > 0
    schedule = ["R1", action.label] if kind == "hop" else [action.label]
    answer, report = on.run(question, three_passages(), actions=schedule)
    ran = [s for s in report["steps"] if s["action"] == action.label]
    assert answer == "Bergen" and len(ran) == 1
    assert ran[0]["observation"]["vote_type"].startswith(action.label)
    assert report["config"]["actions"] == {
        "offered": [*brag.action_labels()[:3], action.label],
        "on_kind_prior": [action.label],
    }
    assert report["config"]["extra_actions"] == [action.label]
    unsure = ScriptedLLM(read=lambda prompt: "Answer: Bergen\nFollow-up query: Glass Tower Oslo")
    _, chosen = replace(on, llm=unsure).run(question, three_passages())  # no sample answers
    assert any(action.label in s["scores"] for s in chosen["steps"])  # the policy weighs it


def test_a_second_samples_action_votes_with_its_own_levels_not_the_first_ones():
    action = NEW_ACTIONS["samples"]
    table = (*brag.ACTION_TABLE, action)
    calibration = json.loads(PRIORS.read_text(encoding="utf-8"))
    levels = {str(g): {"pi": 0.2, "kappa": {"a": 2.0, "b": 8.0}} for g in range(1, 6)}
    calibration["actions"]["CB2"] = {"q": 0.9, "levels": levels}
    with pytest.raises(brag.CalibrationError, match=r"actions\.'CB2' is not an action of this BRAG"):
        BRAG(reader_and_samples(), calibration=calibration)  # a row of its own is read with its rows
    controller = BRAG(reader_and_samples(), calibration=calibration, lam=0.0, k=2, actions=table)
    priors = controller.calibration.source_priors(5)
    assert priors[brag.VoteType("CB2", "5")] == (2.0, 8.0)
    assert priors[brag.VoteType("CB", "5")] == (7.0, 3.0)  # the hand-set prior's own
    _, report = controller.run("Where was Lina Berg born?", three_passages(), actions=["CB2"])
    cb2 = next(s["observation"] for s in report["steps"] if s["action"] == "CB2")
    assert cb2["agreement"] == 5
    # One vote of reliability 0.2 against a residual of eta: the posterior is below what CB's 0.7 gives.
    _, by_cb = controller.run("Where was Lina Berg born?", three_passages(), actions=["CB"])
    assert report["p_err"] > by_cb["p_err"]


def test_the_focused_read_reports_supports_and_quotes_only_the_passage_it_read():
    corpus = Corpus(
        [
            {"title": "Lina Berg", "text": "Lina Berg was born in a large city; Lina Berg was born in 1950."},
            {"title": "Tower", "text": "The Glass Tower is by Lina, who grew up in Bergen."},
            {"title": "Oslo", "text": "Oslo is the capital of Norway."},
        ]
    )
    question = "Where was Lina Berg born?"
    controller = BRAG(reader_and_samples(), calibration=PRIORS, lam=0.0, k=2, extra_actions=("RT",))
    _, wide = controller.run(question, corpus, actions=["R1"])
    r1 = next(s["observation"] for s in wide["steps"] if s["action"] == "R1")
    top, second = (p["id"] for p in r1["passages"])
    assert "Bergen" in corpus[second].text and "Bergen" not in corpus[top].text
    assert wide["confidence"]["supported"] is True and wide["confidence"]["source"] is not None
    _, focused = controller.run(question, corpus, actions=["RT"])
    rt = next(s["observation"] for s in focused["steps"] if s["action"] == "RT")
    assert [p["id"] for p in rt["passages"]] == [top]  # what its prompt held, and nothing else
    assert rt["evidence"]["span"] == 0.0 and rt["vote_type"] == "RT"
    assert focused["confidence"]["supported"] is False and focused["confidence"]["source"] is None
    assert "grew up in Bergen" not in controller.llm.requests[-1]["messages"][-1]["content"]
    assert focused["config"]["actions"]["on_kind_prior"] == ["RT"]


def test_shipped_calibrations_offer_the_actions_they_fitted_and_no_other():
    for name, calibration in brag.shipped_calibrations().items():
        offered = [a.label for a in BRAG(reader_and_samples(), calibration=calibration).offered]
        assert offered == [a for a in brag.action_labels() if a in calibration.actions], name


# ------------------------------------------------- issue 41: work bounded by what the model reads


def test_support_span_and_quote_come_only_from_what_the_prompt_showed():
    filler = "filler " * 2_000  # 14,000 characters: the prompt shows the first 10,000
    late = brag.Passage("Lina Berg", f"Lina Berg, architect. {filler} She was born in Bergen.")
    early = brag.Passage("Lina Berg", f"Lina Berg, architect, was born in Bergen. {filler}")
    reader = ScriptedLLM(read=lambda prompt: "Answer: Bergen\nFollow-up query: Lina Berg")
    for passage, shown in ((late, False), (early, True)):
        controller = BRAG(reader, calibration=PRIORS, hops=0, max_uses=1)
        answer, report = controller.run("Where was Lina Berg born?", Corpus([passage]))
        read = next(s["observation"] for s in report["steps"] if s["action"] == "R1")
        assert answer == "Bergen" and report["confidence"]["supported"] is shown
        assert (report["confidence"]["source"] is not None) is shown
        assert read["evidence"]["span"] == (1.0 if shown else 0.0)


def test_a_run_normalises_each_passage_it_read_once_however_many_reports(monkeypatch):
    calls: list[str] = []
    normalize = brag.normalize_answer

    def counted(text: str) -> str:
        if len(text) > 500:
            calls.append(text[:40])
        return normalize(text)

    monkeypatch.setattr(brag, "normalize_answer", counted)
    passages = [f"Passage {i} about Bergen and Lina Berg. " + "word " * 200 for i in range(8)]
    reader = ScriptedLLM(read=lambda prompt: "Answer: Bergen\nFollow-up query: Bergen Norway")
    reports = list(BRAG(reader, lam=0.0, min_calls=3).stream("Where was Lina Berg born?", Corpus(passages)))
    read = {
        p["id"]
        for _, r in reports[-1:]
        for s in r["steps"]
        for p in (s.get("observation") or {}).get("passages", [])
    }
    assert len(reports) >= 3 and read
    assert len(calls) == len(read)  # once per passage read, not once per report


def test_a_corpus_analyses_each_passage_once(monkeypatch):
    seen: Counter[str] = Counter()
    words = brag.words

    def counted(text: str, by_script: bool = True) -> list[str]:
        seen[text] += 1
        return words(text, by_script)

    monkeypatch.setattr(brag, "words", counted)
    passages = [f"passage number {i} of the corpus, about Bergen" for i in range(50)]
    Corpus(passages)
    assert set(seen) == set(passages) and set(seen.values()) == {1}


def test_a_focused_read_after_r1_leaves_the_next_hop_where_r1_put_it():
    def reader(prompt: str) -> str:
        one_passage = "[2] " not in last_block(prompt)
        return "Answer: Bergen\nFollow-up query: " + ("Oslo capital" if one_passage else "Glass Tower Oslo")

    controller = BRAG(ScriptedLLM(read=reader), calibration=PRIORS, lam=0.0, k=2, extra_actions=("RT",))
    _, report = controller.run("Where was Lina Berg born?", three_passages(), actions=["R1", "RT", "R2"])
    seen = {s["action"]: s["observation"] for s in report["steps"] if s["action"]}
    assert seen["RT"]["follow_up_query"] == "Oslo capital"  # its own, as it read one passage
    assert seen["R2"]["query"] == seen["R1"]["follow_up_query"] == "Glass Tower Oslo"


def test_a_hop_scores_its_new_passages_by_the_follow_up_query_and_keeps_the_old_ones_scores():
    docs, question = (
        Corpus(
            [
                {"title": "Lina Berg", "text": "Lina Berg was born in Bergen, Lina Berg said."},
                {"title": "Tower", "text": "Lina Berg designed the Glass Tower in Oslo."},
                {"title": "School", "text": "Lina went to school."},
            ]
        ),
        "Where was Lina Berg born?",
    )
    controller = BRAG(reader_and_samples(), calibration=PRIORS, lam=0.0, k=3, extra_actions=("RT",))
    _, report = controller.run(question, docs, actions=["RT", "R2"])  # RT reads the top one of three
    rt, r2 = (s["observation"] for s in report["steps"] if s["action"])
    old = {p["id"]: score for p, score in zip(rt["passages"], rt["scores"], strict=True)}
    follow_up = dict(docs.retrieve(r2["query"], 3 + len(old)).hits)
    for passage, score in zip(r2["passages"], r2["scores"], strict=True):
        wanted = old[passage["id"]] if passage["id"] in old else round(follow_up[passage["id"]], 4)
        assert score == wanted, passage
    assert r2["new_passages"] and all(i in follow_up for i in r2["new_passages"])
    first = dict(docs.retrieve(question, 3).hits)  # the question found them too, with other scores
    assert any(first.get(i) != follow_up[i] for i in r2["new_passages"] if i in first)


# ------------------------------------------------------------------------------------------
# Found in the documents
# ------------------------------------------------------------------------------------------


def test_a_fitted_found_model_flags_a_question_about_what_the_documents_never_name():
    # The read answers with words that do stand in its passage: only the question's terms that
    # no passage holds tell that the documents cannot answer it.
    llm = ScriptedLLM(read=lambda prompt: "Answer: Lina Berg\nFollow-up query: x")
    calibration = {
        **brag.load_calibration(PRIORS).to_dict(),
        "found": {"intercept": 3.0, "weights": {"absent_terms": -10.0}, "threshold": 0.5},
    }
    controller = BRAG(llm, calibration=calibration, k=2)
    corpus = Corpus(PASSAGES)
    asked = controller.ask("Who designed the Glass Tower in Oslo?", corpus, actions=["R1"])
    outside = controller.ask("Which Kubernetes operator did Lina Berg write?", corpus, actions=["R1"])
    assert asked.answer == outside.answer == "Lina Berg"
    assert asked.confidence["supported"] and outside.confidence["supported"]
    assert asked.found_in_documents and not outside.found_in_documents
    signals = outside.confidence["found"]["signals"]
    assert signals["absent_terms"] > 0 and signals["in_passage"] == 1.0 and signals["read_none"] == 0.0
    assert outside.confidence["found"]["p"] < 0.5 < asked.confidence["found"]["p"]
    assert outside.confidence["guess"] and outside.confidence["source"] is None
    assert outside.to_dict()["found_in_documents"] is False
    assert outside.confidence["summary"].startswith(brag.NOT_FOUND)


def test_without_a_found_model_an_answer_no_read_gave_is_not_found():
    reads_none = ScriptedLLM(
        read=lambda prompt: "Answer: NONE\nFollow-up query: x",
        closed_book=lambda prompt, n: ["Ada Lovelace"] * n,
    )
    report = BRAG(reads_none, calibration=PRIORS, k=2).ask(
        "Who designed the Analytical Engine?", Corpus(PASSAGES), actions=["R1", "CB"]
    )
    assert report.answer == "Ada Lovelace" and not report.found_in_documents
    assert report.confidence["found"]["signals"]["read_none"] == 1.0
    assert report.confidence["found"]["p"] is None  # the rule, not a model
    nothing = BRAG(reads_none, calibration=PRIORS, k=2).ask(
        "Who designed the Analytical Engine?", Corpus(PASSAGES), actions=["R1"]
    )
    assert nothing.answer == "" and nothing.found_in_documents is False  # every read said NONE
    # No read of the documents ran: nothing was checked, so nothing is said either way.
    closed_book = BRAG(reads_none, calibration=PRIORS, k=2).ask(
        "Who designed the Analytical Engine?", Corpus(PASSAGES), actions=["CB"]
    )
    assert closed_book.answer == "Ada Lovelace" and closed_book.found_in_documents is None
    assert closed_book.to_dict()["found_in_documents"] is None
    assert not closed_book.confidence["summary"].startswith(brag.NOT_FOUND)
    assert closed_book.confidence["found"]["signals"]["read_none"] == 0.0


def test_old_calibrations_load_without_a_found_model_and_a_found_model_changes_no_decision():
    for name, cal in brag.shipped_calibrations().items():
        if cal.meta.get("corpus") != brag.DOCUMENTS:
            assert cal.found is None and "found" not in cal.to_dict(), name
    llm = ScriptedLLM(
        read=two_hop_reader, closed_book=lambda p, n: ["Oslo", "Rome", "Lima", "NONE", "Bern"][:n]
    )
    plain = brag.load_calibration(PRIORS).to_dict()
    flagging = {**plain, "found": {"intercept": -50.0, "weights": {}, "threshold": 0.5}}  # never found
    before = BRAG(llm, calibration=plain, k=1, lam=0.0).ask(QUESTION, Corpus(PASSAGES))
    after = BRAG(llm, calibration=flagging, k=1, lam=0.0).ask(QUESTION, Corpus(PASSAGES))
    assert [s.action for s in before.steps] == [s.action for s in after.steps]
    assert before.answer == after.answer == "Bergen" and before.p_err == after.p_err
    assert before.found_in_documents is True and after.found_in_documents is False


# ------------------------------------------------------------------------------------------
# Reads that share a passage, and the sampled focused read
# ------------------------------------------------------------------------------------------

SHARED_PASSAGES = [
    {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway and its largest city."},
]
SHARED_QUESTION = "Who designed the Glass Tower?"


def _with_repeat(rho_same: float | None) -> dict:
    calibration = brag.load_calibration(PRIORS).to_dict()
    calibration["actions"]["RT"] = dict(calibration["actions"]["R1"])
    if rho_same is not None:
        calibration["actions"]["R1"]["same"] = {
            "pi": 0.6,
            "rho": {"a": 10 * rho_same, "b": 10 * (1 - rho_same)},
        }
    return calibration


def test_a_read_repeating_a_read_of_the_same_passage_counts_as_the_fitted_dependent_witness():
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    corpus = Corpus(SHARED_PASSAGES)
    p = {}
    for name, rho_same in (("independent", None), ("dependent", 0.3)):
        controller = BRAG(llm, calibration=_with_repeat(rho_same), lam=0.0)
        report = controller.ask(SHARED_QUESTION, corpus, actions=["RT", "R1"])
        second = report.steps[1].observation
        assert second.vote_type == ("R1_same" if rho_same else "R1")
        p[name] = report.confidence["p_correct"]
    assert p["dependent"] < p["independent"]  # the repeat is not a second independent witness
    eta = brag.load_calibration(_with_repeat(0.3)).eta
    rho_rt = brag.load_calibration(_with_repeat(0.3)).actions["RT"].mean
    odds = rho_rt / ((1 - rho_rt) * eta) * max(1.0, 0.3 / (0.7 * eta))
    assert p["dependent"] == pytest.approx(odds / (odds + 1 / eta), abs=1e-5)


def test_the_lookahead_prices_a_repeat_at_its_fitted_ratio():
    prior = brag.load_calibration(_with_repeat(0.3)).actions["R1"]
    rates = {"R1": 1.0, "R1_weak": 1.0}
    _, outlook = brag.READ.view("R1", prior, 0.1, rates, brag.PolicyState(weak=False, answered=True))
    assert outlook.same_ratio == pytest.approx(0.3 / (0.7 * 0.1))
    beliefs = brag.VoteModel({"RT": (7.0, 3.0), "CB": (7.0, 3.0)}, 0.1).beliefs()
    beliefs.add(brag.Vote("RT", 0))
    beliefs.add(brag.Vote("CB", 1))  # a tie the next read settles: by repeating RT, or not
    dependent = brag.expected_gain(beliefs, 2, 0.1, outlook, repeatable={0})
    independent = brag.expected_gain(beliefs, 2, 0.1, replace(outlook, same_ratio=None), repeatable={0})
    assert dependent < independent  # a second read of the same passage is worth less


class SampledReadLLM:
    """Replies to a sampled read with the given samples; to any other read with the first one."""

    def __init__(self, samples: list[str]) -> None:
        self.samples, self.requests = samples, []

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        self.requests.append({"n": n, "temperature": temperature, "stop": stop})
        texts = self.samples[:n] if n > 1 else self.samples[:1]
        return brag.Completion(texts, 50, 3 * n)


@pytest.mark.parametrize("agreeing", [5, 3, 1])
def test_a_sampled_read_votes_its_mode_typed_by_how_many_samples_agree(agreeing):
    samples = ["Answer: Lina Berg"] * agreeing + [f"Answer: Other {i}" for i in range(5 - agreeing)]
    llm = SampledReadLLM(samples)
    controller = BRAG(llm, calibration=PRIORS, extra_actions=("RS",), lam=0.0, m=5)
    report = controller.ask(SHARED_QUESTION, Corpus(SHARED_PASSAGES), actions=["RS"])
    seen = report.steps[0].observation
    assert llm.requests == [{"n": 5, "temperature": controller.temperature, "stop": ["\n", *brag.READ_STOP]}]
    assert seen.answer == "Lina Berg" and seen.details["agreement"] == agreeing
    assert seen.evidence["agreement"] == pytest.approx(agreeing / 5)
    assert seen.vote_type == f"RS_{agreeing}" and [p.title for p in seen.passages] == ["Glass Tower"]
    assert report.confidence["p_correct"] == pytest.approx(brag.prior_kappa(agreeing, 5), abs=1e-4)


def test_a_sampled_reads_curve_weighs_its_agreement():
    calibration = brag.load_calibration(PRIORS).to_dict()
    curve = brag.EvidenceCurve((("agreement", 4.0),), -2.0, (("agreement", 0.6),), ((1.0, 0.0),), 0.8)
    calibration["actions"]["RS"] = {**calibration["actions"]["R1"], "curve": brag.curve_to_dict(curve)}
    p = {}
    for agreeing in (5, 2):
        samples = ["Answer: Lina Berg"] * agreeing + [f"Answer: Other {i}" for i in range(5 - agreeing)]
        controller = BRAG(SampledReadLLM(samples), calibration=calibration, lam=0.0, m=5)
        report = controller.ask(SHARED_QUESTION, Corpus(SHARED_PASSAGES), actions=["RS"])
        assert report.steps[0].observation.vote_type == "RS"
        p[agreeing] = report.confidence["p_correct"]
    assert p[5] == pytest.approx(1 / (1 + math.exp(-2.0)), abs=1e-5)
    assert p[2] == pytest.approx(1 / (1 + math.exp(-(-2.0 + 1.6))), abs=1e-5)


# ------------------------------------------------------------------------------------------
# The second look: a read of the next-ranked passage, and witnesses of another passage
# ------------------------------------------------------------------------------------------

SECOND_LOOK = [
    {
        "title": "Glass Tower",
        "text": "The Glass Tower in Oslo is a tower of glass; its architect is named below.",
    },
    {"title": "Architect", "text": "Lina Berg designed the Glass Tower in Oslo."},
    {"title": "Fjord", "text": "A fjord is a long, narrow inlet with steep sides."},
]


ARCHITECT_QUESTION = "Who is the architect of the Glass Tower?"  # ranks the passage without the name first


def _passages_in(prompt: str) -> int:
    return len(re.findall(r"^\[\d+\] ", last_block(prompt), flags=re.M))


def test_the_next_ranked_read_holds_the_second_passage_alone():
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    corpus = Corpus(SECOND_LOOK)
    controller = BRAG(llm, calibration=PRIORS, lam=0.0, k=3, extra_actions=("RT", "RN"))
    report = controller.ask(ARCHITECT_QUESTION, corpus, actions=["RT", "RN"])
    rt, rn = (s.observation for s in report.steps if s.action)
    ranked = [i for i, _ in corpus.retrieve(ARCHITECT_QUESTION, 3).hits]
    assert [p.id for p in rt.passages] == ranked[:1] and [p.id for p in rn.passages] == ranked[1:2]
    assert _passages_in(llm.requests[-1]["messages"][-1]["content"]) == 1
    assert brag.action_named("RN").first == 1 and brag.action_named("RT").first == 0


def test_the_next_ranked_read_is_not_offered_when_the_question_found_one_passage():
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    corpus = Corpus(SECOND_LOOK[1:2])
    controller = BRAG(llm, calibration=PRIORS, lam=0.0, k=3, extra_actions=("RT", "RN"))
    report = controller.ask(ARCHITECT_QUESTION, corpus)
    assert "RN" not in report.steps[0].available and "RT" in report.steps[0].available
    assert "RN" not in [s.action for s in report.steps]


def test_an_action_row_refuses_a_negative_first_rank():
    with pytest.raises(brag.InputError, match="first"):
        replace(brag.action_named("RN"), first=-1)


def _repeat_calibration() -> dict:
    """The priors, with a focused read, a next-ranked read, and a fitted repeat for every read."""
    calibration = _with_repeat(0.3)
    for label in ("RT", "RN"):
        calibration["actions"][label] = dict(calibration["actions"]["R1"])
    return calibration


def test_a_read_whose_answer_rests_on_a_passage_the_first_never_held_is_an_independent_witness():
    # The focused read names the architect from a passage that does not hold the name; R1 finds
    # it in the second passage, which the focused read never held: not a repeat of one passage.
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    corpus = Corpus(SECOND_LOOK)
    controller = BRAG(llm, calibration=_repeat_calibration(), lam=0.0, k=3)
    after_rt = controller.ask(ARCHITECT_QUESTION, corpus, actions=["RT", "R1"])
    rt, r1 = (s.observation for s in after_rt.steps if s.action)
    assert rt.evidence["span"] == 0.0 and r1.evidence["span"] == 0.5
    assert r1.vote_type == "R1"  # its answer rests on passage 2, which RT never held
    rn = controller.ask(ARCHITECT_QUESTION, corpus, actions=["RT", "RN"]).steps[1].observation
    assert rn.vote_type == "RN"  # no passage in common with the focused read
    # R1 first, then the focused read repeating it: both hold the first passage.
    before_rt = controller.ask(ARCHITECT_QUESTION, corpus, actions=["R1", "RT"])
    assert before_rt.steps[1].observation.vote_type == "RT_same"
    assert after_rt.confidence["p_correct"] > before_rt.confidence["p_correct"]
    assert after_rt.found_in_documents is True


def test_a_candidate_is_shown_in_the_words_a_passage_holds_once_a_read_found_them():
    def reader(prompt: str) -> str:
        if _passages_in(prompt) == 1:  # the focused read: a form no passage holds
            return "Answer: Lina Berg, the architect\nFollow-up query: Lina Berg"
        return "Answer: Lina Berg\nFollow-up query: Lina Berg"

    corpus = Corpus(SECOND_LOOK[1:] + SECOND_LOOK[:1])
    controller = BRAG(ScriptedLLM(reader), calibration=_repeat_calibration(), lam=0.0, k=3)
    report = controller.ask(ARCHITECT_QUESTION, corpus, actions=["RT", "R1"])
    rt, r1 = (s.observation for s in report.steps if s.action)
    assert rt.candidate == r1.candidate == 0 and rt.answer != r1.answer
    assert report.answer == "Lina Berg"  # the form the passage holds, not the first read's
    first_only = controller.ask(ARCHITECT_QUESTION, corpus, actions=["RT"])
    assert first_only.answer == "Lina Berg, the architect"
