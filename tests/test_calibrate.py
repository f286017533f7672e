"""Calibration: recovery of known rates, shrinkage, resume, bad input, the shipped files."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import ROOT, ScriptedLLM, without
from selftest_reader import PASSAGES, SelfTestReader, WideReadsErr

import brag
import calibrate
from brag import BRAG, Completion, Corpus
from bragkit import calibrate_cli, fits, llms, storage

TRUTH = {
    "q": {"R1": 0.8, "R2": 0.65, "CB": 0.95},
    "rho": {"R1": 0.55, "R2": 0.7},
    "pi": {1: 0.15, 2: 0.15, 3: 0.2, 4: 0.2, 5: 0.3},
    "kappa": {1: 0.1, 2: 0.25, 3: 0.4, 4: 0.6, 5: 0.8},
    "eta": 0.3,
}
CORPUS = Corpus([f"passage {i} about topic {i % 7} and subject {i % 5}" for i in range(40)])


class SimulatedLLM:
    """Answers drawn from known rates, as a pure function of (question, action), so a resumed run
    gets the same answer a fresh one would. The first wrong vote on a question names its
    distractor; each later wrong vote repeats it with probability eta, else is new."""

    def __init__(self, truth: dict, seed: int = 0) -> None:
        self.truth, self.seed = truth, seed

    def outcome(self, qid: str, action: str) -> tuple[bool, bool, int]:
        """(answered, correct, agreement g) of one action on one question."""
        rng, truth = random.Random(f"{self.seed}-{qid}-{action}"), self.truth
        if rng.random() >= truth["q"][action]:
            return False, False, 0
        if action == "CB":
            g = rng.choices(list(truth["pi"]), weights=list(truth["pi"].values()))[0]
            return True, rng.random() < truth["kappa"][g], g
        return True, rng.random() < truth["rho"][action], 0

    def answer(self, qid: str, action: str) -> tuple[str, int]:
        answered, correct, g = self.outcome(qid, action)
        if not answered:
            return "NONE", 0
        if correct:
            return f"gold{qid}", g
        order = ("R1", "R2", "CB", "RT")  # the order calibration runs them in
        earlier = order[: order.index(action)]
        if not any(self.outcome(qid, a)[0] and not self.outcome(qid, a)[1] for a in earlier):
            return f"distractor{qid}", g
        repeat = random.Random(f"{self.seed}-{qid}-{action}-eta").random() < self.truth["eta"]
        return (f"distractor{qid}" if repeat else f"other{qid}{action.lower()}"), g

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        prompt = messages[-1]["content"]
        qid = re.findall(r"Question: Q(\d+) ", prompt)[-1]
        if messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS:
            answer, g = self.answer(qid, "CB")
            if answer == "NONE":
                return Completion(["NONE"] * n, 10, n)
            return Completion([answer] * g + [f"noise{qid}x{j}" for j in range(n - g)], 10, n)
        block = prompt.rsplit("\n\nPassages:\n", 1)[-1]
        action = "R2" if "\n[3] " in block else "R1" if "\n[2] " in block else "RT"
        return Completion([f"Answer: {self.answer(qid, action)[0]}"], 10, 1)


def labelled(n: int) -> list[calibrate.Labelled]:
    return [calibrate.Labelled(str(i), f"Q{i} what is the answer?", (f"gold{i}",)) for i in range(n)]


def mean(beta: dict) -> float:
    return beta["a"] / (beta["a"] + beta["b"])


def test_fit_recovers_known_rates_from_2000_simulated_questions():
    result = calibrate.calibrate(labelled(2000), CORPUS, SimulatedLLM(TRUTH), k=2)
    actions = result["actions"]
    for action in ("R1", "R2", "CB"):
        assert actions[action]["q"] == pytest.approx(TRUTH["q"][action], abs=0.03), action
    for action in ("R1", "R2"):
        assert mean(actions[action]["rho"]) == pytest.approx(TRUTH["rho"][action], abs=0.04), action
    for g in range(1, 6):
        level = actions["CB"]["levels"][str(g)]
        assert level["pi"] == pytest.approx(TRUTH["pi"][g], abs=0.03), g
        assert mean(level["kappa"]) == pytest.approx(TRUTH["kappa"][g], abs=0.08), g
    # eta comes from R1-CB pairs only (about 360 of them here, so a standard error near 0.025).
    assert result["eta"] == pytest.approx(TRUTH["eta"], abs=0.05)
    cal = brag.load_calibration(result)
    assert cal.meta["fitted"] is True and cal.m == 5


def test_thirty_questions_stay_inside_the_unit_interval_and_near_the_prior():
    # CB always agrees fully; R2 never answers: levels 1-4 and R2's reliability see no data.
    truth = dict(
        TRUTH, q={"R1": 0.8, "R2": 0.0, "CB": 1.0}, pi={5: 1.0}, kappa={5: 1.0}, rho={"R1": 1.0, "R2": 0.5}
    )
    result = calibrate.calibrate(labelled(30), CORPUS, SimulatedLLM(truth, seed=3), k=2)
    actions = result["actions"]
    values = [actions["R1"]["q"], actions["R2"]["q"], actions["CB"]["q"], result["eta"]]
    values += [mean(actions[a]["rho"]) for a in ("R1", "R2")]
    values += [lv["pi"] for lv in actions["CB"]["levels"].values()]
    values += [mean(lv["kappa"]) for lv in actions["CB"]["levels"].values()]
    assert all(0 < v < 1 for v in values), values
    assert mean(actions["R2"]["rho"]) == pytest.approx(calibrate.prior_rho("R2"))  # no answers: the prior
    # Levels 1-4 see no vote: each falls back on the model's own closed-book precision (every
    # vote right here), shrunk toward the hand-set prior's mean, and never above level 5's.
    unseen = [mean(actions["CB"]["levels"][str(g)]["kappa"]) for g in range(1, 5)]
    hand_set = sum(calibrate.prior_kappa(g, 5) for g in range(1, 6)) / 5
    assert max(unseen) == pytest.approx(min(unseen))
    assert hand_set < unseen[0] < 1.0
    assert unseen[0] <= mean(actions["CB"]["levels"]["5"]["kappa"])
    assert actions["R2"]["q"] == pytest.approx(4 * 0.7 / 34)  # 0 of 30 answered, shrunk toward 0.7
    assert mean(actions["R1"]["rho"]) < 1.0


class Killed(BaseException):
    """Stands in for the process being killed mid-run."""


class CountingLLM:
    def __init__(self, inner, kill_after: int | None = None) -> None:
        self.inner, self.kill_after, self.calls = inner, kill_after, 0
        self.name = "simulated"
        self._lock = threading.Lock()  # parallel calibration calls from several threads

    def complete(self, messages, **kwargs):
        with self._lock:
            if self.kill_after is not None and self.calls >= self.kill_after:
                raise Killed
            self.calls += 1
        return self.inner.complete(messages, **kwargs)


def test_resume_after_a_kill_repeats_no_llm_call(tmp_path):
    items = labelled(40)
    fresh = CountingLLM(SimulatedLLM(TRUTH, seed=5))
    expected = calibrate.calibrate(items, CORPUS, llms.CachedLLM(fresh, tmp_path / "a.sqlite"), k=2)

    cache, progress = tmp_path / "b.sqlite", tmp_path / "b.progress.jsonl"
    first = CountingLLM(SimulatedLLM(TRUTH, seed=5), kill_after=50)  # dies inside question 17
    with pytest.raises(Killed):
        calibrate.calibrate(items, CORPUS, llms.CachedLLM(first, cache), k=2, progress_path=progress)
    done = len(progress.read_text().splitlines()) - 1  # a header line, then one line per question
    assert 0 < done < len(items) and first.calls == 50
    second = CountingLLM(SimulatedLLM(TRUTH, seed=5))
    replayed = llms.CachedLLM(second, cache)
    resumed = calibrate.calibrate(items, CORPUS, replayed, k=2, progress_path=progress)
    assert first.calls + second.calls == fresh.calls  # nothing asked twice
    per_question = 2 + brag.DEFAULT_HOPS  # R1, each second hop, CB
    # the half-done question's calls came from the cache
    assert replayed.hits == first.calls - per_question * done
    for key in ("eta", "actions", "counts", "diagnostics", "split_ids"):
        assert resumed[key] == expected[key], key


def test_parallel_calibration_equals_the_sequential_one_and_resumes_the_same_way(tmp_path):
    items = labelled(60)
    sequential = llms.CachedLLM(CountingLLM(SimulatedLLM(TRUTH, seed=7)), tmp_path / "s.sqlite")
    expected = calibrate.calibrate(items, CORPUS, sequential, k=2)
    first = CountingLLM(SimulatedLLM(TRUTH, seed=7), kill_after=70)
    cache, progress = tmp_path / "p.sqlite", tmp_path / "p.progress.jsonl"
    with pytest.raises(Killed):
        calibrate.calibrate(
            items, CORPUS, llms.CachedLLM(first, cache), k=2, progress_path=progress, workers=8
        )
    saved = len(progress.read_text().splitlines()) - 1
    assert 0 < saved < 60
    second = CountingLLM(SimulatedLLM(TRUTH, seed=7))
    resumed = calibrate.calibrate(
        items, CORPUS, llms.CachedLLM(second, cache), k=2, progress_path=progress, workers=8
    )
    assert first.calls + second.calls == sequential.llm.calls  # no request made twice
    for key in ("eta", "actions", "counts", "diagnostics", "split_ids", "gate"):
        assert resumed[key] == expected[key], key
    # The same requests, so the same cache keys.
    import sqlite3

    keys = [
        {row[0] for row in sqlite3.connect(path).execute("SELECT key FROM responses")}
        for path in (tmp_path / "s.sqlite", cache)
    ]
    assert keys[0] == keys[1]


def test_progress_is_keyed_by_model_and_damage_is_named(tmp_path):
    items, progress = labelled(30), tmp_path / "cal.progress.jsonl"
    simulated = CountingLLM(SimulatedLLM(TRUTH, seed=5))
    expected = calibrate.calibrate(items, CORPUS, simulated, k=2, progress_path=progress)
    lines = progress.read_text().splitlines()
    assert len(lines) == 31 and "progress_key" in json.loads(lines[0])

    other = CountingLLM(SimulatedLLM(TRUTH, seed=5))
    other.name = "another-model"
    with pytest.raises(ValueError, match="belongs to another model, corpus or setting; delete it"):
        calibrate.calibrate(items, CORPUS, other, k=2, progress_path=progress)
    assert other.calls == 0  # nothing reused, nothing asked

    # A last line cut short by a kill is dropped: that one question runs again, nothing else.
    progress.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    again = CountingLLM(SimulatedLLM(TRUTH, seed=5))
    resumed = calibrate.calibrate(items, CORPUS, again, k=2, progress_path=progress)
    assert again.calls == 2 + brag.DEFAULT_HOPS and resumed["actions"] == expected["actions"]

    progress.write_text("\n".join([*lines[:5], '{"id": "4", "answers": ', *lines[6:]]) + "\n")
    with pytest.raises(ValueError, match=r"cal\.progress\.jsonl, line 6, is damaged .* delete the file"):
        calibrate.calibrate(items, CORPUS, simulated, k=2, progress_path=progress)


def test_a_damaged_response_cache_names_the_file(tmp_path):
    cache = tmp_path / "llm.sqlite"
    cache.write_bytes(b"SQLite format 3\0" + b"\x07" * 4000)
    with pytest.raises(llms.CacheDamaged, match=r"llm\.sqlite is damaged .*delete it"):
        llms.CachedLLM(SimulatedLLM(TRUTH), cache)
    cache.write_bytes(b"not a database at all" * 100)
    with pytest.raises(llms.CacheDamaged, match="delete it"):
        llms.CachedLLM(SimulatedLLM(TRUTH), cache)


def test_calibration_output_is_written_atomically(tmp_path):
    """A write that fails midway (here: the file-size limit, as on a full disk) keeps the old file."""
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "calibration.json"
    out.write_text('{"good": "previous"}')
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from bragkit import storage
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        try:
            storage.write_atomic({str(out)!r}, "x" * 50_000)
        except OSError as err:
            print("failed:", err.strerror)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "failed: File too large" in result.stdout, result.stderr
    assert out.read_text() == '{"good": "previous"}'
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]  # no temporary file left
    storage.write_atomic(out, "new")
    assert out.read_text() == "new"


def test_an_atomic_write_keeps_the_files_mode_and_is_readable_when_new(tmp_path):
    fresh, kept = tmp_path / "fresh.json", tmp_path / "kept.json"
    storage.write_atomic(fresh, "{}")
    assert fresh.stat().st_mode & 0o777 == 0o644  # not the temporary file's private 0600
    kept.write_text("{}")
    kept.chmod(0o640)
    storage.write_atomic(kept, "[]")
    assert kept.stat().st_mode & 0o777 == 0o640 and kept.read_text() == "[]"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('[{"query": "x"}]', "question' is missing"),
        ('[{"question": "x", "colour": "red"}]', "unknown layout"),
        ('[{"question": "Who?", "gold": []}]', "gold answers are missing"),
        ('[{"question": "Who?"', "malformed JSON"),
        ('{"question": "Who?"}', "expected a JSON list"),
        ("/no/such/file.json", "cannot read"),
    ],
)
def test_bad_labelled_input_is_a_clear_error(source, message):
    with pytest.raises(ValueError, match=message):
        calibrate.read_labelled(source)


def test_fewer_than_thirty_questions_is_refused():
    with pytest.raises(ValueError, match="at least 30"):
        calibrate.calibrate(labelled(29), CORPUS, SimulatedLLM(TRUTH))


def test_reads_every_layout_of_the_shared_data(shared_data):
    cases = {
        "hotpotqa/hotpotqa_ircot500.json": 500,
        "hotpotqa/hotpotqa_migres200.json": 200,
        "2wikimultihopqa/2wikimultihopqa.json": 1000,
        "2wikimultihopqa/2wikimultihopqa_migres164.json": 164,
        "musique/musique_migres200.json": 200,
    }
    for path, count in cases.items():
        items = calibrate.read_labelled(shared_data / path)
        assert len(items) == count and all(i.gold and i.question for i in items), path
    musique = calibrate.read_labelled(shared_data / "musique/musique_migres200.json")
    assert any(len(i.gold) > 1 for i in musique)  # aliases count as gold
    hotpot = calibrate.read_labelled(shared_data / "hotpotqa/hotpotqa_ircot500.json")
    assert all(len(i.supporting) == 2 for i in hotpot)


def test_correctness_rule():
    assert calibrate.is_correct("the Nazi party", ["Nazi Party"])
    assert calibrate.is_correct(
        "Chief of Protocol of the United States", ["Chief of Protocol"], f1_threshold=0.5
    )
    assert not calibrate.is_correct("Chief of Protocol of the United States", ["Chief of Protocol"])
    assert not calibrate.is_correct("", ["x"])


SHIPPED = sorted(brag.CALIBRATIONS_DIR.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_calibrations_state_their_model_data_and_split(path):
    raw = json.loads(path.read_text())
    cal = brag.load_calibration(path)
    assert raw["fitted"] is True and raw["date"] and raw["name"] == path.stem
    if cal.across_readers:
        _check_the_fit_across_readers(raw, cal)
        return
    assert raw["model"] == "local:qwen2.5-coder-0.5b-instruct-q4_k_m:chat" == llms.LocalModel().name
    assert cal.m == raw["m"] and 0 < cal.eta < 1 and raw["hops"] >= 1
    pooled = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-pooled.json")
    if raw["corpus"] == brag.DOCUMENTS:
        _check_the_documents_fit(raw, cal)
        return
    if raw["corpus"] == brag.POOLED:
        own = [json.loads(p.read_text()) for p in SHIPPED if p != path and "documents" not in p.stem]
        assert sorted(raw["pooled_from"]) == sorted(o["corpus"] for o in own)
        assert raw["n_questions"] == sum(o["n_questions"] for o in own) and cal.gate is None
        assert brag.shipped_calibration(raw["model"], "uploaded documents") == cal
        return
    assert raw["questions_file"] and raw["split"] == "0:60"
    assert len(raw["split_ids"]) == raw["n_questions"] >= 60
    # The outcomes it was fitted on are kept, and refit to the same values.
    outcomes = calibrate.read_outcomes(path)
    assert [o.id for o in outcomes] == raw["split_ids"]
    assert calibrate.fit(outcomes, raw["m"], raw["hops"], raw["evidence"])["actions"] == raw["actions"]
    replaced = raw["corpus"] in pooled.meta["replaces"]
    assert brag.shipped_calibration(raw["model"], raw["corpus"]) == (pooled if replaced else cal)


def _check_the_documents_fit(raw: dict, cal: brag.Calibration) -> None:
    """The documents fit: the caller's documents get it, named corpora do not, and it refits the same."""
    assert cal.gate is None and cal.found is not None and len(raw["pooled_from"]) >= 8
    assert brag.shipped_calibration(raw["model"]) == cal  # no corpus name: the caller's documents
    for corpus in ("HotpotQA", "MuSiQue", "Demo"):
        assert brag.shipped_calibration(raw["model"], corpus) != cal
    # Its actions refit to the same values from the labelled outcomes kept beside the benchmark of it.
    folder = ROOT / "bench" / "results" / "confidence_documents"
    sets = {
        name: list(calibrate.read_progress(folder / f"{name}.real.jsonl", name).values())
        for name in raw["pooled_from"]
    }
    assert sum(map(len, sets.values())) == raw["n_questions"]
    again = calibrate.documents_fit(sets, raw["m"], raw["hops"], model=raw["model"], evidence=raw["evidence"])
    assert again["actions"] == raw["actions"] and again["eta"] == raw["eta"]


