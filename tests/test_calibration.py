"""Calibration loading and validation."""

import copy
import json

import pytest

import brag
from brag import PRIOR_CALIBRATION_PATH, Calibration, load_calibration


def shipped() -> dict:
    return json.loads(PRIOR_CALIBRATION_PATH.read_text())


def test_the_default_is_the_hand_set_prior_and_says_so():
    cal = load_calibration()
    assert isinstance(cal, Calibration)
    raw = shipped()
    assert raw["version"] == 1 and raw["note"] and raw["fitted"] is False
    assert cal.m == raw["m"] and 0 < cal.eta < 1
    assert set(cal.rates()) == {"R1", "R2", "CB", "R1_weak", "R2_weak", "R2_after_answer", "R2_after_none"}
    assert "uncalibrated" in brag.calibration_status(cal, "any-model")
    assert "run /calibrate for this model" in brag.calibration_status(cal, "any-model")


def test_round_trip_through_dict_and_json_string():
    cal = load_calibration()
    again = load_calibration(json.dumps(cal.to_dict()))
    assert again == cal
    assert load_calibration(cal) is cal
    assert load_calibration(str(PRIOR_CALIBRATION_PATH)) == cal


def fitted_for(model: str, corpus: str) -> Calibration:
    return load_calibration({**shipped(), "fitted": True, "model": model, "corpus": corpus})


def test_a_calibration_is_picked_only_for_the_model_it_was_fitted_on():
    shipped_set = {
        "prior": load_calibration(),
        "a-hotpot": fitted_for("model-a", "HotpotQA"),
        "a-musique": fitted_for("model-a", "MuSiQue"),
        "b-musique": fitted_for("model-b", "MuSiQue"),
    }
    pick = lambda model, corpus: brag.shipped_calibration(model, corpus, shipped_set)  # noqa: E731
    assert pick("model-a", "MuSiQue") is shipped_set["a-musique"]
    assert pick("model-a", "Demo") is shipped_set["a-hotpot"]  # its own, on the general corpus
    assert pick("model-b", "HotpotQA") is shipped_set["b-musique"]  # its own, on another corpus
    assert pick("model-c", "MuSiQue") is shipped_set["prior"]  # never another model's
    assert "fitted for this model on MuSiQue" in brag.calibration_status(pick("model-b", "x"), "model-b")
    assert "fitted for another model (model-b)" in brag.calibration_status(shipped_set["b-musique"], "c")


DOCUMENTS_FIT = brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-documents.json"


def across_readers(readers: dict | None = None) -> dict:
    """The 0.5B's documents fit, marked as a fit across two readers, with the given terms."""
    data = json.loads(DOCUMENTS_FIT.read_text())
    terms = {"reader-a": {"RT": {"offset": -1.0, "scale": 0.5}, "CB": {"offset": 2.0, "scale": 1.0}}}
    return {
        **data,
        "model": "any reader",
        brag.ACROSS_READERS: ["reader-a", "reader-b"],
        "readers": readers or terms,
    }


def test_reader_terms_scale_then_shift_every_reliability_an_entry_holds():
    cal = load_calibration(DOCUMENTS_FIT)
    terms = brag.ReaderTerms(offset=-1.0, scale=0.5)
    rt, moved = cal.actions["RT"], terms.prior(cal.actions["RT"])
    evidence = {"answer_p": 0.9, "answer_p_min": 0.6, "span": 1.0, "in_question": 0.0, "margin": 0.2}
    score = rt.curve.score(evidence)
    expected = brag.bounded_reliability(1 / (1 + 2.718281828459045 ** -(0.5 * score - 1.0)))
    assert abs(moved.curve.reliability(evidence) - expected) < 1e-4
    assert (moved.a + moved.b) == pytest.approx(rt.a + rt.b) and moved.mean < rt.mean
    assert moved.q == rt.q and moved.same == rt.same  # rates and repeats are not a reader's
    # Its lookahead spread moves with it, and (0, 1) changes nothing.
    assert moved.curve.outcomes({}, cal.eta) != rt.curve.outcomes({}, cal.eta)
    assert brag.ReaderTerms().prior(rt).curve.reliability(evidence) == pytest.approx(
        rt.curve.reliability(evidence)
    )
    cb = terms.prior(cal.actions["CB"])
    assert all(a.mean != b.mean for a, b in zip(cb.levels, cal.actions["CB"].levels, strict=True))
    # However far terms move a reliability, the entry stays one a calibration may hold.
    for extreme in (brag.ReaderTerms(offset=-20.0), brag.ReaderTerms(offset=20.0, scale=20.0)):
        moved = {**cal.to_dict(), "actions": {**cal.to_dict()["actions"]}}
        moved["actions"]["CB"] = brag.action_named("CB").kind.entry_dict(extreme.prior(cal.actions["CB"]))
        assert 0 < load_calibration(moved).actions["CB"].levels[0].mean < 1


