"""Policy (SPEC section 1): information rates, argmax D/c, stop rule, monotone in lambda; and
the controller's invariants as property tests over random calibrations."""

import dataclasses
import itertools
import math

import pytest
from conftest import PRIORS, ScriptedLLM, last_block
from hypothesis import example, given, settings
from hypothesis import strategies as st

import brag
from brag import (
    BRAG,
    DEFAULT_HOPS,
    ActionPrior,
    Corpus,
    Level,
    choose_action,
    information_rate,
    load_calibration,
)

RATES = {"R1": 1.2, "R2": 1.0, "CB": 0.9}


def test_information_rate_formula():
    eta, rho, q = 0.1, 0.6, 0.8
    expected = q * (rho - (1 - rho) * eta) * math.log(rho / ((1 - rho) * eta))
    assert information_rate(ActionPrior(q, 6, 4), eta) == pytest.approx(expected)


def test_closed_book_rate_is_expectation_over_levels():
    eta = 0.2
    levels = (Level(1, 0.25, 1, 3), Level(2, 0.75, 3, 1))
    d = [(k - (1 - k) * eta) * math.log(k / ((1 - k) * eta)) for k in (0.25, 0.75)]
    expected = 0.9 * (0.25 * d[0] + 0.75 * d[1])
    assert information_rate(ActionPrior(0.9, 1, 1, levels), eta) == pytest.approx(expected)


def test_rate_is_zero_for_an_uninformative_source():
    # rho = (1 - rho) * eta: a vote is as likely right as a wrong answer repeating.
    eta = 0.25
    rho = eta / (1 + eta)
    assert information_rate(ActionPrior(1.0, rho, 1 - rho), eta) == pytest.approx(0.0, abs=1e-12)


def test_picks_the_largest_expected_gain_per_cost():
    assert choose_action(RATES, ["R1", "R2", "CB"], 0.05).action == "R1"
    assert choose_action(RATES, ["R2", "CB"], 0.05).action == "R2"
    assert choose_action(dict(RATES, R2=1.2), ["R1", "R2"], 0.05).action == "R1"  # tie: first


def test_cost_enters_through_gain_per_cost():
    # Nothing read yet: a read gains q rho = 0.8 * 0.6 = 0.48, closed book q sum_g pi_g kappa_g =
    # 0.42; at half the price of a read, CB's 0.83 per unit of cost comes first.
    corpus = Corpus(["Phobos is a moon of Mars.", "Deimos is a moon of Mars.", "Io is a moon."])
    llm = ScriptedLLM(read=lambda p: "NONE", closed_book=lambda p, n: ["Phobos"] * n)
    costs = {"R1": 1.0, "R2": 1.0, "CB": 0.5}
    _, report = BRAG(llm, calibration=PRIORS, costs=costs, lam=0.0).run("Which moon?", corpus)
    assert report["steps"][0]["action"] == "CB"


def test_stops_exactly_at_the_rule():
    gains = {"R1": 0.6}
    assert choose_action(gains, ["R1"], 0.6).action is None
    assert choose_action(gains, ["R1"], 0.5999).action == "R1"
    left = choose_action(gains, [], 0.0)
    assert left.action is None and left.stop_reason == "no action left"
    nothing = choose_action({"R1": 0.0}, ["R1"], 0.0)
    assert nothing.action is None and nothing.stop_reason == "no action left has any expected gain"


def test_r2_is_unavailable_before_r1():
    # A calibration where R2 is by far the most informative: the controller still opens with R1.
    cal = load_calibration(PRIORS).to_dict()
    cal["actions"]["R2"] = {"q": 1.0, "rho": {"a": 99.0, "b": 1.0}}
    llm = ScriptedLLM(read=lambda prompt: "Answer: NONE\nFollow-up query: Mars moon")
    corpus = Corpus(["Phobos is a moon of Mars.", "Deimos is a moon of Mars.", "Mars is red.", "Io."])
    _, report = BRAG(llm, calibration=cal, lam=0.0, k=1).run("Which moon?", corpus)
    actions = [s["action"] for s in report["steps"] if s["action"]]
    assert actions[0] != "R2"
    assert report["steps"][0]["available"] == ["R1", "CB"]
    assert actions.index("R2") > actions.index("R1")


def tower_llm(prompt: str) -> str:
    block = last_block(prompt)
    if "Lina Berg" in block and "Bergen" in block:
        return "Answer: Bergen\nFollow-up query: Lina Berg birthplace"
    return "Answer: NONE\nFollow-up query: Lina Berg"