def _check_the_fit_across_readers(raw: dict, cal: brag.Calibration) -> None:
    """Three readers' documents fit: a model with none of its own gets it; it refits the same."""
    names = {key: f"local:{w.name}:{w.prompt_format}" for key, w in llms.LOCAL_MODELS.items()}
    assert raw[brag.ACROSS_READERS] == [names["qwen"], names["smollm2"], names["qwen1.5b"]]
    assert set(cal.readers) == set(raw[brag.ACROSS_READERS]) and cal.found is not None and cal.gate is None
    # What every reader was observed with, and the second hop from the one reader observed with it.
    assert set(cal.actions) == {"R1", "R2", "CB", "RT"} and raw["fitted_on"]["subsets"] == {"R2": 252}
    assert set(cal.readers[names["smollm2"]]) == {"R1", "CB", "RT"}
    # The embedded model keeps its own documents fit; the others, and any model, get this one.
    assert not brag.shipped_calibration(names["qwen"]).across_readers
    others = (
        "Qwen/Qwen2.5-7B-Instruct",
        "http://h:1/v1#m",
        "local:mine.gguf:plain",
    )  # hosted, endpoint, file
    for model in (names["smollm2"], names["qwen1.5b"], *others):
        made = brag.shipped_calibration(model)
        assert made.across_readers and made.meta["model"] == model
        assert made.meta[brag.READER_TERMS] == ("own" if model in cal.readers else "none")
        assert not brag.shipped_calibration(model, "HotpotQA").meta.get("fitted")  # benchmarks: as before
    # Its actions and every reader's terms refit to the same values from the outcomes kept in bench/.
    sets: dict[str, dict[str, list[calibrate.Outcome]]] = {}
    for entry in raw["pooled_from"]:
        model, _, name = entry.rpartition("/")
        key = next(k for k, n in names.items() if n == model)
        if key == "qwen":
            path, progress = ROOT / "bench" / "results" / "confidence_documents" / f"{name}.real.jsonl", name
        else:
            path, progress = (
                ROOT / "bench" / "results" / "models" / key / f"{name}.real.jsonl",
                f"{key}/{name}",
            )
        outcomes = calibrate.read_progress(path, progress).values()
        sets.setdefault(model, {})[name] = [_only(o, cal.actions) for o in outcomes]
    again = calibrate.cross_reader_fit(sets, raw["m"], raw["hops"], evidence=raw["evidence"])
    assert again["actions"] == raw["actions"] and again["readers"] == raw["readers"]