def test_a_fit_across_readers_is_made_for_a_reader_with_its_own_terms_or_none():
    cal = load_calibration(across_readers())
    assert cal.across_readers and set(cal.readers) == {"reader-a"}
    own, unknown = cal.for_reader("reader-a"), cal.for_reader("a new model")
    assert own.meta["model"] == "reader-a" and own.meta[brag.READER_TERMS] == "own"
    assert own.actions["RT"] != cal.actions["RT"] and own.actions["R1"] == cal.actions["R1"]
    assert unknown.actions == cal.actions and unknown.meta[brag.READER_TERMS] == "none"
    assert own.for_reader("reader-a") is own  # made once: its terms are never applied twice
    assert "with this reader's own terms" in brag.calibration_status(own, "reader-a")
    status = brag.calibration_status(unknown, "a new model")
    assert status.startswith("fitted for other readers (reader-a, reader-b), not yet for this one")
    # Its terms survive a round trip, and a fit for one reader is its own whoever reads with it.
    assert load_calibration(json.dumps(cal.to_dict())).readers == cal.readers
    single = load_calibration(DOCUMENTS_FIT)
    assert single.for_reader("a new model") is single


@pytest.mark.parametrize(
    ("readers", "message"),
    [
        ({"r": {"RT": {"offset": 0.0, "scale": 0.0}}}, "scale"),
        ({"r": {"R9": {"offset": 0.0, "scale": 1.0}}}, "one of its actions"),
        ({"r": {"RT": {"offset": "x", "scale": 1.0}}}, "offset must be a number"),
        ({"r": [1]}, "must be an object of actions"),
    ],
)
def test_malformed_reader_terms_are_refused_by_name(readers, message):
    with pytest.raises(brag.CalibrationError, match=message):
        load_calibration(across_readers(readers))


def test_a_model_with_no_fit_reads_documents_with_the_fit_across_readers():
    shipped_set = {
        "prior": load_calibration(),
        "own": fitted_for("model-a", brag.DOCUMENTS),
        "across": load_calibration(across_readers()),
    }
    pick = lambda model, corpus=None: brag.shipped_calibration(model, corpus, shipped_set)  # noqa: E731
    assert pick("model-a") is shipped_set["own"]  # a model's own fit, unchanged
    assert pick("reader-a").meta[brag.READER_TERMS] == "own"
    assert pick("Qwen/Qwen2.5-7B-Instruct").actions == shipped_set["across"].actions
    assert pick("Qwen/Qwen2.5-7B-Instruct").meta["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert pick("Qwen/Qwen2.5-7B-Instruct", "HotpotQA") is shipped_set["prior"]  # a benchmark: as before
    # Given as it is (a path, a dict), the controller makes it for its reader.
    reader = type("Reader", (), {"name": "reader-a", "complete": None})()
    assert brag.BRAG(reader, calibration=across_readers()).calibration.meta[brag.READER_TERMS] == "own"


def test_shipped_calibrations_load():
    found = brag.shipped_calibrations()
    assert "prior" in found
    for name, cal in found.items():
        assert name == "prior" or (cal.meta["fitted"] and cal.meta["model"] and cal.meta["corpus"]), name


def broken(path: list, value) -> dict:
    data = copy.deepcopy(shipped())
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ('{"version": 1,', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        (broken(["version"], 99), "unsupported version"),
        (broken(["eta"], 0), "eta"),
        (broken(["eta"], "high"), "eta must be a number"),
        (broken(["actions"], {}), "'actions' must be an object with some of R1, R2, CB, RT, RS and RN"),
        (broken(["actions", "R9"], {"q": 0.5}), "actions.'R9' is not an action of this BRAG"),
        (broken(["actions", "R1", "q"], 1.5), "actions.R1.q"),
        (broken(["actions", "R1", "rho", "a"], -1), "actions.R1.rho.a"),
        (broken(["actions", "R1", "rho"], [1, 2]), "actions.R1.rho must be an object"),
        (broken(["actions", "CB", "levels", "3"], KeyError), "exactly 1..5"),
        (broken(["actions", "CB", "levels", "1", "pi"], 0.9), "sum to 1"),
        (broken(["m"], 7), "m = 7"),
        ("/no/such/calibration.json", "cannot read"),
    ],
)
def test_malformed_calibration_is_a_clear_value_error(data, message):
    with pytest.raises(ValueError, match="calibration") as err:
        load_calibration(data)
    assert message in str(err.value)


