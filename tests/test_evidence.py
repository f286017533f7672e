"""Evidence: what an answer shows about itself, its vote levels, and how the runner uses them."""

import json
import math

import pytest
from conftest import PRIORS, ScriptedLLM

import brag
from brag import BRAG, Corpus, Passage

PASSAGES = [
    {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
    {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect, born in Bergen in 1950."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway and its largest city."},
]
QUESTION = "Who designed the Glass Tower?"
READ = "Answer: Lina Berg\nFollow-up query: Lina Berg architect"


def split_calibration(feature: str = "answer_p", threshold: float = 0.5) -> dict:
    """The hand-set priors with R1's votes split by ``feature``: right 90 % at or above, 20 % below."""
    calibration = brag.load_calibration(PRIORS).to_dict()
    calibration["actions"]["R1"]["evidence"] = {
        "name": feature,
        "weights": {feature: 1.0},
        "intercept": 0.0,
        "threshold": threshold,
        "auc": 0.8,
        "levels": {
            "hi": {"pi": 0.4, "rho": {"a": 9.0, "b": 1.0}},
            "lo": {"pi": 0.6, "rho": {"a": 2.0, "b": 8.0}},
        },
    }
    return calibration


def test_the_answer_tokens_are_found_where_the_reply_writes_the_answer():
    tokens = [("Answer", -0.2), (":", 0.0), (" Lina", -0.7), (" Berg", -0.1), ("\n", -0.3), ("Follow", -0.01)]
    assert brag.answer_logprobs("Lina Berg", tokens) == [-0.7, -0.1]
    assert brag.answer_logprobs("lina  berg", tokens) == [-0.7, -0.1]  # case and spacing do not matter
    assert brag.answer_logprobs("Bergen", tokens) == []  # not written as such: no probability made up
    # A token that spans the answer's edge counts: " Berg" holds the end of "Berg".
    assert brag.answer_logprobs("Berg", [("Lina", -1.0), (" Berg", -0.5)]) == [-0.5]


def test_read_evidence_gives_each_feature_or_none():
    passages = [Passage("Oslo", "Oslo is a city."), Passage("Lina Berg", "Lina Berg was born in Bergen.")]
    tokens = [("Answer", -0.2), (":", 0.0), (" Lina", -math.log(2)), (" Berg", 0.0)]
    evidence = brag.read_evidence("Lina Berg", "Who designed it?", passages, tokens)
    assert evidence["answer_p"] == pytest.approx(math.sqrt(0.5), abs=1e-4)  # the geometric mean of 0.5 and 1
    assert evidence["answer_p_min"] == pytest.approx(0.5, abs=1e-4)
    assert evidence["span"] == 0.5 and evidence["in_question"] == 0.0  # in the second passage read
    bare = brag.read_evidence("Lina Berg", "Was it Lina Berg or Ola Nordmann?", passages)
    assert bare["answer_p"] is None and bare["answer_p_min"] is None  # no log-probabilities: missing
    assert bare["in_question"] == 1.0
    assert brag.read_evidence("Ola Nordmann", "Who?", passages)["span"] == 0.0
    yes = brag.read_evidence("Yes", "Is Oslo a city?", passages, [(" Yes", -0.1)])
    assert (
        yes["span"] is None
        and yes["in_question"] is None
        and yes["answer_p"] == pytest.approx(math.exp(-0.1), abs=1e-4)
    )
    assert set(brag.read_evidence("", "Who?", passages).values()) == {None}
    assert list(evidence) == list(brag.evidence_names())  # one list, in its order


def test_the_evidence_reads_in_words():
    assert brag.evidence_text({"answer_p": 0.834, "span": 1.0, "in_question": 0.0}) == (
        "answer p 0.83 · span of passage 1"
    )
    assert brag.evidence_text({"answer_p": None, "span": 0.0, "in_question": 1.0}) == (
        "not in any passage read · named in the question"
    )
    assert brag.evidence_text({"span": 1 / 3}) == "span of passage 3"


def test_a_calibration_without_evidence_loads_flat_and_one_with_it_round_trips():
    old = brag.load_calibration(PRIORS)
    assert old.actions["R1"].evidence is None and brag.VoteType("R1", level="hi") not in old.source_priors(5)
    fitted = brag.load_calibration(split_calibration())
    split = fitted.actions["R1"].evidence
    assert split is not None and split.name == "answer_p" and split.hi.mean == pytest.approx(0.9)
    assert fitted.source_priors(5)[brag.VoteType("R1", level="hi")] == (9.0, 1.0)
    assert fitted.source_priors(5)[brag.VoteType("R1", level="lo")] == (2.0, 8.0)
    again = brag.load_calibration(json.loads(json.dumps(fitted.to_dict())))
    assert again.actions["R1"].evidence == split
    # The weak-window view keeps the levels (only q and the flat reliability change there).
    assert fitted.actions["R1"].on_weak_window().evidence == split


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e.update(weights={"shoe_size": 1.0}), "weights must map some of"),
        (lambda e: e.update(weights={}), "weights must map some of"),
        (lambda e: e.update(weights={"span": "a lot"}), r"weights.span must be a number"),
        (lambda e: e["levels"].pop("lo"), "must give 'hi' and 'lo'"),
        (lambda e: e["levels"]["hi"].update(pi=0.9), "pi values must sum to 1"),
        (lambda e: e["levels"]["lo"].update(rho={"a": -1, "b": 1}), r"levels.lo.rho.a"),
        (lambda e: e.update(threshold="high"), "threshold must be a number"),
    ],
)
def test_a_malformed_evidence_split_is_refused_by_name(change, message):
    calibration = split_calibration()
    change(calibration["actions"]["R1"]["evidence"])
    with pytest.raises(ValueError, match=message):
        brag.load_calibration(calibration)