def _only(outcome: calibrate.Outcome, keep) -> calibrate.Outcome:
    """An outcome with only the ``keep`` actions, as a reader observed with those alone has it."""
    fields_ = ("answers", "correct", "agreement", "weak", "hops", "usage", "evidence")
    return replace(
        outcome, **{f: {k: v for k, v in getattr(outcome, f).items() if k in keep} for f in fields_}
    )


class TokenCountingLLM:
    """Every request reports a prompt of 40 tokens per 160 characters and 3 tokens per sample."""

    name = "counting"

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        prompt = sum(len(m["content"]) for m in messages) // 4
        closed_book = messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS
        texts = ["Oslo"] * n if closed_book else ["Answer: Oslo\nFollow-up query: Oslo"]
        return Completion(texts, prompt, 3 * n, seconds=0.001 * prompt + 0.02 * n)


def test_calibration_records_what_each_action_cost_and_the_controller_prices_by_it():
    result = calibrate.calibrate(labelled(30), CORPUS, TokenCountingLLM(), k=2, m=5)
    costs = result["costs"]
    assert set(costs) == {"R1", "R2", "CB"}
    assert costs["CB"]["completion_tokens"] == 15 and costs["R1"]["completion_tokens"] == 3
    assert costs["R1"]["requests"] == costs["CB"]["requests"] == 1
    # A second hop reads its first hop's passages and new ones: a longer prompt.
    assert costs["R2"]["prompt_tokens"] > costs["R1"]["prompt_tokens"] > costs["CB"]["prompt_tokens"]
    for action, cost in costs.items():  # the latencies the backend reported, averaged
        expected = 0.001 * cost["prompt_tokens"] + 0.02 * (5 if action == "CB" else 1)
        assert cost["seconds"] == pytest.approx(expected, abs=1e-3)
    cal = brag.load_calibration(result)  # the costs survive the JSON round trip
    tokens, source = brag.action_costs(cal, "tokens", output_ratio=4.0)
    r1, cb = costs["R1"], costs["CB"]
    assert source == "measured by calibration" and tokens["R1"] == 1.0
    assert tokens["CB"] == pytest.approx(
        (cb["prompt_tokens"] + 4 * cb["completion_tokens"])
        / (r1["prompt_tokens"] + 4 * r1["completion_tokens"])
    )
    seconds, _ = brag.action_costs(cal, "seconds")
    assert seconds["CB"] == pytest.approx(cb["seconds"] / r1["seconds"])
    usd, _ = brag.action_costs(cal, "usd", prices=(1.0, 10.0))
    assert usd["CB"] == pytest.approx(
        (cb["prompt_tokens"] + 10 * cb["completion_tokens"])
        / (r1["prompt_tokens"] + 10 * r1["completion_tokens"])
    )


# ------------------------------------------------------------------ questions without gold answers


def unlabelled(n: int, start: int = 0) -> list[calibrate.Labelled]:
    return [calibrate.Labelled(str(i), f"Q{i} what is the answer?", ()) for i in range(start, start + n)]


def test_questions_without_gold_are_read_from_strings_objects_and_json_lines(tmp_path):
    read = calibrate.read_questions
    assert [q.gold for q in read('["Who?", {"question": "Where?"}, {"question": "When?", "gold": []}]')] == [
        (),
        (),
        (),
    ]
    mixed = read([{"question": "Who?", "gold": ["Ann"]}, "Where?"])
    assert [q.gold for q in mixed] == [("Ann",), ()]
    lines = '{"question": "Who?", "id": "a"}\n\n{"question": "Where?", "gold": "Oslo", "id": "b"}\n'
    assert [(q.id, q.gold) for q in read(lines)] == [("a", ()), ("b", ("Oslo",))]
    (tmp_path / "q.jsonl").write_text(lines, encoding="utf-8")
    assert read(tmp_path / "q.jsonl") == read(lines)
    with pytest.raises(ValueError, match="gold answers are missing"):
        read('[{"question": "Who?", "gold": 5}]')
    with pytest.raises(ValueError, match="'question' is missing"):
        read('[{"text": "Who?"}]')
    with pytest.raises(ValueError, match="gold answers are missing"):
        calibrate._labelled({"question": "Who?", "gold": []}, 0)  # labelled input needs its gold


def test_a_labelled_fit_says_so():
    result = calibrate.calibrate(labelled(40), CORPUS, SimulatedLLM(TRUTH), k=2)
    assert result["fitted_on"] == {"kind": "labelled", "questions": 40, "labelled": 40}


@pytest.mark.parametrize(
    ("truth", "message"),
    [
        (dict(TRUTH, q={"R1": 0.0, "R2": 0.65, "CB": 0.95}), "R1 answered 0 of 60 questions"),
        (
            dict(
                TRUTH,
                q={"R1": 1.0, "R2": 1.0, "CB": 1.0},
                rho={"R1": 1.0, "R2": 1.0},
                kappa=dict.fromkeys(range(1, 6), 1.0),
            ),
            "gave the same answer on 60 of the 60",
        ),
        (
            dict(TRUTH, rho={"R1": 0.0, "R2": 0.0}, kappa=dict.fromkeys(range(1, 6), 0.0), eta=0.0),
            "agreed on only 0",
        ),
        (TRUTH, "a fit from questions without them needs at least 30 with gold"),
    ],
    ids=["never-answers", "always-agree", "never-agree", "no-gold-to-check"],
)
def test_questions_without_gold_that_cannot_identify_the_reliabilities_are_refused_with_the_reason(
    truth, message
):
    with pytest.raises(calibrate.Unidentifiable, match=message):
        calibrate.calibrate(unlabelled(60), CORPUS, SimulatedLLM(truth), k=2)


def test_em_on_simulated_votes_is_refused_rather_than_returned_wrong():
    # Votes drawn from known reliabilities, 100 of 600 questions with gold. EM without the
    # gold gets R2 wrong (the checks below see it), so calibrate refuses instead of returning it.
    good = dict(TRUTH, rho={"R1": 0.85, "R2": 0.8}, kappa={1: 0.3, 2: 0.5, 3: 0.7, 4: 0.85, 5: 0.9}, eta=0.2)
    items = labelled(100) + unlabelled(500, start=100)
    with pytest.raises(calibrate.Unidentifiable, match="labelled questions allow"):
        calibrate.calibrate(items, CORPUS, SimulatedLLM(good), k=2)
    # The same questions all with gold recover the truth, so it is the missing gold that fails.
    full = calibrate.calibrate(labelled(600), CORPUS, SimulatedLLM(good), k=2)["actions"]
    assert mean(full["R1"]["rho"]) == pytest.approx(0.85, abs=0.04)
    assert mean(full["R2"]["rho"]) == pytest.approx(0.8, abs=0.06)


def test_em_expected_counts_reduce_to_the_labelled_fit_when_the_truth_is_certain():
    # One question's votes: R1 and CB name the gold, the hop a distractor. With every vote's
    # ratio huge for the gold's sources the E-step is certain, and the fit equals the labelled one.
    outcome = calibrate.Outcome(
        "1",
        {"R1": "Oslo", "R2": "Bergen", "CB": "oslo"},
        {"R1": True, "R2": False, "CB": True},
        agreement={"CB": 5},
        hops={
            "R2": [
                {
                    "answer": "Bergen",
                    "correct": False,
                    "repeats": False,
                    "after_answer": True,
                    "after_right": True,
                }
            ]
        },
        labelled=False,
    )
    votes = calibrate._Votes.of(outcome, hops=1)
    assert votes.candidates == ["Oslo", "Bergen"]
    assert [(str(t), c) for t, c in votes.votes] == [("R1", 0), ("R2_new", 1), ("CB_5", 0)]
    ratios = {brag.VoteType("R1"): 1e6, brag.VoteType("R2", "new"): 1.0, brag.VoteType("CB", "5"): 1e6}
    seen = votes.expected(ratios, eta=0.2)
    assert seen.correct["R1"] == pytest.approx(1.0) and seen.correct["CB"] == pytest.approx(1.0)
    assert seen.correct["R2"] == pytest.approx(0.0, abs=1e-9)
    assert seen.hops["R2"][0]["after_right"] == pytest.approx(1.0)
    labelled_fit = calibrate.fit_counts([outcome] * 3, 5, 1)
    soft_fit = calibrate.fit_counts([seen] * 3, 5, 1)
    assert json.dumps(soft_fit["actions"], sort_keys=True) == json.dumps(
        labelled_fit["actions"], sort_keys=True
    )


def test_a_mixed_fit_on_cached_2wiki_questions_is_near_the_labelled_fit(shared_data):
    # The first 30 of 2WikiMultihopQA's 60 calibration questions with gold, the rest without;
    # every response replayed from the committed cache.
    llm = llms.CachedLLM(llms.make_llm("local"), ROOT / "bench" / "cache" / "llm.sqlite", mode="replay")
    items = calibrate.read_labelled(shared_data / "2wikimultihopqa" / "2wikimultihopqa.json")[:60]
    corpus = Corpus(
        (shared_data / "2wikimultihopqa" / "2wikimultihopqa_corpus.json").read_text(encoding="utf-8")
    )
    full = calibrate.calibrate(items, corpus, llm, hops=2)
    mixed_items = items[:30] + [calibrate.Labelled(i.id, i.question, ()) for i in items[30:]]
    mixed = calibrate.calibrate(mixed_items, corpus, llm, hops=2)
    assert mixed["fitted_on"]["kind"] == "mixed" and mixed["fitted_on"]["labelled"] == 30
    assert mixed["fitted_on"]["em"]["converged"] is True
    assert mean(mixed["actions"]["R1"]["rho"]) == pytest.approx(mean(full["actions"]["R1"]["rho"]), abs=0.05)
    brag.load_calibration(mixed)


# ------------------------------------------------------------------------------------------
# Evidence levels and the pooled fit
# ------------------------------------------------------------------------------------------