def test_rescales_agreement_levels_for_another_m():
    cal = load_calibration()
    priors = {str(t): v for t, v in cal.source_priors(3).items()}
    assert set(priors) == {"R1", "R2", "R1_weak", "R2_weak", "R2_same", "R2_new", "CB_1", "CB_2", "CB_3"}
    full = {str(t): v for t, v in cal.source_priors(5).items()}
    assert priors["CB_3"] == full["CB_5"] and priors["CB_1"] == full["CB_2"]


@pytest.mark.parametrize(
    "path",
    [
        ["actions", "R1", "rho", "a"],
        ["actions", "R2", "same", "rho", "b"],
        ["actions", "CB", "levels", "1", "kappa", "a"],
    ],
)
@pytest.mark.parametrize("value", [5e-324, 1e-4, 2e6])
def test_beta_parameters_past_what_any_fit_gives_are_refused_by_field(path, value):
    with pytest.raises(ValueError, match=r"\.".join(path[1:]) + r" = .* is outside \[0\.001, 1e\+06\]"):
        load_calibration(broken(path, value))


@pytest.mark.parametrize("a, b", [(1e-3, 1e6), (1e6, 1e-3), (1e-3, 1e-3), (1e6, 1e6)])
def test_the_extremes_of_the_range_give_finite_beliefs_and_a_clear_summary(a, b):
    data = shipped()
    for name in ("R1", "R2"):
        data["actions"][name]["rho"] = {"a": a, "b": b}
    for level in data["actions"]["CB"]["levels"].values():
        level["kappa"] = {"a": a, "b": b}

    class Reader:
        name = "scripted"

        def complete(self, messages, *, n=1, **kwargs):
            return brag.Completion(["Answer: Bergen\nFollow-up query: Lina Berg"] * n, 10, 2)

    corpus = brag.Corpus(["Lina Berg was born in Bergen.", "Bergen is a city in Norway."])
    answer, report = brag.BRAG(Reader(), calibration=data).run("Where was Lina Berg born?", corpus)
    p = report["confidence"]["p_correct"]
    assert answer == "Bergen" and 0.0 <= p <= 1.0 and "nan" not in report["confidence"]["summary"]


def test_a_report_repeats_a_calibrations_own_description_short_and_plain():
    nested: list = []
    for _ in range(300):
        nested = [nested]
    data = {**shipped(), "name": 2**64, "date": nested, "corpus": "c" * 99_000, "model": "m" * 5_000}
    data["pooled_from"] = ["set"] * 1_000
    cal = load_calibration(data)
    run = brag._Run(brag.BRAG(object(), calibration=cal), "Where?", brag.Corpus(["Bergen."]))
    meta = run.report("done").config["calibration"]
    assert meta["name"] is None and meta["date"] == [] and len(meta["corpus"]) == brag.MAX_META_CHARS
    assert len(json.dumps(meta)) < 2_000  # every report carries it; it stays small
    status = brag.calibration_status(cal, "another")
    assert len(status) < 400 and "m" * (brag.MAX_META_CHARS + 1) not in status