def test_a_split_puts_a_vote_in_its_level_and_leaves_a_vote_without_the_feature_out():
    split = brag.load_calibration(split_calibration()).actions["R1"].evidence
    assert split.level({"answer_p": 0.7}).name == "hi" and split.level({"answer_p": 0.5}).name == "hi"
    assert split.level({"answer_p": 0.2}).name == "lo"
    assert split.level({"answer_p": None}) is None and split.level({}) is None
    flipped = brag.EvidenceSplit("span", (("span", -1.0),), 0.0, -0.5, split.hi, split.lo, 0.7)
    assert flipped.level({"span": 0.2}).name == "hi" and flipped.level({"span": 1.0}).name == "lo"
    both = brag.EvidenceSplit(
        "combined", (("span", 2.0), ("answer_p", 1.0)), -1.0, 0.5, split.hi, split.lo, 0.7
    )
    assert both.score({"span": 0.5, "answer_p": 0.75}) == pytest.approx(0.75)  # -1 + 2 * 0.5 + 0.75
    assert both.level({"span": 0.5, "answer_p": 0.75}).name == "hi"
    assert both.level({"span": 0.0, "answer_p": 0.9}).name == "lo"
    assert both.level({"span": 1.0, "answer_p": None}) is None  # one feature missing: no level


@pytest.mark.parametrize(("logprob", "level"), [(-0.05, "R1:hi"), (-3.0, "R1:lo"), (None, "R1")])
def test_a_read_votes_at_the_level_its_evidence_puts_it_in(logprob, level):
    llm = ScriptedLLM(read=lambda prompt: READ, logprob=None if logprob is None else (lambda text: logprob))
    answer, report = BRAG(llm, calibration=split_calibration(), k=3).run(
        QUESTION, Corpus(PASSAGES), actions=["R1"]
    )
    seen = report["steps"][0]["observation"]
    assert answer == "Lina Berg" and seen["vote_type"] == level
    assert seen["evidence"]["span"] == 1.0  # the top passage holds it
    # One vote gives P(correct) = its type's reliability.
    assert report["confidence"]["p_correct"] == pytest.approx({"R1:hi": 0.9, "R1:lo": 0.2, "R1": 0.6}[level])


def test_the_lookahead_averages_over_the_levels_a_read_may_land_in():
    cal = brag.load_calibration(split_calibration())
    flat = brag.load_calibration(PRIORS)
    costs = {"R1": 1.0, "R2": 1.0, "CB": 1.0}
    outlook = brag._policy_tables(cal, 5, costs, "floored", "conditional")[False, False, False][2]["R1"]
    ratio = {name: 0.9 / 0.1 / 0.1 if name == "hi" else 0.2 / 0.8 / 0.1 for name in ("hi", "lo")}
    assert [x for outcome in outlook.outcomes for x in outcome] == pytest.approx(
        [0.4, ratio["hi"], 0.6, ratio["lo"]]
    )
    flat_outlook = brag._policy_tables(flat, 5, costs, "floored", "conditional")[False, False, False][2]["R1"]
    assert len(flat_outlook.outcomes) == 1
    # The information rate is the levels' average too: q sum_l pi_l d(rho_l).
    expected = 0.8 * (0.4 * brag.vote_information(0.9, 0.1) + 0.6 * brag.vote_information(0.2, 0.1))
    assert cal.rates()["R1"] == pytest.approx(expected)


