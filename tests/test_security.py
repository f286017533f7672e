"""Every finding of the security review, reproduced against the real app over HTTP.

The probes live in ``security_probes.py`` (``bench/security.py`` runs the same ones and writes
``bench/results/security.md``). Each must now be refused or bounded, reach nothing it must
not, and leave the server answering.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import security_probes
from security_probes import REQUEST_TIMEOUT, probes, run, start_lab

PROBES = probes()


@pytest.fixture(scope="module")
def outcomes():
    with ExitStack() as stack:
        lab = start_lab(stack)
        yield run(lab)


@pytest.mark.parametrize("index", range(len(PROBES)), ids=[p.finding[:60] for p in PROBES])
def test_each_probe_is_refused_or_bounded_and_the_server_still_answers(outcomes, index):
    outcome = outcomes[index]
    assert outcome.probe.finding == PROBES[index].finding
    assert outcome.failure is None, (outcome.failure, outcome.response[:300])


def by_finding(outcomes, start: str):
    return next(o for o in outcomes if o.probe.finding.startswith(start))


def test_nothing_is_read_and_memory_stays_flat(outcomes):
    zero = by_finding(outcomes, "file read: /dev/zero")
    assert zero.seconds < 5 and zero.rss_after - zero.rss_before < 50
    question = by_finding(outcomes, "size: a 10 MB question")
    assert question.rss_after - question.rss_before < 150


def test_the_deadline_holds_against_a_trickling_endpoint(outcomes):
    trickle = by_finding(outcomes, "no deadline")
    assert trickle.seconds < REQUEST_TIMEOUT + 5, trickle.seconds


def test_pasted_corpora_are_cached_within_the_budget(outcomes):
    cached = by_finding(outcomes, "size: distinct pasted corpora")
    # 8 distinct sets of about 5 MB each once indexed; the 20 MB budget keeps a few of them.
    assert cached.rss_after - cached.rss_before < 30 * security_probes.DISTINCT_SETS


def test_refusals_are_quick(outcomes):
    for start in ("SSRF", "port scan", "allow-list", "local:<path>", "file read"):
        for outcome in outcomes:
            if outcome.probe.finding.startswith(start):
                assert outcome.seconds < 5, (outcome.probe.finding, outcome.seconds)