def planted_votes(n: int, seed: int = 0) -> list[tuple[dict, float]]:
    """Votes right 80 % of the time when answer_p > 0.6 and 10 % below; span and in_question are noise."""
    rng = random.Random(seed)
    votes = []
    for _ in range(n):
        p = rng.random()
        right = rng.random() < (0.8 if p > 0.6 else 0.1)
        votes.append(
            (
                {
                    "answer_p": p,
                    "answer_p_min": p * rng.random(),
                    "span": rng.choice([0.0, 1.0, 0.5]),
                    "in_question": float(rng.random() < 0.3),
                },
                float(right),
            )
        )
    return votes


def test_an_evidence_split_is_found_on_the_feature_that_tells_right_from_wrong():
    split, scores = calibrate.fit_evidence_split(planted_votes(300), base_rho=0.4)
    assert split is not None and split["name"] == "answer_p" and split["weights"] == {"answer_p": 1.0}
    assert 0.5 < split["threshold"] < 0.7  # the planted cut is 0.6
    hi, lo = (mean(split["levels"][name]["rho"]) for name in ("hi", "lo"))
    assert hi > 0.65 and lo < 0.2
    assert scores["answer_p"] > 0.75 and max(scores["span"], scores["in_question"]) < 0.6
    assert split["auc"] == scores["answer_p"]
    prior = brag.load_calibration(ROOT / "tests" / "prior_calibration.json").to_dict()
    prior["actions"]["R1"]["evidence"] = split  # what fit writes, the loader reads
    assert brag.load_calibration(prior).actions["R1"].evidence.name == "answer_p"


def test_no_split_is_kept_when_no_feature_carries_signal_or_a_feature_is_mostly_missing():
    rng = random.Random(1)
    noise = [
        ({"answer_p": rng.random(), "span": rng.random(), "in_question": 0.0}, float(rng.random() < 0.3))
        for _ in range(300)
    ]
    split, scores = calibrate.fit_evidence_split(noise, base_rho=0.3)
    right = int(sum(r for _, r in noise))
    assert split is None and all(
        score < calibrate.chance_auc(right, 300 - right) for score in scores.values()
    )
    assert set(scores) == {"answer_p", "span", "in_question", "combined"}  # each tried, none kept
    half_missing = [
        ({**v, "answer_p": v["answer_p"] if i % 2 else None}, r)
        for i, (v, r) in enumerate(planted_votes(300))
    ]
    split, scores = calibrate.fit_evidence_split(half_missing, base_rho=0.4)
    assert "answer_p" not in scores and "answer_p" not in (split or {}).get("weights", {})  # not tried


def simulated_fit(tmp_path, name: str, truth: dict, n: int = 40) -> tuple[dict, list]:
    """A calibration of the simulated model on ``n`` questions, with the outcomes it kept."""
    progress = tmp_path / f"{name}.progress.jsonl"
    items = [calibrate.Labelled(f"{name}{i}", f"Q{i} what is the answer?", (f"gold{i}",)) for i in range(n)]
    result = calibrate.calibrate(
        items, CORPUS, SimulatedLLM(truth), k=2, progress_path=progress, meta={"name": name, "corpus": name}
    )
    return result, list(calibrate.read_progress(progress, None).values())


def test_a_pooled_fit_spans_every_set_and_says_which_own_fits_it_beats(tmp_path):
    weaker = {**TRUTH, "rho": {"R1": 0.3, "R2": 0.4}}
    sets = [simulated_fit(tmp_path, "A", TRUTH), simulated_fit(tmp_path, "B", weaker)]
    pooled = calibrate.pool(sets)
    cal = brag.load_calibration(pooled)
    assert (
        pooled["corpus"] == brag.POOLED
        and pooled["pooled_from"] == ["A", "B"]
        and pooled["n_questions"] == 80
    )
    assert cal.gate is None and set(pooled["cross_validation"]) == {"A", "B"}
    assert set(pooled["replaces"]) <= {"A", "B"}
    for name, losses in pooled["cross_validation"].items():
        assert (name in pooled["replaces"]) == (losses["pooled"] < losses["own"])
    # Pooled R1 reliability lies between the two sets' own.
    own = [mean(s[0]["actions"]["R1"]["rho"]) for s in sets]
    assert min(own) <= cal.actions["R1"].mean <= max(own)
    other_model = ({**sets[1][0], "model": "another"}, sets[1][1])
    with pytest.raises(ValueError, match="one model and one setting"):
        calibrate.pool([sets[0], other_model])
    with pytest.raises(ValueError, match="at least two"):
        calibrate.pool(sets[:1])


def test_shipped_calibration_prefers_its_own_fit_unless_the_pooled_one_beat_it():
    prior = brag.load_calibration(ROOT / "tests" / "prior_calibration.json").to_dict()

    def fit(corpus: str, **meta) -> brag.Calibration:
        return brag.load_calibration({**prior, "fitted": True, "model": "m", "corpus": corpus, **meta})

    shipped = {
        "prior": brag.load_calibration(prior),
        "a": fit("A"),
        "b": fit("B"),
        "pooled": fit(brag.POOLED, replaces=["B"], pooled_from=["A", "B"]),
    }
    assert brag.shipped_calibration("m", "A", shipped) is shipped["a"]
    assert brag.shipped_calibration("m", "B", shipped) is shipped["pooled"]
    assert brag.shipped_calibration("m", "uploaded documents", shipped) is shipped["pooled"]
    assert brag.shipped_calibration("m", None, shipped) is shipped["pooled"]
    assert brag.shipped_calibration("other model", "A", shipped) is shipped["prior"]
    assert brag.calibration_status(shipped["pooled"], "m") == "fitted for this model, pooled over A, B"
    # With a documents fit, the caller's own documents (no corpus name) get it; named corpora do not.
    shipped["documents"] = fit(brag.DOCUMENTS, pooled_from=["bash", "nano"])
    assert brag.shipped_calibration("m", None, shipped) is shipped["documents"]
    assert brag.shipped_calibration("m", "A", shipped) is shipped["a"]
    assert brag.shipped_calibration("m", "B", shipped) is shipped["pooled"]
    assert brag.shipped_calibration("m", "Demo", shipped) is shipped["pooled"]
    assert brag.shipped_calibration("other model", None, shipped) is shipped["prior"]


def test_the_pool_command_fits_from_the_outcomes_kept_beside_each_calibration(tmp_path, capsys):
    paths = []
    for name, truth in (("A", TRUTH), ("B", TRUTH)):
        result, _ = simulated_fit(tmp_path, name, truth)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        (tmp_path / f"{name}.progress.jsonl").replace(calibrate.outcomes_path(path))
        paths.append(str(path))
    out = tmp_path / "pooled.json"
    assert calibrate_cli.main(["pool", *paths, "--out", str(out)]) == 0
    assert brag.load_calibration(out).meta["pooled_from"] == ["A", "B"]
    calibrate.outcomes_path(paths[1]).unlink()
    assert calibrate_cli.main(["pool", *paths, "--out", str(out)]) == 2
    assert "B.outcomes.jsonl is missing" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Actions by kind: a fit of the actions named, old outcome files
# ------------------------------------------------------------------------------------------


def test_a_fit_of_named_actions_fits_the_focused_read_and_a_controller_offers_it():
    truth = {**TRUTH, "q": {**TRUTH["q"], "RT": 0.9}, "rho": {**TRUTH["rho"], "RT": 0.75}}
    items, llm = labelled(800), SimulatedLLM(truth, seed=11)
    default = calibrate.calibrate(items, CORPUS, llm, k=2)
    fitted = calibrate.calibrate(items, CORPUS, llm, k=2, actions=["R1", "R2", "CB", "RT"])
    assert "RT" not in default["actions"] and list(fitted["actions"]) == ["R1", "R2", "CB", "RT"]
    assert fitted["actions"]["RT"]["q"] == pytest.approx(0.9, abs=0.04)
    assert mean(fitted["actions"]["RT"]["rho"]) == pytest.approx(0.75, abs=0.05)
    # Each action's entry comes from its own answers; only a hop's "same" branch moves, since it
    # is stored through eta, which the focused read's pairs with closed-book inform as well.
    for action in ("R1", "R2", "CB"):
        mine, before = (without(f["actions"][action], {"same"}) for f in (fitted, default))
        assert mine == before, action
    assert fitted["eta"] != default["eta"]
    assert "RT repeats R1" in fitted["diagnostics"]["wrong_answer_repeats"]
    controller = BRAG(llm, calibration=fitted, k=2)
    assert [a.label for a in controller.offered] == ["R1", "R2", "CB", "RT"]
    _, report = controller.run("Q1 what is the answer?", CORPUS)
    assert report["config"]["actions"]["on_kind_prior"] == []
    assert "RT" in report["steps"][0]["scores"]
    with pytest.raises(brag.InputError, match="actions must be labels of the table"):
        calibrate.calibrate(items, CORPUS, llm, k=2, actions=["R1", "R9"])


def test_an_outcome_saved_before_actions_were_kinds_reads_as_its_first_actions():
    hop = {"answer": "Bergen", "correct": True, "repeats": False, "after_answer": True, "after_right": False}
    evidence = {"answer_p": 0.5, "answer_p_min": 0.4, "span": 1.0, "in_question": 0.0}
    old = {
        "id": "7",
        "answers": {"R1": "Oslo", "R2": "Bergen", "CB": "Bergen"},
        "correct": {"R1": False, "R2": True, "CB": True},
        "agreement": 3,
        "calls": 4,
        "weak": {"R1": False},
        "hops": [hop],
        "usage": {},
        "labelled": True,
        "evidence": evidence,
    }
    outcome = calibrate.Outcome.from_dict(old)
    assert outcome.agreement == {"CB": 3} and outcome.hops == {"R2": [hop]}
    assert outcome.evidence == {"R1": evidence} and outcome.answers == old["answers"]
    again = calibrate.Outcome.from_dict(json.loads(json.dumps(dataclasses.asdict(outcome))))
    assert again == outcome  # what observe saves now reads back the same


