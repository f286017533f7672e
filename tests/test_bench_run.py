"""The benchmark harness: a tiny run, then its replay with no LLM reproduces every number."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zlib

import pytest
from conftest import ROOT
from openai_server import FakeOpenAI, Reply

sys.path.insert(0, str(ROOT / "bench"))

import run as bench_run

QUESTIONS = [
    {
        "id": f"q{i}",
        "question": q,
        "answer": [a],
        "paragraphs": [{"title": t, "text": x, "is_supporting": True}],
    }
    for i, (q, a, t, x) in enumerate(
        [
            ("Where was Lina Berg born?", "Bergen", "Lina Berg", "Lina Berg was born in Bergen."),
            ("What is the capital of Norway?", "Oslo", "Oslo", "Oslo is the capital of Norway."),
            (
                "Who designed the Glass Tower?",
                "Lina Berg",
                "Glass Tower",
                "The Glass Tower was designed by Lina Berg.",
            ),
        ]
    )
]


# Test questions the calibration split does not hold: the live run must ask the LLM about them.
FRESH = [
    (
        "Which river flows through Trondheim?",
        "Nidelva",
        "Nidelva",
        "The Nidelva is the river that flows through Trondheim.",
    ),
    ("Who wrote The Silent Orchard?", "Kari Holm", "Silent Orchard", "The Silent Orchard is by Kari Holm."),
    ("Which fjord is near Bergen?", "Sognefjord", "Sognefjord", "The Sognefjord lies north of Bergen."),
]
GOLD = {q["question"]: q["answer"][0] for q in QUESTIONS} | {q: a for q, a, _, _ in FRESH}
DELAY = 0.02  # seconds per LLM call at least, so the replay's zero-wait time would differ


def asked(request) -> str:
    prompt = request["messages"][-1]["content"]
    return next(q for q in GOLD if q in prompt)


def reply(request):
    """Replies that differ by prompt (and their latency too) and by sample.

    Closed-book samples tie the gold answer with a wrong one, gold first: the vote breaks a tie
    by the answer seen first, so a replay that returned the samples in another order would
    change the answers.
    """
    prompt = request["messages"][-1]["content"]
    delay = DELAY + 0.005 * (zlib.crc32(prompt.encode()) % 4)
    if "Passages:" in prompt:
        passages = prompt.rsplit("\n\nPassages:\n", 1)[-1].split("Question:")[0]
        question_words = set(asked(request).rstrip("?").split())
        for passage in passages.splitlines():  # best first: the first passage holding an answer
            for word in ("Bergen", "Oslo", "Lina Berg", "Nidelva", "Kari Holm", "Sognefjord"):
                if word in passage and word not in question_words:
                    return Reply(texts=[f"Answer: {word}\nFollow-up query: {word}"], delay=delay)
        return Reply(texts=["Answer: NONE"], delay=delay)
    gold = GOLD[asked(request)]
    samples = [gold, "Stavanger", gold, "Stavanger", "Paris"]
    return Reply(texts=samples[: request.get("n", 1)], delay=delay)


def test_replay_reproduces_the_tables_exactly(tmp_path):
    data = tmp_path / "data" / "hotpotqa"
    data.mkdir(parents=True)
    calibration = [dict(q, id=f"{q['id']}-{i}") for i, q in enumerate(QUESTIONS * 20)]  # 60
    fresh = [
        {
            "id": f"t{i}",
            "question": q,
            "answer": [a],
            "paragraphs": [{"title": t, "text": x, "is_supporting": True}],
        }
        for i, (q, a, t, x) in enumerate(FRESH)
    ]
    (data / "hotpotqa_ircot500.json").write_text(json.dumps(calibration + fresh))
    corpus = [{"title": p["title"], "text": p["text"]} for q in QUESTIONS + fresh for p in q["paragraphs"]]
    corpus += [{"title": f"Filler {i}", "text": f"Filler text {i} about rivers."} for i in range(10)]
    (data / "hotpotqa_ircot500_corpus.json").write_text(json.dumps(corpus))
    common = [
        "--datasets",
        "hotpotqa",
        "--n",
        "3",
        "--data",
        str(tmp_path / "data"),
        "--cache",
        str(tmp_path / "c.sqlite"),
    ]
    live_out, replay_out = tmp_path / "live", tmp_path / "replay"
    live_out.mkdir()
    replay_out.mkdir()
    with FakeOpenAI(handler=reply) as server:
        model = server.url + "#m"
        assert bench_run.main(["--model", model, "--out", str(live_out), *common]) == 0
        reached = {asked(r) for r in server.chat_requests}
    assert reached >= {q for q, *_ in FRESH}  # every test question reached the LLM
    # The server is gone: every number must come from the cache.
    assert bench_run.main(["--model", model, "--out", str(replay_out), "--replay", *common]) == 0
    live = json.loads((live_out / "benchmark.json").read_text())
    assert json.loads((replay_out / "benchmark.json").read_text()) == live
    for name in ("benchmark_hotpotqa.md", "benchmark.md"):
        assert (replay_out / name).read_text() == (live_out / name).read_text(), name
    rows = live[0]["rows"]
    # The ties: closed-book answers right only when the samples come back in the order given.
    assert [row[0] for row in rows["Closed-book"]] == [1, 1, 1]
    assert [row[0] for row in rows["Vanilla RAG"]] == [1, 1, 1]  # the reader finds them in passages
    # The replay reports the latencies the live run stored (compared above), not its own.
    assert all(row[4] > 0 for row in rows["Closed-book"])
    # Several questions at once, against the endpoint, into a cache of its own: the same results
    # (but for the latencies measured), and its replay gives its tables byte for byte.
    parallel_out, parallel_replay = tmp_path / "parallel", tmp_path / "parallel-replay"
    parallel_out.mkdir()
    parallel_replay.mkdir()
    parallel = [*common[:-1], str(tmp_path / "p.sqlite"), "--workers", "4"]
    with FakeOpenAI(handler=reply) as server:
        other = server.url + "#m"
        assert bench_run.main(["--model", other, "--out", str(parallel_out), *parallel]) == 0
    assert bench_run.main(["--model", other, "--out", str(parallel_replay), "--replay", *parallel]) == 0
    together = json.loads((parallel_out / "benchmark.json").read_text())

    def without_latency(result: list) -> dict:
        return {m: [row[:4] for row in rows] for m, rows in result[0]["rows"].items()}

    assert without_latency(together) == without_latency(live)
    for name in ("benchmark_hotpotqa.md", "benchmark.md"):
        assert (parallel_replay / name).read_text() == (parallel_out / name).read_text(), name
    assert set(rows) >= {*bench_run.BASELINES, "BRAG λ=0.05"}
    assert live[0]["best_fixed"]["method"] in bench_run.FIXED
    assert rows["Closed-book"][0][2] == 1  # one call
    # Each supporting passage shares the question's words, so every R1 window holds it.
    hops = live[0]["hops"]
    assert (hops["questions"], hops["labelled"], hops["r1_missing"]) == (3, 3, 0)
    summary = (replay_out / "benchmark.md").read_text()
    assert "the R1 window missed one for 0" in summary
    assert "LLM s / question" in summary and "Default λ=0.05" in summary
    assert "Target met" in summary or "Target not met" in summary
    assert "Controller time / LLM time" in (replay_out / "benchmark_timing.md").read_text()
    assert (replay_out / "benchmark.png").stat().st_size > 1000
    # A partial run replays on its own: the first two test questions, from the same cache.
    part_out = tmp_path / "part"
    part_out.mkdir()
    part = [*common[:3], "hotpotqa=2", *common[4:]]
    assert bench_run.main(["--model", model, "--out", str(part_out), "--replay", *part]) == 0
    assert json.loads((part_out / "benchmark.json").read_text())[0]["ids"] == live[0]["ids"][:2]
    assert "--n hotpotqa=2" in (part_out / "benchmark.md").read_text()


def test_split_sizes_are_set_for_all_datasets_or_one():
    assert bench_run.split_sizes([]) == {}
    assert bench_run.split_sizes(["100", "musique=80"]) == {"hotpotqa": 100, "2wiki": 100, "musique": 80}
    for bad in ("musique=0", "trivia=5", "many", "2wiki=-3"):
        with pytest.raises(ValueError, match=re.escape(bad)):
            bench_run.split_sizes([bad])


def synthetic(
    brag_rows, baseline_acc=(0.2, 0.5, 0.6, 0.6, 0.55, 0.6), baseline_calls=(1, 1, 2, 1.5, 1.8, 1.5)
):
    """Ten questions; each method's rows give (EM, F1, calls, tokens, seconds) per question."""

    def rows(acc, calls):
        hits = round(acc * 10)
        return [(float(i < hits), 0.0, calls, 100, 1.0) for i in range(10)]

    result = {
        b: rows(a, c) for b, a, c in zip(bench_run.BASELINES, baseline_acc, baseline_calls, strict=True)
    }
    for lam in bench_run.LAMBDAS:
        result[f"BRAG λ={lam}"] = rows(*brag_rows.get(lam, (0.1, 1)))
    return {"rows": result}


