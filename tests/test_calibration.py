"""Calibration loading and validation."""

import copy
import json

import pytest

from brag import DEFAULT_CALIBRATION_PATH, Calibration, load_calibration


def shipped() -> dict:
    return json.loads(DEFAULT_CALIBRATION_PATH.read_text())


def test_shipped_calibration_loads_and_says_where_it_came_from():
    cal = load_calibration()
    assert isinstance(cal, Calibration)
    raw = shipped()
    assert raw["version"] == 1 and raw["note"]
    assert cal.m == raw["m"] and 0 < cal.eta < 1
    assert set(cal.rates()) == {"R1", "R2", "CB", "R1_weak", "R2_weak"}


def test_round_trip_through_dict_and_json_string():
    cal = load_calibration()
    again = load_calibration(json.dumps(cal.to_dict()))
    assert again == cal
    assert load_calibration(cal) is cal
    assert load_calibration(str(DEFAULT_CALIBRATION_PATH)) == cal


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
        (broken(["actions", "R2"], KeyError), "actions.R2 is missing"),
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
    priors = cal.source_priors(3)
    assert set(priors) == {"R1", "R2", "R1_weak", "R2_weak", "CB_1", "CB_2", "CB_3"}
    full = cal.source_priors(5)
    assert priors["CB_3"] == full["CB_5"] and priors["CB_1"] == full["CB_2"]