def test_a_hop_without_a_read_before_it_and_pools_of_other_actions_are_refused(tmp_path):
    with pytest.raises(brag.InputError, match="R2 reads what a read before it found"):
        calibrate.calibrate(labelled(30), CORPUS, SimulatedLLM(TRUTH), k=2, actions=["R2", "CB"])
    truth = {**TRUTH, "q": {**TRUTH["q"], "RT": 0.9}, "rho": {**TRUTH["rho"], "RT": 0.75}}
    outcomes = calibrate.observe(
        labelled(30), CORPUS, BRAG(SimulatedLLM(truth), lam=0.0, k=2, extra_actions=("RT",))
    )
    with_rt = {**calibrate.fit(outcomes, 5, 2), "name": "a", "model": "m", "k": 2, "m": 5, "hops": 2}
    without_rt = calibrate.fit([dataclasses.replace(o, answers={**o.answers}) for o in outcomes], 5, 2)
    without_rt["actions"].pop("RT")
    without_rt = {**without_rt, "name": "b", "model": "m", "k": 2, "m": 5, "hops": 2}
    with pytest.raises(brag.InputError, match="pool: b fitted the actions CB, R1, R2, a CB, R1, R2, RT"):
        calibrate.pool([(with_rt, outcomes), (without_rt, outcomes)])


# ------------------------------------------------------------------------------------------
# A corpus's own fit: the pooled fit refitted on its questions (calibrate.refit)
# ------------------------------------------------------------------------------------------


def _pooled_fit() -> brag.Calibration:
    return next(c for c in brag.shipped_calibrations().values() if c.meta.get("corpus") == brag.POOLED)


def _corpus_outcomes(n: int, right_share: float, seed: int = 0) -> list[calibrate.Outcome]:
    """Outcomes of R1, R2, CB and RT on n questions; each read right on ``right_share`` of them."""
    rng = np.random.default_rng(seed)
    found = []
    for i in range(n):
        right = bool(rng.random() < right_share)
        answer = "gold" if right else f"wrong{i}"
        evidence = {
            "answer_p": float(rng.uniform(0.2, 1.0)),
            "answer_p_min": 0.5,
            "span": 1.0,
            "in_question": 0.0,
        }
        agreement = int(rng.integers(1, 6))
        found.append(
            calibrate.Outcome(
                id=f"self-{i}",
                answers={"R1": answer, "R2": answer, "CB": "cb", "RT": answer},
                correct={"R1": right, "R2": right, "CB": False, "RT": right},
                agreement={"CB": agreement},
                hops={
                    "R2": [
                        {
                            "answer": answer,
                            "correct": right,
                            "repeats": True,
                            "after_answer": True,
                            "after_right": right,
                            "evidence": evidence,
                        }
                    ]
                },
                evidence={"R1": evidence, "RT": evidence},
            )
        )
    return found


def test_a_planted_corpus_effect_is_recovered_and_the_evidence_score_kept():
    pooled = _pooled_fit()
    outcomes = _corpus_outcomes(60, 0.85)
    refitted = brag.load_calibration(calibrate.refit(pooled, outcomes, strength=5.0))
    assert pooled.actions["R1"].mean < 0.3 < 0.7 < refitted.actions["R1"].mean <= 0.86
    # Discrimination is the pooled fit's: the same score and threshold, the levels re-weighed.
    before, after = pooled.actions["R1"].evidence, refitted.actions["R1"].evidence
    assert (after.weights, after.intercept, after.threshold) == (
        before.weights,
        before.intercept,
        before.threshold,
    )
    assert after.hi.mean >= after.lo.mean and after.hi.mean > before.hi.mean
    # The focused read has no pooled entry: it starts from R1's and gets its evidence score.
    assert refitted.actions["RT"].evidence.weights == before.weights
    # Closed-book was never right here: every agreement level trusts it less, still rising with g.
    kappas = [level.mean for level in refitted.actions["CB"].levels]
    assert kappas == sorted(kappas)
    assert all(
        a.mean <= b.mean
        for a, b in zip(refitted.actions["CB"].levels, pooled.actions["CB"].levels, strict=True)
    )
    assert refitted.eta == pooled.eta


def test_a_strong_prior_or_a_corpus_like_the_pooled_sets_leaves_the_pooled_fit():
    pooled = _pooled_fit()
    outcomes = _corpus_outcomes(60, 0.85)
    fixed = brag.load_calibration(calibrate.refit(pooled, outcomes, strength=1e6))
    for label in ("R1", "R2", "CB"):
        assert fixed.actions[label].mean == pytest.approx(pooled.actions[label].mean, abs=1e-3)
    assert fixed.actions["R1"].evidence.hi.mean == pytest.approx(
        pooled.actions["R1"].evidence.hi.mean, abs=1e-3
    )
    # Reads right as often as the pooled fit says (noise around it): the refit stays near it.
    alike = _corpus_outcomes(60, pooled.actions["R1"].mean, seed=3)
    near = brag.load_calibration(calibrate.refit(pooled, alike, strength=calibrate.SELF_TEST_STRENGTH))
    assert abs(near.actions["R1"].mean - pooled.actions["R1"].mean) < 0.08
    # A handful of questions moves it a little, not all the way.
    few = brag.load_calibration(calibrate.refit(pooled, outcomes[:3], strength=10.0))
    assert few.actions["R1"].mean < 0.5


def test_a_self_test_fit_is_a_loadable_calibration_that_says_what_it_is():
    fitted = calibrate.self_test_fit(
        _pooled_fit(), _corpus_outcomes(30, 0.6), corpus="abc", model="m", meta={"generator": "g"}
    )
    cal = brag.load_calibration(fitted)
    assert cal.meta["fitted_on"] == {"kind": "self-test", "questions": 30, "labelled": 0, "generator": "g"}
    assert {a.label for a in cal.offered()} == {"R1", "R2", "CB", "RT"}
    assert brag.calibration_status(cal, "m") == "calibrated on 30 self-test questions from your documents"
    with pytest.raises(brag.InputError, match="known answers"):
        calibrate.refit(_pooled_fit(), [replace(o, labelled=False) for o in _corpus_outcomes(5, 0.5)])


def test_the_shipped_calibrations_are_unchanged_by_refits():
    # The shipped files load as before and still say what they are.
    for name, cal in brag.shipped_calibrations().items():
        assert cal.meta.get("fitted_on", {}).get("kind") != "self-test", name
    assert "pooled over" in brag.calibration_status(_pooled_fit(), _pooled_fit().meta["model"])


def _self_test_corpus() -> brag.Corpus:
    return brag.Corpus(PASSAGES)


# ------------------------------------------------------------------------------------------
# The corpus's calibration, and where it is kept
# ------------------------------------------------------------------------------------------


def test_calibrate_corpus_fits_every_action_and_records_the_self_test():
    reader, calls = SelfTestReader(), []
    counted = type("Counted", (), {"name": reader.name})()
    counted.complete = lambda messages, **o: calls.append(o) or reader.complete(messages, **o)
    plan = fits.SelfTestPlan(questions=10, tries=20)
    progress: list[float] = []
    fitted = fits.calibrate_corpus(
        _self_test_corpus(), counted, _pooled_fit(), plan=plan, on_progress=lambda f, _: progress.append(f)
    )
    # Each kept question costs a question and a roundtrip, then the reads the base offers: R1 and
    # CB here (a focused read, RT, is run where the base offers it, as the documents fit does). No
    # second hop is run: a question written from one passage has none to find.
    assert fits.SelfTestPlan().observed(_pooled_fit()) == ("R1", "CB")
    documents = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-documents.json")
    assert fits.SelfTestPlan().observed(documents) == ("R1", "CB", "RT")
    assert fitted["fitted_on"]["yield"]["tried"] == 10 and len(calls) == 10 * 2 + 10 * 2
    # Every action the base offers keeps an entry, and no other: the one not observed (R2), the base's own.
    assert set(fitted["actions"]) == {a.label for a in _pooled_fit().offered()}
    assert fitted["actions"]["R2"] == _pooled_fit().to_dict()["actions"]["R2"]
    assert set(fitted["counts"]) == {"R1", "CB"}
    assert fitted["fitted_on"]["kind"] == "self-test" and fitted["fitted_on"]["questions"] == 10
    assert fitted["fitted_on"]["generator"] == "selftest-reader"
    assert fitted["fitted_on"]["yield"]["kept"] == 10
    assert fitted["corpus"] == _self_test_corpus().fingerprint() and fitted["model"] == "selftest-reader"
    assert progress == sorted(progress) and progress[-1] == 1.0
    # A focused read answered from its question's roundtrip still says what the call took.
    assert all(cost["seconds"] is not None for cost in fitted["costs"].values())
    cal = brag.load_calibration(fitted)
    # Every read was right on these questions: the refit trusts R1 more than the pooled fit does.
    assert cal.actions["R1"].mean > _pooled_fit().actions["R1"].mean
    assert brag.calibration_status(cal, "selftest-reader") == (
        "calibrated on 10 self-test questions from your documents"
    )


def test_a_backend_without_log_probabilities_self_tests_to_a_fit():
    # The documents fit's curves weigh the answer's token probabilities, which this reader never
    # gives; its wide reads are right and wrong, so each curve is refitted on votes that lack them.
    documents = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-documents.json")
    assert "answer_p" in dict(documents.actions["R1"].curve.weights)
    reader = WideReadsErr()
    fitted = fits.calibrate_corpus(_self_test_corpus(), reader, documents, plan=fits.SelfTestPlan(12, 24))
    assert fitted["fitted_on"]["questions"] == 12
    assert 0 < fitted["counts"]["R1"]["correct"] < fitted["counts"]["R1"]["answered"]  # both kinds
    cal = brag.load_calibration(fitted)
    curve = cal.actions["R1"].curve
    numbers = [curve.intercept, *dict(curve.weights).values(), *dict(curve.means).values()]
    assert all(np.isfinite(numbers))
    # A vote without the feature counts at the mean it was fitted with: the documents fit's.
    assert dict(curve.means)["answer_p"] == dict(documents.actions["R1"].curve.means)["answer_p"]
    assert 0 < curve.reliability({"span": 1.0}) < 1