def test_levels_make_a_sure_read_stop_and_a_doubtful_one_look_again():
    """The controller's point: one read it can trust ends the run; one it cannot buys more."""
    corpus = Corpus(PASSAGES)

    def run(logprob: float) -> list[str]:
        llm = ScriptedLLM(
            read=lambda prompt: READ,
            closed_book=lambda prompt, n: ["Lina Berg"] * n,
            logprob=lambda text: logprob,
        )
        report = BRAG(
            llm, calibration=split_calibration(), k=3, lam=0.02, costs={"R1": 1.0, "R2": 1.0, "CB": 3.0}
        ).run(QUESTION, corpus)[1]
        return [s["action"] for s in report["steps"] if s["action"]]

    assert run(-0.01) == ["R1"]
    assert len(run(-3.0)) > 1


def test_a_replay_from_the_cache_gives_every_vote_the_evidence_and_level_the_live_run_gave(tmp_path):
    from bragkit import llms

    path = tmp_path / "cache.sqlite"
    question = "Who designed the Glass Tower, and was it Lina Berg?"
    live_llm = ScriptedLLM(read=lambda prompt: READ, logprob=lambda text: -0.02)
    live = BRAG(llms.CachedLLM(live_llm, path, model="scripted"), calibration=split_calibration(), k=3)
    _, report = live.run(question, Corpus(PASSAGES), actions=["R1", "R2"])
    never = ScriptedLLM(read=lambda prompt: "Answer: wrong")  # the replay must not call it
    replay = BRAG(
        llms.CachedLLM(never, path, model="scripted", mode="replay"), calibration=split_calibration(), k=3
    )
    _, again = replay.run(question, Corpus(PASSAGES), actions=["R1", "R2"])
    reads = [s["observation"] for s in report["steps"] if s["action"]]
    assert reads[0]["vote_type"] == "R1:hi" and reads[0]["evidence"]["in_question"] == 1.0
    assert [s.get("observation") for s in again["steps"]] == [s.get("observation") for s in report["steps"]]
    assert again["confidence"] == report["confidence"] and never.requests == []


# ------------------------------------------------------------------------------------------
# Evidence curves: each vote its own reliability
# ------------------------------------------------------------------------------------------


def _curve(weights: dict, intercept: float = 0.0, spread=((0.5, -1.0), (0.5, 1.0))) -> brag.EvidenceCurve:
    means = tuple((f, 0.5) for f in weights)
    return brag.EvidenceCurve(tuple(weights.items()), intercept, means, tuple(spread), 0.8)


def curve_calibration(curve: brag.EvidenceCurve, same: dict | None = None) -> dict:
    """The hand-set priors with R1's votes weighed by ``curve`` (and a ``same`` branch if given)."""
    calibration = brag.load_calibration(PRIORS).to_dict()
    calibration["actions"]["R1"]["curve"] = brag.curve_to_dict(curve)
    if same is not None:
        calibration["actions"]["R1"]["same"] = same
    return calibration


def test_a_curve_gives_each_vote_the_reliability_of_its_score():
    curve = _curve({"answer_p": 4.0}, intercept=-2.0)
    low, high = curve.reliability({"answer_p": 0.2}), curve.reliability({"answer_p": 0.9})
    assert low == pytest.approx(1 / (1 + math.exp(-(-2.0 + 0.8))))
    assert high == pytest.approx(1 / (1 + math.exp(-(-2.0 + 3.6))))
    # A feature the backend did not give counts at its mean, not as zero.
    assert curve.reliability({"answer_p": None}) == pytest.approx(curve.reliability({"answer_p": 0.5}))
    assert brag.RELIABILITY_BOUNDS[1] == _curve({"answer_p": 100.0}).reliability({"answer_p": 1.0})


@pytest.mark.parametrize("answer_p", [0.15, 0.95])
def test_a_reads_vote_under_a_curve_gives_p_its_own_reliability(answer_p):
    curve = _curve({"answer_p": 5.0}, intercept=-2.5)
    llm = ScriptedLLM(lambda prompt: READ, logprob=lambda text: math.log(answer_p))
    controller = BRAG(llm, calibration=curve_calibration(curve), lam=0.0, min_calls=1)
    report = controller.ask(QUESTION, Corpus(PASSAGES), actions=["R1"])
    seen = report.steps[0].observation
    own = curve.reliability(seen.evidence)
    assert seen.reliability == pytest.approx(own, abs=1e-6)
    assert report.confidence["p_correct"] == pytest.approx(own, abs=1e-5)  # one vote: P = its rho


