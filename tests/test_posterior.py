"""Posterior (SPEC section 1): sanity checks and a slow scipy reference on random inputs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import betaln

from brag import Vote, error_probability, posterior

PRIORS = {"R1": (6.0, 4.0), "R2": (3.0, 2.0), "CB_1": (1.0, 9.0), "CB_5": (8.0, 2.0)}
ETA = 0.1


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


@pytest.mark.parametrize("source", list(PRIORS))
def test_single_vote_gives_mean_reliability(source):
    a, b = PRIORS[source]
    probs, residual = posterior([Vote(source, 0)], 1, PRIORS, ETA)
    assert probs[0] == pytest.approx(a / (a + b), rel=1e-12)
    assert residual == pytest.approx(b / (a + b), rel=1e-12)


def test_two_agreeing_votes_beat_one():
    one, _ = posterior([Vote("R1", 0)], 1, PRIORS, ETA)
    two, _ = posterior([Vote("R1", 0), Vote("R2", 0)], 1, PRIORS, ETA)
    same_type, _ = posterior([Vote("R1", 0), Vote("R1", 0)], 1, PRIORS, ETA)
    assert two[0] > one[0] + 0.2
    assert same_type[0] > one[0]


def test_vote_for_another_candidate_lowers_p():
    alone, _ = posterior([Vote("R1", 0)], 1, PRIORS, ETA)
    contested, _ = posterior([Vote("R1", 0), Vote("R2", 1)], 2, PRIORS, ETA)
    assert contested[0] < alone[0]
    assert sum(contested) < 1.0


def test_no_candidates_gives_certain_error():
    probs, residual = posterior([], 0, PRIORS, ETA)
    assert probs == [] and residual == 1.0
    assert error_probability(probs) == 1.0


def test_weights_invariant_to_candidate_order():
    votes = [Vote("R1", 0), Vote("R2", 1), Vote("CB_5", 1), Vote("CB_1", 2)]
    probs, residual = posterior(votes, 3, PRIORS, ETA)
    relabel = {0: 2, 1: 0, 2: 1}
    shuffled = [Vote(v.source, relabel[v.candidate]) for v in reversed(votes)]
    probs2, residual2 = posterior(shuffled, 3, PRIORS, ETA)
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
def test_matches_scipy_reference(raw, eta, a, b):
    priors = dict(PRIORS, R1=(a, b))
    votes = [Vote(t, c) for t, c in raw]
    n = max((c for _, c in raw), default=-1) + 1
    probs, residual = posterior(votes, n, priors, eta)
    ref_probs, ref_residual = reference(votes, n, priors, eta)
    assert residual == pytest.approx(ref_residual, rel=1e-9, abs=1e-12)
    assert probs == pytest.approx(ref_probs, rel=1e-9, abs=1e-12)
    assert sum(probs) + residual == pytest.approx(1.0)
