"""The benchmark harness: a tiny run, then its replay with no LLM reproduces every number."""

from __future__ import annotations

import json
import sys

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


def reply(request):
    content = request["messages"][-1]["content"].rsplit("\n\nPassages:\n", 1)[-1]
    if "Passages:" in request["messages"][-1]["content"]:
        for word in ("Bergen", "Oslo", "Lina Berg"):
            if word in content.split("Question:")[0]:
                return Reply(texts=[f"Answer: {word}\nFollow-up query: {word}"])
        return Reply(texts=["Answer: NONE"])
    return Reply(texts=["Oslo"] * request.get("n", 1))


def test_replay_reproduces_the_tables_exactly(tmp_path):
    data = tmp_path / "data" / "hotpotqa"
    data.mkdir(parents=True)
    padded = QUESTIONS * 21  # the test split starts after the 60 calibration questions
    (data / "hotpotqa_ircot500.json").write_text(
        json.dumps([dict(q, id=f"{q['id']}-{i}") for i, q in enumerate(padded)])
    )
    corpus = [{"title": p["title"], "text": p["text"]} for q in QUESTIONS for p in q["paragraphs"]]
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
        made = len(server.chat_requests)
    assert made > 0
    # The server is gone: every number must come from the cache.
    assert bench_run.main(["--model", model, "--out", str(replay_out), "--replay", *common]) == 0
    live = json.loads((live_out / "benchmark.json").read_text())
    assert json.loads((replay_out / "benchmark.json").read_text()) == live
    assert (live_out / "benchmark_hotpotqa.md").read_text() == (
        replay_out / "benchmark_hotpotqa.md"
    ).read_text()
    rows = live[0]["rows"]
    assert set(rows) >= {"Closed-book", "Vanilla RAG", "IRCoT / self-ask", "Adaptive / CRAG", "BRAG λ=0.05"}
    assert rows["Closed-book"][0][2] == 1  # one call
    assert (replay_out / "benchmark.png").stat().st_size > 1000