def test_a_calibration_with_a_curve_round_trips_and_a_malformed_one_is_named():
    curve = _curve({"answer_p": 2.0, "margin": 1.0}, intercept=-0.5)
    loaded = brag.load_calibration(curve_calibration(curve))
    assert loaded.actions["R1"].curve == curve
    assert brag.load_calibration(loaded.to_dict()).to_dict() == loaded.to_dict()
    broken = curve_calibration(curve)
    broken["actions"]["R1"]["curve"]["weights"] = {"shoe_size": 1.0}
    with pytest.raises(brag.CalibrationError, match=r"curve\.weights"):
        brag.load_calibration(broken)
    broken["actions"]["R1"]["curve"] = {**brag.curve_to_dict(curve), "spread": [[0.3, 1.0]]}
    with pytest.raises(brag.CalibrationError, match="spread"):
        brag.load_calibration(broken)


def test_pre_call_signals_move_a_reads_outlook_and_the_rest_of_the_score_spreads_it():
    curve = _curve({"margin": 3.0, "answer_p": 2.0}, intercept=-1.0, spread=((0.5, -2.0), (0.5, 1.0)))
    eta = 0.1
    tie, lead = curve.outcomes({"margin": 0.0}, eta), curve.outcomes({"margin": 1.0}, eta)
    assert [share for share, _ in tie] == [0.5, 0.5]
    assert all(b > a for (_, a), (_, b) in zip(tie, lead, strict=True))  # a clear lead: likelier right
    assert tie[0][1] < tie[1][1]  # the spread after the call: two kinds of vote, not one


def test_a_windows_signals_measure_its_first_passages_lead_and_coverage():
    corpus, question = Corpus(PASSAGES), "Glass Tower architect"
    found = corpus.retrieve(question, 3)
    llm = ScriptedLLM(lambda prompt: READ)
    controller = BRAG(llm, calibration=PRIORS, lam=0.0, k=3, extra_actions=("RT",))
    evidence = controller.ask(question, corpus, actions=["RT"]).steps[0].observation.evidence
    top, second = found.hits[0][1], found.hits[1][1]
    assert evidence["margin"] == pytest.approx((top - second) / top, abs=1e-4)
    assert evidence["top_coverage"] == 1.0  # the top passage holds glass, tower and architect
    assert brag.evidence_names(before_call=True) == ("margin", "top_coverage")
    empty = brag.Window((), brag.Retrieval([], [], 0))
    assert brag.window_evidence(brag.ReadFacts(question, empty, [])) == {"margin": 0.0, "top_coverage": 0.0}


def test_the_answers_share_of_the_question_is_evidence():
    passage = [Passage("Lina Berg", "Lina Berg designed it.")]
    copied = brag.read_evidence("Glass Tower", QUESTION, passage)
    fresh = brag.read_evidence("Lina Berg", QUESTION, passage)
    assert copied["question_share"] == 1.0 and fresh["question_share"] == 0.0
    assert brag.read_evidence("yes", QUESTION, passage)["question_share"] is None


def test_a_calibration_without_a_curve_runs_as_before():
    """The shipped benchmark fits keep two evidence levels: no vote has its own reliability."""
    pooled = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-pooled.json")
    assert pooled.meta["evidence"] == "levels" and all(p.curve is None for p in pooled.actions.values())
    llm = ScriptedLLM(lambda prompt: READ, logprob=lambda text: math.log(0.97))
    report = BRAG(llm, calibration=pooled, lam=0.0).ask(QUESTION, Corpus(PASSAGES), actions=["R1"])
    seen = report.steps[0].observation
    level = pooled.actions["R1"].evidence.level(seen.evidence)
    assert seen.reliability is None and seen.vote_type == f"R1:{level.name}"
    assert report.confidence["p_correct"] == pytest.approx(level.mean, abs=1e-5)


def test_each_evidence_feature_has_a_name_of_its_own():
    names = brag.evidence_names()
    assert len(set(names)) == len(names) == len(brag.EVIDENCE)
    before, after = brag.evidence_names(before_call=True), brag.evidence_names(before_call=False)
    assert set(before) | set(after) == set(names) and not set(before) & set(after)