def test_a_self_test_that_keeps_nothing_ends_with_the_base_fit_and_says_why():
    fitted = fits.calibrate_corpus(
        _self_test_corpus(), SelfTestReader(wrong="x"), _pooled_fit(), plan=fits.SelfTestPlan(10, 20)
    )
    assert fitted["fitted_on"]["questions"] == 0 and fitted["fitted_on"]["yield"]["roundtrip"] > 0
    assert fitted["fitted_on"]["checked"].startswith("none of the ")
    cal = brag.load_calibration(fitted)
    assert cal.actions == _pooled_fit().actions and cal.eta == _pooled_fit().eta
    assert brag.calibration_status(cal, "selftest-reader").startswith(
        "self-tested, but none of its questions"
    )


def test_a_self_test_of_few_questions_leans_harder_on_the_fit_it_refines():
    # Questions on which every read is right pull R1's reliability up from the base: the fewer
    # questions, the less (the base's strength in pseudo-questions stays the same).
    base = _pooled_fit()
    moved = {}
    for n in (3, 10, 30):
        fitted = brag.load_calibration(calibrate.self_test_fit(base, _corpus_outcomes(n, 1.0), corpus="c"))
        moved[n] = fitted.actions["R1"].mean - base.actions["R1"].mean
    assert 0 < moved[3] < moved[10] < moved[30]


def test_a_self_test_refines_the_documents_fit_and_keeps_its_found_model():
    documents = _documents_fit()
    fitted = calibrate.self_test_fit(documents, _corpus_outcomes(30, 0.9), corpus="c")
    assert fitted["refit_of"] == brag.DOCUMENTS
    cal = brag.load_calibration(fitted)
    assert cal.found == brag.load_calibration(documents).found
    # Shrunk toward the documents fit: on questions where R1 is right 9 times in 10, R1 moves from
    # the documents fit's value toward 0.9, not from the benchmark fit's.
    before = brag.load_calibration(documents).actions["R1"].mean
    assert before < cal.actions["R1"].mean < 0.9 or before > cal.actions["R1"].mean > 0.9


def _documents_fit(found: dict | None = None) -> dict:
    sets = {"a": _corpus_outcomes(30, 0.5), "b": _corpus_outcomes(30, 0.7)}
    found = found or {"intercept": 2.0, "weights": {"absent_terms": -8.0}, "threshold": 0.5}
    return calibrate.documents_fit(sets, 5, 1, model="m", found=found)


def test_the_documents_fit_is_a_labelled_fit_over_every_set_named_for_documents():
    fitted = _documents_fit()
    cal = brag.load_calibration(fitted)
    assert fitted["corpus"] == brag.DOCUMENTS and fitted["pooled_from"] == ["a", "b"]
    assert fitted["n_questions"] == 60 and {a.label for a in cal.offered()} >= {"R1", "CB"}
    assert brag.calibration_status(cal, "m").startswith(
        "the documents fit for this model (real manuals: a, b)"
    )
    with pytest.raises(brag.InputError, match="at least two"):
        calibrate.documents_fit({"a": _corpus_outcomes(30, 0.5)}, 5, 1, model="m")


def test_an_action_only_some_sets_observed_is_fitted_on_those():
    with_hop = _corpus_outcomes(30, 0.5)
    without = [
        replace(o, answers={k: v for k, v in o.answers.items() if k != "R2"}, hops={}, usage={})
        for o in _corpus_outcomes(30, 0.5)
    ]
    without = [replace(o, correct={k: v for k, v in o.correct.items() if k != "R2"}) for o in without]
    fitted = calibrate.documents_fit({"a": with_hop, "b": without}, 5, 1, model="m")
    alone = calibrate.fit(with_hop, 5, 1)
    assert fitted["actions"]["R2"] == alone["actions"]["R2"]
    assert list(fitted["actions"]) == [a for a in brag.action_labels() if a in fitted["actions"]]
    brag.load_calibration(fitted)


def test_a_found_model_is_fitted_from_runs_and_flags_few_right_answers():
    rng = np.random.default_rng(0)
    rows = []
    for i in range(400):
        answerable = i % 4 != 0
        absent = rng.uniform(0.0, 0.2) if answerable else rng.uniform(0.2, 0.6)
        right = answerable and rng.random() < 0.7
        signals = {"absent_terms": absent, "read_none": float(rng.random() < 0.1), "p_correct": rng.random()}
        rows.append((signals, answerable, right))
    found = brag.load_calibration(_documents_fit(calibrate.fit_found(rows))).found
    assert found is not None and found.weights["absent_terms"] < 0  # absent terms: not found
    flagged_right = np.mean([not found.found(s) for s, a, r in rows if r])
    flagged_unanswerable = np.mean([not found.found(s) for s, a, _ in rows if not a])
    assert flagged_right <= calibrate.FOUND_RIGHT_FLAGGED + 0.01 and flagged_unanswerable > 0.8
    with pytest.raises(brag.InputError, match="cannot"):
        calibrate.fit_found([(s, True, r) for s, _, r in rows])


@pytest.mark.parametrize(
    ("found", "message"),
    [
        ({"intercept": 1.0, "weights": {"shoe_size": 1.0}, "threshold": 0.5}, "not one of"),
        ({"intercept": 1.0, "weights": {"absent_terms": "x"}, "threshold": 0.5}, "must be a number"),
        ({"intercept": 1.0, "weights": {}, "threshold": 2.0}, "outside"),
        ([1, 2], "found must be an object"),
    ],
)
def test_a_bad_found_section_is_a_clear_calibration_error(found, message):
    with pytest.raises(brag.CalibrationError, match=message):
        brag.load_calibration({**_pooled_fit().to_dict(), "found": found})
    with pytest.raises(brag.CalibrationError, match="finite"):
        brag.FoundModel(0.0, {"absent_terms": float("nan")}, 0.5)


def test_a_found_section_survives_every_copy_of_a_calibration():
    found = {
        "intercept": 1.0,
        "weights": {"absent_terms": -3.0},
        "threshold": 0.4,
        "fitted_on": {"questions": 9},
    }
    cal = brag.load_calibration({**_pooled_fit().to_dict(), "found": found})
    assert cal.to_dict()["found"] == found and brag.load_calibration(cal.to_dict()) == cal
    refit = brag.load_calibration(calibrate.self_test_fit(cal, _corpus_outcomes(10, 0.5), corpus="c"))
    assert refit.found == cal.found
    assert brag.load_calibration(calibrate.self_test_fit(cal, [], corpus="c")).found == cal.found


def test_user_labels_are_added_to_the_self_test():
    own = [
        calibrate.Labelled(f"mine-{i}", f"Which variable configures {t}?", (f"{t.upper()}_CONF",))
        for i, t in enumerate(["frobnicate", "quuxify", "blarg"])
    ]
    fitted = fits.calibrate_corpus(
        _self_test_corpus(),
        SelfTestReader(),
        _pooled_fit(),
        plan=fits.SelfTestPlan(10, 20),
        labelled=own,
    )
    assert fitted["fitted_on"]["labelled"] == 3 and fitted["n_questions"] == 13
    assert "and 3 of your own labelled questions" in brag.calibration_status(
        brag.load_calibration(fitted), "selftest-reader"
    )


def test_the_command_line_self_test_fits_a_documents_file_and_keeps_it(tmp_path, monkeypatch, capsys):
    from openai_server import FakeOpenAI, Reply
    from selftest_reader import SENTENCES, replies

    monkeypatch.setenv("BRAG_CACHE_DIR", str(tmp_path / "cache"))
    notes = tmp_path / "tools.md"
    notes.write_text(
        "".join(f"## Part {i}\n\n{text}\n\n" for i, text in enumerate(SENTENCES)), encoding="utf-8"
    )
    handler = lambda request: Reply(texts=replies(request["messages"], int(request.get("n") or 1)))  # noqa: E731
    with FakeOpenAI(handler=handler) as server:
        out = tmp_path / "fit.json"
        args = ["self-test", str(notes), "--model", server.url + "#reader", "--keep", "10", "--out", str(out)]
        assert calibrate_cli.main([*args, "--cache", str(tmp_path / "llm.sqlite")]) == 0
    fitted = brag.load_calibration(out)
    assert fitted.meta["fitted_on"]["kind"] == "self-test" and fitted.meta["fitted_on"]["questions"] == 10
    assert "calibrated on 10 self-test questions" in capsys.readouterr().out
    kept = fits.fit_store(tmp_path / "cache").own(fitted.meta["model"], fitted.meta["corpus"])
    assert kept is not None and kept.to_dict()["actions"] == fitted.to_dict()["actions"]
    # A file that cannot be read is a clear message, not a trace.
    assert calibrate_cli.main(["self-test", str(tmp_path / "missing.pdf"), "--out", str(out)]) == 2
    assert "calibrate self-test:" in capsys.readouterr().err


