"""bragkit/fits.py's store: every kept fit in one place, by name; the owner's by model and corpus."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from selftest_reader import PASSAGES, SelfTestReader

import brag
from bragkit import fits

ROOT = Path(__file__).resolve().parent.parent
PRIOR = json.loads((ROOT / "tests" / "prior_calibration.json").read_text())


def _pooled_fit() -> brag.Calibration:
    return next(c for c in brag.shipped_calibrations().values() if c.meta.get("corpus") == brag.POOLED)


def test_fair_evictions_take_the_adders_own_first_and_past_the_total_from_whoever_keeps_most():
    evict = fits.fair_evictions
    entries = [("a", float(t), f"a{t}") for t in range(5)] + [("b", 10.0, "b0"), ("b", 11.0, "b1")]
    assert evict(entries, "a", per_owner=3, total=100) == ["a0", "a1"]
    assert evict(entries, "b", per_owner=3, total=6) == ["a0"]  # b adds, a keeps the most
    assert evict(entries, "b", per_owner=1, total=100) == ["b0"]


def test_no_address_pushes_another_s_kept_fit_out_and_the_least_recently_used_goes_first(tmp_path):
    kept = fits.FitStore(tmp_path, limit=6, per_caller=3)
    victim = kept.keep({**PRIOR, "note": "victim"}, "198.51.100.7")
    own = [kept.keep({**PRIOR, "note": f"own {i}"}, "192.0.2.9") for i in range(3)]
    kept.load(own[0])  # used: now the most recent of the three
    for i in range(40):  # one address keeps forty more, each a new fit
        kept.keep({**PRIOR, "note": f"flood {i}"}, "192.0.2.9")
    assert kept.path(victim) is not None and kept.load(victim).meta["note"] == "victim"
    assert len(list(tmp_path.glob("a-*/fit-*.json"))) <= 6
    assert kept.path(own[1]) is None and kept.path("../../etc") is None and kept.path("fit-zz") is None
    with pytest.raises(brag.InputError, match="no kept calibration is named"):
        kept.load(own[1])
    kept.path(victim).write_text("{not json", encoding="utf-8")
    with pytest.raises(brag.InputError, match="cannot be read; run /calibrate again"):
        kept.load(victim)


def test_the_owners_self_test_is_kept_by_model_and_corpus_and_no_caller_evicts_it(tmp_path):
    corpus = brag.Corpus(PASSAGES)
    fitted = fits.calibrate_corpus(corpus, SelfTestReader(), _pooled_fit(), plan=fits.SelfTestPlan(10, 20))
    store = fits.fit_store(tmp_path, limit=4, per_caller=2)
    path = store.keep_own(fitted)
    name = path.stem
    assert path.parent == tmp_path / "calibrations" / fits.FitStore.OWNER
    assert name == fits.FitStore.own_name("selftest-reader", corpus.fingerprint())
    again = store.own("selftest-reader", corpus.fingerprint())
    assert again is not None
    assert again.to_dict()["actions"] == brag.load_calibration(fitted).to_dict()["actions"]
    assert store.load(name).meta["name"] == name  # by name, as any kept fit
    assert store.own("another-model", corpus.fingerprint()) is None
    assert store.own("selftest-reader", brag.Corpus(PASSAGES[:3]).fingerprint()) is None
    for i in range(12):  # callers fill the store far past its total
        store.keep({**PRIOR, "note": f"caller {i}"}, f"192.0.2.{i}")
    assert store.own("selftest-reader", corpus.fingerprint()) is not None  # the owner's stays
    path.write_text("{not json", encoding="utf-8")  # a damaged file is passed over, not an error
    assert store.own("selftest-reader", corpus.fingerprint()) is None
    # A file whose content names another corpus is not taken for this one.
    path.write_text(json.dumps({**fitted, "corpus": "elsewhere"}), encoding="utf-8")
    assert store.own("selftest-reader", corpus.fingerprint()) is None


def test_an_owners_fit_kept_before_the_store_was_one_is_still_found(tmp_path):
    corpus = brag.Corpus(PASSAGES)
    fitted = fits.calibrate_corpus(corpus, SelfTestReader(), _pooled_fit(), plan=fits.SelfTestPlan(10, 20))
    # Where the owner's self-tests were kept before (a store of their own beside the callers').
    digest = hashlib.sha256(f"selftest-reader\n{corpus.fingerprint()}".encode()).hexdigest()[:32]
    old = tmp_path / "selftest" / f"selftest-{digest}.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps(fitted), encoding="utf-8")
    found = fits.fit_store(tmp_path).own("selftest-reader", corpus.fingerprint())
    assert found is not None and found.meta["corpus"] == corpus.fingerprint()