TOWER = [
    {"title": "Glass Tower", "text": "The Glass Tower was designed by the architect Lina Berg."},
    {"title": "Lina Berg", "text": "Lina Berg is an architect born in Bergen in 1950."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway."},
]


@pytest.mark.parametrize("cb_answers", [["Oslo"] * 5, ["Bergen", "Bergen", "Oslo", "NONE", "x"]])
def test_larger_lambda_never_makes_more_calls(cb_answers):
    corpus = Corpus(TOWER)
    question = "Where was the architect of the Glass Tower born?"
    for unit, floor in itertools.product(("calls", "tokens", "seconds"), (0, 1)):
        calls = []
        for lam in [0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 20.0]:
            llm = ScriptedLLM(read=tower_llm, closed_book=lambda p, n: cb_answers[:n])
            controller = BRAG(llm, calibration=PRIORS, lam=lam, k=1, min_calls=floor, cost=unit)
            calls.append(controller.run(question, corpus)[1]["totals"]["llm_calls"])
        assert calls == sorted(calls, reverse=True)
        # None at a high price, or the one call the floor makes; counted in calls, R1, a hop
        # and CB at lambda = 0.
        assert calls[-1] == floor and calls[0] >= 1
        if unit == "calls":
            assert 3 <= calls[0] <= 2 + DEFAULT_HOPS


# ------------------------------------------------------------------ invariants, as property tests

reliability = st.floats(0.001, 0.999)


@st.composite
def calibrations(draw):
    def beta():
        rho = draw(reliability)
        return {"a": 10 * rho, "b": 10 * (1 - rho)}

    pis = [draw(st.floats(0.01, 1.0)) for _ in range(5)]
    levels = {str(g): {"pi": pi / sum(pis), "kappa": beta()} for g, pi in zip(range(1, 6), pis, strict=True)}
    levels["5"]["pi"] = 1 - sum(levels[str(g)]["pi"] for g in range(1, 5))
    q = st.floats(0.0, 1.0)
    return load_calibration(
        {
            "version": 1,
            "eta": draw(st.floats(0.01, 0.95)),
            "actions": {
                "R1": {"q": draw(q), "rho": beta(), "weak": {"q": draw(q), "rho": beta()}},
                "R2": {
                    "q": draw(q),
                    "rho": beta(),
                    "weak": {"q": draw(q), "rho": beta()},
                    "same": {"pi": draw(q), "rho": beta()},
                    "new": {"rho": beta()},
                },
                "CB": {"q": draw(q), "levels": levels},
            },
        }
    )


@settings(max_examples=300, deadline=None)
@given(cal=calibrations())
def test_every_rate_is_nonnegative_and_a_weak_window_never_rates_higher(cal):
    rates = cal.rates()
    assert all(rate >= 0 for rate in rates.values()), rates
    assert rates["R1_weak"] <= rates["R1"] + 1e-12 and rates["R2_weak"] <= rates["R2"] + 1e-12
    priors = {str(t): v for t, v in cal.source_priors(5).items()}
    for t in ("R1", "R2"):  # nor does a weak window's vote weigh more
        (a_w, b_w), (a_s, b_s) = priors[f"{t}_weak"], priors[t]
        assert a_w / (a_w + b_w) <= a_s / (a_s + b_s) + 1e-12


@settings(max_examples=300, deadline=None)
@given(rho=reliability, eta=st.floats(0.01, 0.95), q=st.floats(0.0, 1.0))
def test_a_source_that_cannot_raise_its_answers_odds_has_rate_zero(rho, eta, q):
    rate = information_rate(ActionPrior(q, rho, 1 - rho), eta)
    if rho / ((1 - rho) * eta) <= 1:
        assert rate == 0.0
    else:
        assert rate >= 0.0
    assert information_rate(ActionPrior(q, rho, 1 - rho), eta, "spec") >= 0.0  # SPEC's d is >= 0 too


@settings(max_examples=300, deadline=None)
@given(
    p_err=st.floats(0.0, 1.0),
    rates=st.fixed_dictionaries({a: st.sampled_from([0.0, 0.0, 0.01, 0.5, 2.0]) for a in ("R1", "R2", "CB")}),
    lam=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    available=st.lists(st.sampled_from(["R1", "R2", "CB"]), unique=True),
)
def test_no_action_with_zero_expected_gain_is_chosen(p_err, rates, lam, available):
    gains = {a: p_err * r for a, r in rates.items()}
    decision = choose_action(gains, available, lam)
    if decision.action is not None:
        assert gains[decision.action] > lam >= 0 and gains[decision.action] > 0


@settings(max_examples=200, deadline=None)
@given(cal=calibrations(), lam=st.sampled_from([0.0, 0.01, 0.05]))
def test_a_run_never_takes_an_action_with_no_expected_gain(cal, lam):
    llm = ScriptedLLM(read=tower_llm, closed_book=lambda p, n: ["Oslo"] * n)
    _, report = BRAG(llm, calibration=cal, lam=lam, k=1, hops=2).run(
        "Where was the architect of the Glass Tower born?", Corpus(TOWER)
    )
    for i, step in enumerate(report["steps"]):
        if step["action"] and not step["floor"]:
            assert step["score"] > lam and step["score"] > 0
        assert not step["floor"] or i == 0  # the floor (min_calls=1) only ever forces the first call


words = st.text(alphabet=st.characters(categories=["Lu", "Ll", "Nd"]), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(answer=st.lists(words, min_size=1, max_size=4).map(" ".join))
def test_answers_are_normalised_the_same_way_for_every_action(answer):
    from brag import closed_book_mode, is_no_answer, parse_reading, same_answer

    read = parse_reading(f"Answer: {answer}\nFollow-up query: more")[0]
    chat_cb = closed_book_mode([f"Answer: {answer}"] * 5)[0]
    plain_cb = closed_book_mode([answer] * 5)[0]
    bare_read = parse_reading(answer)[0]
    if not read or is_no_answer(read):
        # "NONE", "unknown" and the like are no vote, whichever action produced them
        assert chat_cb == plain_cb == ""
        return
    assert same_answer(read, chat_cb)
    assert same_answer(chat_cb, plain_cb) and same_answer(read, bare_read)


# ------------------------------------------------------------------ the one-step lookahead


def beliefs_after(votes, priors, eta):
    from brag import Vote, VoteModel

    beliefs, seen = VoteModel(priors, eta, max_votes=0).beliefs(), {}
    for source, label in votes:  # candidates are numbered in order of first vote, as in a run
        beliefs.add(Vote(source, seen.setdefault(label, len(seen))))
    return beliefs, len(seen)


TYPES = {"R1": (6.0, 4.0), "R2": (3.0, 7.0), "CB_5": (8.0, 2.0)}


@settings(max_examples=300, deadline=None)
@given(
    votes=st.lists(st.tuples(st.sampled_from(sorted(TYPES)), st.integers(0, 3)), max_size=6),
    eta=st.floats(0.05, 0.9),
    q=st.floats(0.0, 1.0),
    ratios=st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(1.0, 50.0)), min_size=1, max_size=4),
)
# Three candidates at eta = 0.75: the chances of naming each sum past 1 (found on a fresh run)
@example(votes=[("CB_5", 0), ("CB_5", 0), ("CB_5", 1), ("R2", 2)], eta=0.75, q=1.0, ratios=[(1.0, 1.0)])
def test_expected_gain_lies_between_zero_and_the_error_left(votes, eta, q, ratios):
    from brag import VoteOutlook, error_probability, expected_gain

    beliefs, n = beliefs_after(votes, TYPES, eta)
    total = sum(share for share, _ in ratios)
    outlook = VoteOutlook(q, tuple((share / total, ratio) for share, ratio in ratios))
    gain = expected_gain(beliefs, n, eta, outlook)
    probs, _ = beliefs.probabilities(n)
    assert 0.0 <= gain <= error_probability(probs) + 1e-9
    if q == 0.0:
        assert gain == pytest.approx(0.0, abs=1e-12)  # a call that never answers gains nothing


