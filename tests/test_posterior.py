"""Posterior (SPEC section 1 and the floored rule): sanity checks, a scipy reference for SPEC's
formula, and the invariants as property tests over random calibrations and vote sequences."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import betaln

from brag import Vote, VoteModel, error_probability, posterior, uninformative_reliability

PRIORS = {"R1": (6.0, 4.0), "R2": (3.0, 2.0), "CB_1": (1.0, 9.0), "CB_5": (8.0, 2.0)}
ETA = 0.1
RULES = pytest.mark.parametrize("rule", ["floored", "spec"])


def reference(votes, n_candidates, priors, eta):
    """Straight transcription of SPEC section 1 with scipy's betaln, no shortcuts."""
    log_w = []
    for i in range(n_candidates):
        total = 0.0
        n_i = 0
        for t, (a, b) in priors.items():
            big_n = sum(1 for v in votes if v.source == t)
            n_ti = sum(1 for v in votes if v.source == t and v.candidate == i)
            total += betaln(a + n_ti, b + big_n - n_ti) - betaln(a, b + big_n)
            n_i += n_ti
        log_w.append(total - n_i * math.log(eta))
    log_w0 = -math.log(eta)
    z = math.exp(log_w0) + sum(math.exp(x) for x in log_w)
    return [math.exp(x) / z for x in log_w], math.exp(log_w0) / z


@RULES
@pytest.mark.parametrize("source", list(PRIORS))
def test_single_vote_gives_mean_reliability(source, rule):
    a, b = PRIORS[source]
    probs, residual = posterior([Vote(source, 0)], 1, PRIORS, ETA, rule)
    # SPEC's sanity check; floored, a source below rho_0 counts as exactly uninformative.
    expected = a / (a + b) if rule == "spec" else max(a / (a + b), uninformative_reliability(ETA))
    assert probs[0] == pytest.approx(expected, rel=1e-12)
    assert residual == pytest.approx(1 - expected, rel=1e-12)


@RULES
def test_two_agreeing_votes_beat_one(rule):
    one, _ = posterior([Vote("R1", 0)], 1, PRIORS, ETA, rule)
    two, _ = posterior([Vote("R1", 0), Vote("R2", 0)], 1, PRIORS, ETA, rule)
    same_type, _ = posterior([Vote("R1", 0), Vote("R1", 0)], 1, PRIORS, ETA, rule)
    assert two[0] > one[0] + 0.2
    assert same_type[0] > one[0]


@RULES
def test_vote_for_another_candidate_lowers_p(rule):
    alone, _ = posterior([Vote("R1", 0)], 1, PRIORS, ETA, rule)
    contested, _ = posterior([Vote("R1", 0), Vote("R2", 1)], 2, PRIORS, ETA, rule)
    assert contested[0] < alone[0]
    assert sum(contested) < 1.0


def test_spec_lets_an_unreliable_vote_count_against_its_own_answer_and_floored_does_not():
    # rho 0.1 with eta 0.25: ratio 0.1 / (0.9 * 0.25) = 0.44 < 1. The finding.
    priors = {"R1": (6.0, 4.0), "R2": (1.0, 9.0)}
    before = {r: posterior([Vote("R1", 0)], 1, priors, 0.25, r)[0][0] for r in ("spec", "floored")}
    after = {r: posterior([Vote("R1", 0), Vote("R2", 0)], 1, priors, 0.25, r)[0][0] for r in before}
    assert after["spec"] < before["spec"]
    assert after["floored"] == pytest.approx(before["floored"])


def test_no_candidates_gives_certain_error():
    probs, residual = posterior([], 0, PRIORS, ETA)
    assert probs == [] and residual == 1.0
    assert error_probability(probs) == 1.0


def test_weights_invariant_to_candidate_order():
    votes = [Vote("R1", 0), Vote("R2", 1), Vote("CB_5", 1), Vote("CB_1", 2)]
    probs, residual = posterior(votes, 3, PRIORS, ETA, "spec")
    relabel = {0: 2, 1: 0, 2: 1}
    shuffled = [Vote(v.source, relabel[v.candidate]) for v in reversed(votes)]
    probs2, residual2 = posterior(shuffled, 3, PRIORS, ETA, "spec")
    assert residual2 == pytest.approx(residual, rel=1e-12)
    for old, new in relabel.items():
        assert probs2[new] == pytest.approx(probs[old], rel=1e-12)