class SlowActions(SelfTestReader):
    """Writes and checks questions at once; every five-passage read or closed-book call "takes"
    100 s of a fake clock, and each call's start is noted."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock, self.starts = clock, []

    def complete(self, messages, **options):
        self.starts.append(self.clock[0])
        if "\n[2] " in messages[-1]["content"] or messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS:
            self.clock[0] += 100.0
        return super().complete(messages, **options)


def test_a_self_tests_clock_is_read_before_every_action_it_runs(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    reader = SlowActions(clock)
    plan = fits.SelfTestPlan(questions=10, tries=20, seconds=150.0)
    fitted = fits.calibrate_corpus(_self_test_corpus(), reader, _pooled_fit(), plan=plan)
    assert max(reader.starts) <= 150.0  # no call started once the self-test's time was spent
    # It ends with a fit on the questions it ran, and says what ran out.
    done = fitted["fitted_on"]["questions"]
    assert 0 < done < 10 and fitted["fitted_on"]["yield"]["kept"] == 10
    assert (
        f"out of time (150 s allowed) after running the actions on {done} of its 10 questions"
        in (fitted["fitted_on"]["checked"])
    )


def test_a_self_tests_turn_ends_when_the_lane_asks_and_it_keeps_a_fit_on_what_it_ran(monkeypatch):
    # Others wait for the lane once the fake clock passes 250 s: the self-test stops before its
    # next call, with a fit on the questions run so far, and says why.
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    reader = SlowActions(clock)
    plan = fits.SelfTestPlan(questions=10, tries=20, seconds=10_000.0)
    fitted = fits.calibrate_corpus(
        _self_test_corpus(), reader, _pooled_fit(), plan=plan, should_yield=lambda: clock[0] >= 250.0
    )
    assert max(reader.starts) <= 250.0
    done = fitted["fitted_on"]["questions"]
    assert 0 < done < 10
    assert (
        f"its turn ended (others were waiting for the self-test lane) after running the actions on {done} of "
        "its 10 questions" in fitted["fitted_on"]["checked"]
    )


def test_a_self_tests_prompt_characters_are_bounded_writing_and_running_alike():
    reader = SelfTestReader()
    chars: list[int] = []
    counted = type("Counted", (), {"name": "selftest-reader"})()
    counted.complete = lambda messages, **o: (
        chars.append(sum(len(m["content"]) for m in messages)) or (reader.complete(messages, **o))
    )
    plan = fits.SelfTestPlan(questions=10, tries=20, prompt_chars=30_000)
    fitted = fits.calibrate_corpus(_self_test_corpus(), counted, _pooled_fit(), plan=plan)
    assert 0 < sum(chars) <= 30_000
    assert "out of prompt characters (30,000 prompt characters allowed)" in fitted["fitted_on"]["checked"]


# A short German guide in five HTML pages (made-up tools, so no document here is anyone's).
GERMAN_PAGES = [
    (
        "Einleitung",
        [
            "Das Programm frobnicate liest seine Einstellungen beim Start aus der Variablen FROB_CONF.",
            "Quuxify dreht sein Protokoll, sobald es 4096 Einträge enthält, wenn nichts anderes gilt.",
        ],
    ),
    (
        "Speicherorte",
        [
            "Jedes blarg Archiv wird vom nächtlichen Auftrag unter dem Ordner /var/spool/blarg abgelegt.",
            "Fnord speichert die Lesezeichen jedes Benutzers in der Datei ~/.fnordrc, eine pro Zeile.",
        ],
    ),
    (
        "Optionen",
        [
            "Um nur Warnungen auszugeben, versteht zorch auf seiner Befehlszeile die Option --quiet-mode.",
            "Wibble übergeht Dateien, die in der Tabelle stehen, welche die Einstellung WIBBLE_SKIP nennt.",
        ],
    ),
    (
        "Netzwerk",
        [
            "Ein plonk Server beantwortet Gesundheitsprüfungen auf Port 8421, sobald alle Arbeiter laufen.",
            "Der grault Dienst gibt einen hängenden Partner nach 75 Sekunden auf und meldet es im Protokoll.",
        ],
    ),
    (
        "Wartung",
        [
            "Garply schreibt bei jedem Absturz eines Arbeiters einen Bericht in den Ordner GARPLY_DUMP_DIR.",
            "Der waldo Planer startet höchstens 12 Aufträge gleichzeitig und stellt alle weiteren hinten an.",
        ],
    ),
]


def test_a_small_german_documents_self_test_ends_with_a_fit():
    from bragkit import documents

    passages = []
    for i, (heading, sentences) in enumerate(GERMAN_PAGES):
        body = "".join(f"<p>{s}</p>" for s in sentences)
        head = f'<html lang="de"><head><title>{heading}</title></head>'
        page = f"{head}<body><h1>{heading}</h1>{body}</body></html>"
        passages += documents.read_file(f"seite{i}.html", page.encode())
    corpus = brag.Corpus(passages)
    assert brag.Analyzer.of([p.text for p in passages]).language == "de"
    fitted = fits.calibrate_corpus(corpus, SelfTestReader(), _pooled_fit())  # it wants 30 questions
    kept = fitted["fitted_on"]["yield"]["kept"]
    assert fitted["fitted_on"]["kind"] == "self-test" and fitted["fitted_on"]["language"] == "de"
    assert 0 < kept < 30 and fitted["fitted_on"]["questions"] == kept
    assert fitted["fitted_on"]["checked"].startswith(f"{kept} of the 30 questions wanted passed the checks")
    status = brag.calibration_status(brag.load_calibration(fitted), "selftest-reader")
    assert status == f"calibrated on {kept} self-test questions from your documents"


# ------------------------------------------------------------------------------------------
# Evidence curves and the dependence of reads of the same passage
# ------------------------------------------------------------------------------------------


def _planted_votes(n: int, intercept: float, weights: dict, seed: int = 0) -> list:
    """Votes whose features are drawn at random and whose right/wrong flag follows a planted curve."""
    rng = np.random.default_rng(seed)
    votes = []
    for _ in range(n):
        features = {"answer_p": float(rng.uniform()), "span": float(rng.integers(0, 2))}
        score = intercept + sum(w * features[f] for f, w in weights.items())
        votes.append((features, float(rng.uniform() < 1 / (1 + np.exp(-score)))))
    return votes


def test_a_curve_is_recovered_from_planted_outcomes():
    planted = {"answer_p": 3.0, "span": 1.5}
    fitted = calibrate.fit_evidence_curve(_planted_votes(4000, -2.0, planted))
    curve = (
        brag.load_calibration(
            {
                "version": 1,
                "eta": 0.1,
                "actions": {"R1": {"q": 0.9, "rho": {"a": 6, "b": 4}, "curve": fitted}},
            }
        )
        .actions["R1"]
        .curve
    )
    assert dict(curve.weights) == pytest.approx(planted, abs=0.35)
    assert curve.intercept == pytest.approx(-2.0, abs=0.3)
    assert 0.7 < curve.auc < 0.85  # the held-out AUROC of a curve this steep, not an in-sample one
    assert sum(share for share, _ in curve.spread) == pytest.approx(1.0)


def test_a_refit_keeps_the_pooled_curve_on_noise_and_moves_toward_a_planted_one():
    base = brag.EvidenceCurve(
        (("answer_p", 3.0), ("span", 1.5)), -2.0, (("answer_p", 0.5), ("span", 0.5)), ((1.0, 0.0),), 0.8
    )
    rng = np.random.default_rng(1)
    noise = [(v, float(rng.uniform() < 0.5)) for v, _ in _planted_votes(40, 0.0, {}, seed=2)]
    assert calibrate.refit_curve(base, noise, calibrate.CURVE_STRENGTH) == base
    steeper = _planted_votes(600, -4.0, {"answer_p": 8.0, "span": 1.5}, seed=3)
    moved = calibrate.refit_curve(base, steeper, calibrate.CURVE_STRENGTH)
    assert moved != base and 3.0 < dict(moved.weights)["answer_p"] <= 8.5


def test_a_refit_picks_up_a_feature_its_base_never_looked_at_and_says_where_one_is_missing(monkeypatch):
    # A feature added to the one list (brag.EVIDENCE): the answer's length in words.
    words_of = lambda read: float(len(read.answer.split())) if read.answer else None  # noqa: E731
    feature = brag.EvidenceFeature("planted_words", words_of)
    documents = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-documents.json")
    before = documents.unweighed_features()
    monkeypatch.setattr(brag, "EVIDENCE", (*brag.EVIDENCE, feature))
    assert documents.unweighed_features() == (*before, "planted_words")  # no shipped fit ever saw it
    base = documents.actions["R1"].curve
    rng = np.random.default_rng(4)
    votes = []
    for _ in range(300):  # planted: short answers are right, long ones wrong
        evidence = {**dict(base.means), "planted_words": float(rng.integers(1, 6))}
        votes.append((evidence, float(rng.uniform() < (0.9 if evidence["planted_words"] <= 2 else 0.1))))
    moved = calibrate.refit_curve(base, votes, calibrate.CURVE_STRENGTH)
    assert dict(moved.weights)["planted_words"] < -0.5 and "planted_words" in moved.features
    assert set(dict(base.weights)) < set(dict(moved.weights))  # the base's features, and the new one
    # Every read computes it, and a report under a calibration that never weighed it says so.
    llm = ScriptedLLM(lambda prompt: "Answer: Lina Berg\nFollow-up query: Lina Berg")
    report = BRAG(llm, calibration=documents, lam=0.0).ask("Who designed it?", CORPUS, actions=["R1"])
    assert report.steps[0].observation.evidence["planted_words"] == 2.0
    assert report.config["calibration"]["unweighed_features"] == [*before, "planted_words"]


def test_a_fit_on_votes_recorded_before_a_feature_does_not_claim_to_have_looked_at_it(monkeypatch):
    votes = _planted_votes(400, -2.0, {"answer_p": 3.0, "span": 1.5})  # recorded with two features
    feature = brag.EvidenceFeature("planted_words", lambda read: None)
    monkeypatch.setattr(brag, "EVIDENCE", (*brag.EVIDENCE, feature))
    fitted = calibrate.fit_evidence_curve(votes)
    assert fitted["features"] == ["answer_p", "span"]
    calibration = brag.load_calibration(
        {"version": 1, "eta": 0.1, "actions": {"R1": {"q": 0.9, "rho": {"a": 6, "b": 4}, "curve": fitted}}}
    )
    assert "planted_words" in calibration.unweighed_features()


def test_no_curve_without_both_right_and_wrong_votes_or_enough_of_them():
    votes = _planted_votes(100, 0.0, {"answer_p": 1.0})
    assert calibrate.fit_evidence_curve([(v, 1.0) for v, _ in votes]) is None
    assert calibrate.fit_evidence_curve(votes[: calibrate.MIN_CURVE_VOTES - 1]) is None


def _pair_outcome(i: int, rt_right: bool, repeats: bool) -> calibrate.Outcome:
    rt = "Right" if rt_right else f"Wrong {i}"
    r1 = rt if repeats else f"Other {i}"
    return calibrate.Outcome(
        f"q{i}", {"R1": r1, "RT": rt}, {"R1": r1 == "Right", "RT": rt_right}, evidence={"R1": {}, "RT": {}}
    )


def test_reads_of_the_same_passage_are_fitted_as_dependent_witnesses():
    # R1 repeats RT's answer on 16 of 20 right ones and on 8 of 20 wrong ones: L = 2.
    outcomes = [_pair_outcome(i, True, i < 16) for i in range(20)]
    outcomes += [_pair_outcome(20 + i, False, i < 8) for i in range(20)]
    same = calibrate.fit_repeats(outcomes, "R1", eta=0.1)
    ratio = ((16 + 1) / (20 + 2)) / ((8 + 1) / (20 + 2))
    assert same["pi"] == pytest.approx(24 / 40)
    rho = same["rho"]["a"] / (same["rho"]["a"] + same["rho"]["b"])
    assert rho / ((1 - rho) * 0.1) == pytest.approx(ratio, rel=1e-4)
    assert calibrate.fit_repeats(outcomes[:3], "R1", eta=0.1) is None  # too few pairs to tell


def test_the_levels_variant_is_the_fit_before_curves():
    outcomes = [_pair_outcome(i, i % 3 != 0, i % 2 == 0) for i in range(40)]
    for o in outcomes:
        o.evidence = {
            a: {"answer_p": 0.9 if o.correct[a] else 0.3, "span": 1.0, "margin": 0.5} for a in o.answers
        }
    levels = calibrate.fit(outcomes, 5, 1, evidence="levels")["actions"]
    curve = calibrate.fit(outcomes, 5, 1, evidence="curve")["actions"]
    assert "evidence" in levels["R1"] and "curve" not in levels["R1"] and "same" not in levels["R1"]
    assert set(levels["R1"]["evidence"]["weights"]) <= set(calibrate.LEVEL_FEATURES)
    assert "curve" in curve["R1"] and "evidence" not in curve["R1"] and "same" in curve["R1"]
    with pytest.raises(brag.InputError, match="evidence"):
        calibrate.fit(outcomes, 5, 1, evidence="both")


# ------------------------------------------------------------------------------------------
# Readers: the documents fit across readers, and each reader's own terms
# ------------------------------------------------------------------------------------------


def _reader_outcomes(
    n: int, skill: float, seed: int = 0, logprobs: bool = True, prefix: str = "q"
) -> list[calibrate.Outcome]:
    """R1, CB and RT on n questions by a reader whose reads are right with sigmoid(skill + 6 (p - 0.5))."""
    rng = np.random.default_rng(seed)
    found = []
    for i in range(n):
        answer_p = float(rng.uniform(0.0, 1.0))
        answers, correct, evidence = {}, {}, {}
        for label in ("R1", "RT"):
            right = bool(rng.random() < 1 / (1 + np.exp(-(skill + 6 * (answer_p - 0.5)))))
            answers[label], correct[label] = ("gold" if right else f"wrong{i}{label}"), right
            evidence[label] = {
                "answer_p": answer_p if logprobs else None,
                "answer_p_min": (answer_p / 2) if logprobs else None,
                "span": float(rng.random() < 0.8),
                "in_question": 0.0,
                "question_share": float(rng.uniform(0, 0.3)),
                "margin": float(rng.uniform(0, 1)),
                "top_coverage": float(rng.uniform(0.5, 1)),
            }
        cb_right = bool(rng.random() < 0.1)
        found.append(
            calibrate.Outcome(
                id=f"{prefix}{i}",
                answers={**answers, "CB": "gold" if cb_right else f"cb{i}"},
                correct={**correct, "CB": cb_right},
                agreement={"CB": int(rng.integers(1, 6))},
                evidence=evidence,
                usage={
                    label: [
                        {"prompt_tokens": 100, "completion_tokens": 5, "llm_calls": 1, "llm_seconds": 1.0}
                    ]
                    for label in ("R1", "RT", "CB")
                },
            )
        )
    return found


def _two_readers() -> dict[str, dict[str, list[calibrate.Outcome]]]:
    return {
        "strong": {"a": _reader_outcomes(80, 1.5, 1), "b": _reader_outcomes(80, 1.5, 2)},
        "weak": {"a": _reader_outcomes(80, -1.5, 3), "b": _reader_outcomes(80, -1.5, 4)},
    }


def test_a_fit_across_readers_shares_its_curves_and_gives_each_reader_its_own_level():
    fitted = calibrate.cross_reader_fit(_two_readers(), 5, 1)
    common = brag.load_calibration(fitted)
    assert common.across_readers and fitted[brag.ACROSS_READERS] == ["strong", "weak"]
    assert set(fitted["pooled_from"]) == {"strong/a", "strong/b", "weak/a", "weak/b"}
    assert set(common.actions) == {"R1", "CB", "RT"}
    strong, weak = common.readers["strong"]["RT"], common.readers["weak"]["RT"]
    assert strong.offset > 0.5 > -0.5 > weak.offset  # the planted levels, either side of the common fit
    # Made for each reader, the same evidence is trusted as that reader's reads were right.
    evidence = {"answer_p": 0.5, "answer_p_min": 0.25, "span": 1.0, "in_question": 0.0}
    rho = {r: common.for_reader(r).actions["RT"].curve.reliability(evidence) for r in ("strong", "weak")}
    unknown = common.for_reader("a new model").actions["RT"].curve.reliability(evidence)
    assert rho["weak"] < unknown < rho["strong"]
    assert (
        abs(rho["strong"] - 1 / (1 + np.exp(-1.5))) < 0.12 and abs(rho["weak"] - 1 / (1 + np.exp(1.5))) < 0.12
    )
    # Only the level and the slope are a reader's: its curve weighs the features as the common one does.
    weights = dict(common.actions["RT"].curve.weights)
    own = dict(common.for_reader("weak").actions["RT"].curve.weights)
    ratios = {f: own[f] / weights[f] for f in weights if abs(weights[f]) > 1e-3}
    assert max(ratios.values()) - min(ratios.values()) < 1e-3
    with pytest.raises(brag.InputError, match="two readers"):
        calibrate.cross_reader_fit({"strong": _two_readers()["strong"]}, 5, 1)


def test_reader_terms_are_pulled_toward_the_common_fit_by_their_strength():
    common = brag.load_calibration(calibrate.cross_reader_fit(_two_readers(), 5, 1))
    few = _reader_outcomes(12, -3.0, 7)
    loose = calibrate.fit_reader_terms(common, few, strength=0.5)["RT"]
    firm = calibrate.fit_reader_terms(common, few, strength=1e4)["RT"]
    assert loose.offset < -1.0
    assert abs(firm.offset) < 0.01 and abs(firm.scale - 1) < 0.01
    # Votes that are all right or all wrong still give a finite term.
    all_right = [replace(o, correct={k: True for k in o.correct}) for o in few]
    assert calibrate.fit_reader_terms(common, all_right)["RT"].offset > 0


def test_a_self_test_moves_an_unknown_readers_terms_alone_and_lacks_no_log_probabilities():
    common = brag.load_calibration(calibrate.cross_reader_fit(_two_readers(), 5, 1))
    base = common.for_reader("http://127.0.0.1:9/v1#new")
    assert brag.calibration_status(base, "http://127.0.0.1:9/v1#new").startswith("fitted for other readers")
    # A reader worse than both, on a backend with no log-probabilities.
    self_test = _reader_outcomes(40, -3.0, 11, logprobs=False, prefix="self-")
    fitted = calibrate.self_test_fit(base, self_test, corpus="c", hops=1, adapt="terms")
    adapted = brag.load_calibration(fitted)
    assert fitted["fitted_on"]["adapted"] == "reader terms"
    evidence = {"answer_p": None, "answer_p_min": None, "span": 1.0, "in_question": 0.0}
    before = base.actions["RT"].curve.reliability(evidence)
    after = adapted.actions["RT"].curve.reliability(evidence)
    assert np.isfinite(after) and after < before
    assert dict(adapted.actions["RT"].curve.means) == dict(base.actions["RT"].curve.means)
    assert adapted.found == base.found and adapted.eta == base.eta
    # Its costs are the ones it measured; the default, a refit, refits every value instead.
    assert adapted.costs["RT"].prompt_tokens == 100
    refitted = calibrate.self_test_fit(base, self_test, corpus="c", hops=1)
    assert "adapted" not in refitted["fitted_on"]
    assert brag.load_calibration(refitted).actions["RT"].mean < base.actions["RT"].mean
    # A fit for one reader is refitted as before, whatever ``adapt`` says.
    single = calibrate.self_test_fit(
        _pooled_fit(), _corpus_outcomes(30, 0.5), corpus="c", hops=1, adapt="terms"
    )
    assert "adapted" not in single["fitted_on"]


def test_a_read_repeats_only_the_reads_that_hold_the_passage_its_answer_rests_on():
    # RN reads the second passage alone: its answer rests on a passage RT never held, so RN saying
    # RT's answer again is no repeat of one passage, while R1 (all five) holds it.
    rows = tuple(brag.action_named(a) for a in ("R1", "RT", "RN"))
    outcomes = []
    for i in range(40):
        right = i < 20
        answer = "Right" if right else f"Wrong {i}"
        answers = {"R1": answer, "RT": answer, "RN": answer if i % 2 else f"Other {i}"}
        correct = {a: text == "Right" for a, text in answers.items()}
        evidence = {a: {"span": 1.0} for a in answers}
        outcomes.append(calibrate.Outcome(f"q{i}", answers, correct, evidence=evidence))
    with_r1 = calibrate.fit_repeats(outcomes, "RN", eta=0.1, observed=rows)
    without_r1 = calibrate.fit_repeats(outcomes, "RN", eta=0.1, observed=rows[1:])
    assert with_r1 is not None and with_r1["pi"] == pytest.approx(0.5)  # pairs with R1 alone
    assert without_r1 is None  # RT holds no passage RN's answers rest on: no pair at all
    # RT's answers rest on the first passage, which R1 holds too.
    assert calibrate.fit_repeats(outcomes, "RT", eta=0.1, observed=rows) is not None