def test_a_vote_that_cannot_overturn_the_leader_gains_nothing():
    from brag import VoteOutlook, expected_gain

    # Two strong votes for candidate 0; one weak vote (ratio 2) for anything else stays behind it,
    # and the expected posterior of the leader cannot move (it is a martingale).
    beliefs, n = beliefs_after([("CB_5", 0), ("R1", 0)], TYPES, 0.2)
    assert expected_gain(beliefs, n, 0.2, VoteOutlook(1.0, ((1.0, 2.0),))) == pytest.approx(0.0, abs=1e-12)
    # A vote strong enough to overturn it somewhere has a positive gain.
    assert expected_gain(beliefs, n, 0.2, VoteOutlook(1.0, ((1.0, 5000.0),))) > 0


def test_a_tie_is_broken_by_any_informative_vote_and_more_answers_gain_more():
    from brag import VoteOutlook, expected_gain

    beliefs, n = beliefs_after([("R1", 0), ("R1", 1)], TYPES, 0.2)
    gains = [expected_gain(beliefs, n, 0.2, VoteOutlook(q, ((1.0, 3.0),))) for q in (0.25, 0.5, 1.0)]
    assert 0 < gains[0] < gains[1] < gains[2]
    nothing_yet, _ = beliefs_after([], TYPES, 0.2)
    weak, strong = (expected_gain(nothing_yet, 0, 0.2, VoteOutlook(1.0, ((1.0, r),))) for r in (2.0, 20.0))
    assert 0 < weak < strong  # before any answer, a more reliable first read is worth more