votes_strategy = st.lists(
    st.tuples(st.sampled_from(sorted(PRIORS)), st.integers(0, 5)), min_size=0, max_size=8
)


@settings(max_examples=300, deadline=None)
@given(
    raw=votes_strategy,
    eta=st.floats(0.01, 0.9),
    a=st.floats(0.2, 30),
    b=st.floats(0.2, 30),
)
def test_spec_matches_scipy_reference(raw, eta, a, b):
    priors = dict(PRIORS, R1=(a, b))
    votes = [Vote(t, c) for t, c in raw]
    n = max((c for _, c in raw), default=-1) + 1
    probs, residual = posterior(votes, n, priors, eta, "spec")
    ref_probs, ref_residual = reference(votes, n, priors, eta)
    assert residual == pytest.approx(ref_residual, rel=1e-9, abs=1e-12)
    assert probs == pytest.approx(ref_probs, rel=1e-9, abs=1e-12)
    assert sum(probs) + residual == pytest.approx(1.0)


# ------------------------------------------------------------------ invariants, as property tests

beta_params = st.tuples(st.floats(0.05, 50), st.floats(0.05, 50))
calibrations = st.fixed_dictionaries({t: beta_params for t in ("R1", "R2", "CB_1", "CB_5")})


@settings(max_examples=400, deadline=None)
@given(
    priors=calibrations, eta=st.floats(0.01, 0.95), raw=votes_strategy, extra=st.sampled_from(sorted(PRIORS))
)
def test_an_extra_vote_never_lowers_its_candidates_posterior(priors, eta, raw, extra):
    # Candidates are numbered in the order they first got a vote, as the runner numbers them.
    first_seen = {c: i for i, c in enumerate(dict.fromkeys(c for _, c in raw))}
    votes = [Vote(t, first_seen[c]) for t, c in raw]
    n = len(first_seen)
    for cand in range(n):
        before = posterior(votes, n, priors, eta)[0]
        after, _ = posterior([*votes, Vote(extra, cand)], n, priors, eta)
        assert after[cand] >= before[cand] - 1e-12, (cand, before, after)
    # A new candidate (whose posterior was 0) gains mass from its vote, exactly as much as any
    # candidate whose only vote is of the same type: candidates differ only by their votes.
    after, _ = posterior([*votes, Vote(extra, n)], n + 1, priors, eta)
    assert after[n] > 0, after
    for peer in range(n):
        if [v.source for v in votes if v.candidate == peer] == [extra]:
            assert after[peer] == pytest.approx(after[n], rel=1e-9, abs=1e-15), (peer, after)


@settings(max_examples=300, deadline=None)
@given(priors=calibrations, eta=st.floats(0.01, 0.95), raw=votes_strategy)
def test_floored_weights_do_not_depend_on_vote_order(priors, eta, raw):
    first_seen = {c: i for i, c in enumerate(dict.fromkeys(c for _, c in raw))}
    votes = [Vote(t, first_seen[c]) for t, c in raw]
    n = len(first_seen)
    forward = posterior(votes, n, priors, eta)
    backward = posterior(list(reversed(votes)), n, priors, eta)
    assert backward[1] == pytest.approx(forward[1]) and backward[0] == pytest.approx(forward[0])


def test_vote_model_rejects_unknown_rules():
    with pytest.raises(ValueError, match="rule must be one of"):
        VoteModel(PRIORS, ETA, rule="bayes")


@pytest.mark.parametrize("rule", ["floored", "spec"])
def test_a_votes_own_reliability_weighs_it_as_a_type_of_that_reliability(rule):
    """A vote carrying its own rho moves the posterior as a vote of a type with that mean would."""
    own = posterior(
        [Vote("R1", 0, 0.8), Vote("CB_3", 1)], 2, {"R1": (5.0, 5.0), "CB_3": (6.0, 4.0)}, 0.1, rule
    )
    typed = posterior(
        [Vote("R1x", 0), Vote("CB_3", 1)], 2, {"R1x": (8.0, 2.0), "CB_3": (6.0, 4.0)}, 0.1, rule
    )
    assert own[0] == pytest.approx(typed[0]) and own[1] == pytest.approx(typed[1])
    alone = posterior([Vote("R1", 0, 0.8)], 1, {"R1": (5.0, 5.0)}, 0.1, "floored")
    assert alone[0][0] == pytest.approx(0.8)  # one vote: P is its own reliability