def test_verdict_names_where_the_curve_is_above_the_best_baseline():
    # Best baseline: Adaptive (0.6 at 1.5 calls; IRCoT reaches 0.6 only with 2).
    fewer_calls = synthetic({0.05: (0.6, 1.2)})
    assert bench_run.verdict(fewer_calls).startswith("Target met: BRAG at λ=0.05 is at or above Adaptive")
    more_accurate = synthetic({0.02: (0.7, 1.5)})
    assert bench_run.verdict(more_accurate).startswith("Target met: BRAG at λ=0.02")
    equal_calls_equal_acc = synthetic({0.01: (0.6, 1.5), 0.02: (0.5, 1.0)})
    assert bench_run.verdict(equal_calls_equal_acc).startswith("Target met: BRAG at λ=0.01 is at or above")
    below = synthetic({0.01: (0.6, 1.6), 0.02: (0.5, 1.0)})
    text = bench_run.verdict(below)
    assert text.startswith("Target not met") and "0.600 at 1.60 calls (λ=0.01)" in text
    assert "(λ=0.01), more calls than Adaptive" in text
    lower = bench_run.verdict(synthetic({0.01: (0.5, 1.0)}))
    assert "0.500 at 1.00 calls (λ=0.01), lower accuracy than Adaptive" in lower
    # The default lambda far below the best baseline (0.1 against 0.6 on ten questions).
    assert "Default λ=0.05 not met" in text
    close = synthetic({0.05: (0.5, 1.0)})  # one question of ten behind: not significant
    assert "Default λ=0.05 met" in bench_run.verdict(close)
    nobody = synthetic({}, baseline_acc=(0, 0, 0, 0, 0, 0))
    assert bench_run.verdict(nobody).startswith("Not comparable")


@pytest.mark.parametrize("script", sorted((ROOT / "bench").glob("*.py")), ids=lambda path: path.name)
def test_every_bench_script_starts_and_answers_help(script):
    # Each imports what it uses and builds its command line: a script broken by a change elsewhere
    # (a renamed function, a moved module) fails here, not the next time someone runs it.
    done = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2_000:]