@pytest.mark.parametrize("lam", [0.5, 5.0])
def test_the_min_calls_floor_makes_the_best_first_call_even_below_lambda_and_says_so(lam):
    llm = ScriptedLLM(read=tower_llm, closed_book=lambda p, n: ["Oslo"] * n)
    question = "Where was the architect of the Glass Tower born?"
    answer, report = BRAG(llm, calibration=PRIORS, lam=lam, k=1, cost="calls").run(question, Corpus(TOWER))
    first, last = report["steps"][0], report["steps"][-1]
    # The first step's pick is its best score, though that score is at or below lambda.
    assert first["floor"] and first["action"] == max(first["scores"], key=first["scores"].get)
    assert first["score"] == pytest.approx(max(first["scores"].values()), abs=1e-6) and first["score"] <= lam
    assert report["totals"]["llm_calls"] == 1 and last["action"] is None
    assert "min_calls floor" in report["stop_reason"] and f"<= lambda {lam:g}" in report["stop_reason"]
    assert answer == (first["observation"]["answer"] or "")  # what that one call said, if anything


def test_min_calls_zero_keeps_strict_pricing_and_no_floor_when_the_policy_calls_anyway():
    llm = ScriptedLLM(read=tower_llm, closed_book=lambda p, n: ["Oslo"] * n)
    question = "Where was the architect of the Glass Tower born?"
    answer, report = BRAG(llm, calibration=PRIORS, lam=5.0, k=1, min_calls=0).run(question, Corpus(TOWER))
    assert answer == "" and report["totals"]["llm_calls"] == 0 and "floor" not in report["stop_reason"]
    _, report = BRAG(llm, calibration=PRIORS, lam=0.0, k=1).run(question, Corpus(TOWER))
    assert not any(step["floor"] for step in report["steps"]) and "floor" not in report["stop_reason"]


def test_a_fixed_schedule_is_never_overridden_by_the_floor():
    llm = ScriptedLLM(read=tower_llm)
    _, report = BRAG(llm, calibration=PRIORS, lam=5.0, k=1).run("Where?", Corpus(TOWER), actions=[])
    assert report["totals"]["llm_calls"] == 0 and report["stop_reason"] == "schedule done"


def test_calls_price_every_action_alike_and_a_calibration_without_costs_falls_back_to_estimates():
    prior = brag.load_calibration(PRIORS)
    assert prior.costs is None
    assert brag.action_costs(prior, "calls") == (
        {"R1": 1.0, "R2": 1.0, "CB": 1.0},
        "every action counts as one call",
    )
    for unit, options in (("tokens", {}), ("seconds", {}), ("usd", {"prices": (0.2, 0.8)})):
        costs, source = brag.action_costs(prior, unit, k=5, m=5, **options)
        assert source.startswith("estimated from prompt sizes")
        # R2 reads twice the passages of R1; closed-book reads none.
        assert costs["R1"] == 1.0 and costs["R2"] > 1.0 > costs["CB"] > 0, (unit, costs)


def test_bad_cost_settings_are_clear_errors():
    prior = brag.load_calibration(PRIORS)
    with pytest.raises(ValueError, match="cost must be one of"):
        brag.action_costs(prior, "dollars")
    with pytest.raises(ValueError, match=r"cost='usd' needs prices"):
        brag.action_costs(prior, "usd")
    with pytest.raises(ValueError, match="cost must be one of"):
        BRAG(ScriptedLLM(read=lambda p: "NONE"), calibration=PRIORS, cost="euros")
    # A price so small a read costs 0 once multiplied out: every cost is relative to a read.
    with pytest.raises(ValueError, match="a read must cost more than 0"):
        brag.action_costs(prior, "usd", prices=(5e-324, 0.0))
    measured = brag.load_calibration(PRIORS)
    free = {a: brag.ActionCost(0.0, 0.0, 1.0, 0.0) for a in brag.action_labels()}
    with pytest.raises(ValueError, match="a read must cost more than 0"):
        brag.action_costs(dataclasses.replace(measured, costs=free), "tokens")


def test_a_run_reports_its_cost_unit_and_each_step_priced_in_it():
    corpus = Corpus(["Phobos is a moon of Mars.", "Deimos is a moon of Mars.", "Io is a moon."])
    llm = ScriptedLLM(
        read=lambda p: "Answer: Phobos\nFollow-up query: Deimos", prompt_tokens=100, completion_tokens=7
    )
    _, report = BRAG(llm, calibration=PRIORS, cost="tokens", output_ratio=3.0, lam=0.0).run(
        "Which moon?", corpus
    )
    config = report["config"]["cost"]
    assert config["unit"] == "tokens" and config["source"].startswith("estimated from prompt sizes")
    assert config["per_action"]["R1"] == 1.0 and config["per_action"]["CB"] < 1.0
    for step in report["steps"]:
        if step["action"]:
            cost = step["cost"]
            assert cost["priced"] == cost["prompt_tokens"] + 3.0 * cost["completion_tokens"]


def test_cheap_closed_book_comes_first_when_priced_in_tokens_or_seconds_but_not_in_calls():
    # Same calibration and question: counted in calls R1 leads (0.48 against 0.42); priced in
    # tokens (the default) or seconds closed-book costs a fraction of a read, so it comes first.
    corpus = Corpus(["Phobos is a moon of Mars.", "Deimos is a moon of Mars.", "Io is a moon."])
    llm = ScriptedLLM(read=lambda p: "NONE", closed_book=lambda p, n: ["Phobos"] * n)
    by_calls = BRAG(llm, calibration=PRIORS, lam=0.0, cost="calls").run("Which moon?", corpus)[1]
    assert by_calls["steps"][0]["action"] == "R1"
    for unit in ("tokens", "seconds", None):
        options = {"cost": unit} if unit else {}
        report = BRAG(llm, calibration=PRIORS, lam=0.0, **options).run("Which moon?", corpus)[1]
        assert report["steps"][0]["action"] == "CB"
        assert report["config"]["cost"]["unit"] == (unit or "tokens")


def _curve_entry(base: dict, weights: dict, intercept: float) -> dict:
    curve = brag.EvidenceCurve(
        tuple(weights.items()),
        intercept,
        tuple((f, 0.5) for f in weights),
        ((0.5, intercept - 0.5), (0.5, intercept + 0.5)),  # the score after the call holds the intercept
        0.8,
    )
    return {**base, "curve": brag.curve_to_dict(curve)}


@pytest.mark.parametrize("lead", [True, False])
def test_the_first_read_is_chosen_by_the_questions_pre_call_signals(lead):
    """The focused read pays where the top passage leads clearly, the five-passage read on a near tie."""
    calibration = brag.load_calibration(PRIORS).to_dict()
    r1 = calibration["actions"]["R1"]
    calibration["actions"]["R1"] = _curve_entry(r1, {"answer_p": 0.0}, 1.0)
    calibration["actions"]["RT"] = _curve_entry(r1, {"margin": 10.0}, -5.0)
    calibration["actions"] = {a: calibration["actions"][a] for a in ("R1", "RT")}  # the two first reads
    calibration.pop("costs", None)
    passages = [
        {
            "title": "Glass Tower",
            "text": "The Glass Tower architect was Lina Berg, who designed the Glass Tower.",
        },
        {"title": "Oslo", "text": "Oslo is the capital of Norway."},
        {"title": "Bergen", "text": "Bergen has a harbour and a fish market."},
    ]
    if not lead:  # a second passage about the tower, as strong a match as the first
        passages[1] = {
            "title": "Glass Tower (history)",
            "text": "The Glass Tower architect built the Glass Tower.",
        }
    fillers = [
        {"title": f"Town {i}", "text": f"Town {i} has a market, a school and {i} bridges."} for i in range(12)
    ]
    corpus = Corpus(passages + fillers)
    question = "Who was the Glass Tower architect?"
    (_, top), (_, second) = corpus.retrieve(question, 5).hits[:2]
    assert ((top - second) / top > 0.5) is lead  # the lead the first window's signals carry
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    report = BRAG(llm, calibration=calibration, lam=0.0001).ask(question, corpus)
    assert report.steps[0].action == ("RT" if lead else "R1")
