"""The app launched for real (``python app.py`` on a free loopback port), its LLM being the tests'
loopback OpenAI-compatible server: gradio_client, REST, concurrency, bad input, the Hub path and
a real browser."""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import selftest_reader
from app_server import AppProcess, call_asgi, rest_call, rest_events, upload_many, upload_over_rest
from conftest import PRIORS, ROOT
from document_files import html_page, pdf_bytes, raw_pdf, zip_bytes
from gradio_client import Client
from gradio_client.exceptions import AppError
from hub_server import FakeHub
from openai_server import FakeOpenAI, Reply

import brag
import bragkit.serving.corpora
import bragkit.serving.guards
import bragkit.serving.limits
import bragkit.serving.models
import bragkit.serving.presentation
import bragkit.serving.server
from bragkit import llms

QUESTION = "Where was the architect of the Glass Tower born?"
DOC_LINES = "\n".join(
    [
        "The Glass Tower in Oslo was designed by the architect Lina Berg.",
        "Lina Berg is a Norwegian architect, born in Bergen in 1961.",
        "Oslo is the capital of Norway.",
        "The fjord is long and narrow.",
    ]
)
DOC_JSON = json.dumps(
    [
        {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
        {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect, born in Bergen in 1961."},
        {"title": "Oslo", "text": "Oslo is the capital of Norway."},
    ]
)


# A question no document here answers: every read says NONE, and only closed-book names a city.
NOT_ANSWERED = "Who designed the Sydney Opera House?"


def scripted(request: dict) -> Reply:
    """Reads answer Bergen when the Lina Berg passage is in the prompt; CB samples disagree."""
    content = request["messages"][-1]["content"].rsplit("\n\nPassages:\n", 1)[-1]
    if "Passages:" in request["messages"][-1]["content"]:
        if "born in Bergen" in content and "Sydney Opera House" not in content:
            return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg birthplace"])
        return Reply(texts=["Answer: NONE\nFollow-up query: Lina Berg"])
    return Reply(texts=["Oslo", "Rome", "NONE", "Paris", "Lima"][: request.get("n", 1)])


# The hand-set priors, so expectations do not move when the shipped calibration is refitted.
PRIOR_JSON = PRIORS.read_text()


def args(
    question=QUESTION,
    corpus="",
    documents=DOC_LINES,
    lam=0.05,
    model="",
    token="",
    provider="auto",
    cal=PRIOR_JSON,
):
    return [question, corpus, documents, lam, model, token, provider, cal]


@pytest.fixture(scope="module")
def llm_server():
    with FakeOpenAI(handler=scripted) as server:
        yield server


@pytest.fixture(scope="module")
def app(llm_server):
    # "*": a local deployment, so the tests' loopback endpoints may be named by callers.
    env = {"BRAG_MODEL": llm_server.url + "#scripted", "HF_TOKEN": "", "BRAG_ALLOWED_ENDPOINTS": "*"}
    with AppProcess(env) as process:
        yield process


@pytest.fixture(scope="module")
def client(app):
    return Client(app.url, verbose=False)


@pytest.mark.parametrize("documents", [DOC_LINES, DOC_JSON], ids=["lines", "json"])
def test_client_predict_returns_the_answer_and_a_matching_report(client, llm_server, documents):
    before = len(llm_server.chat_requests)
    answer, report = client.predict(*args(documents=documents), api_name="/brag")
    made = len(llm_server.chat_requests) - before
    assert answer == "Bergen"
    assert report["answer"] == "Bergen" and report["server"]["corpus"] == "your documents"
    assert report["totals"]["llm_calls"] == made >= 1
    assert all(key in report["steps"][0] for key in ("posterior", "rates", "action", "policy_us"))
    assert_reads_carry_their_evidence(report)


def assert_reads_carry_their_evidence(report: dict) -> None:
    """Each read says what its vote rested on: the loopback server sends each token at log-prob -0.1."""
    reads = [s["observation"] for s in report["steps"] if s["action"] in ("R1", "R2")]
    answered = [seen for seen in reads if seen["answer"] == "Bergen"]
    assert answered
    for seen in answered:
        assert seen["evidence"]["answer_p"] == pytest.approx(math.exp(-0.1), abs=1e-3)
        assert seen["evidence"]["span"] > 0 and seen["vote_type"].startswith("R")


def test_a_question_the_documents_cannot_answer_says_so_first_over_gradio_client_and_rest(client, app):
    for answer, report in (
        client.predict(*args(question=NOT_ANSWERED), api_name="/brag"),
        rest_call(app.url, "brag", args(question=NOT_ANSWERED)),
    ):
        # Closed-book's samples all differ, so its first one is its answer: a guess, named as one.
        assert answer == "Not in your documents. A guess, not from them: Oslo", answer
        assert report["answer"] == "Oslo" and report["found_in_documents"] is False
        assert report["confidence"]["guess"] is True and report["confidence"]["summary"].startswith(
            brag.NOT_FOUND
        )
        assert report["confidence"]["found"]["signals"]["read_none"] == 1.0  # every read said NONE
    # A question they answer is not flagged.
    answer, report = client.predict(*args(), api_name="/brag")
    assert answer == "Bergen" and report["found_in_documents"] is True


def test_named_demo_corpus_works_without_download(client):
    answer, report = client.predict(*args(corpus="Demo", documents=""), api_name="/brag")
    assert answer == "Bergen" and report["server"]["corpus"] == "Demo"
    assert any(
        p["title"] == "Lina Berg"
        for s in report["steps"]
        for p in (s.get("observation") or {}).get("passages", [])
    )


def test_rest_call_returns_the_same_answer(app, client):
    expected, _ = client.predict(*args(), api_name="/brag")
    answer, report = rest_call(app.url, "brag", args())
    assert answer == expected == "Bergen"
    assert report["totals"]["llm_calls"] >= 1
    assert_reads_carry_their_evidence(report)


def test_every_step_streams_to_rest_and_gradio_client_as_it_happens(app, client):
    events = rest_events(app.url, "brag", args())
    generating = [json.loads(data) for event, data in events if event == "generating"]
    final_answer, final = json.loads(events[-1][1])
    assert events[-1][0] == "complete" and final_answer == "Bergen" and final["finished"] is True
    acted = [s for s in final["steps"] if s["action"]]
    # One event as each action starts, then the final pair (Gradio sends it twice: generating, complete).
    assert len(generating) == len(acted) + 1 and len(acted) >= 1
    assert generating[-1] == [final_answer, final]
    for number, (_, partial) in enumerate(generating[:-1], 1):
        assert partial["finished"] is False and len(partial["steps"]) == number
        assert partial["steps"][-1]["action"] == acted[number - 1]["action"]
    job = client.submit(*args(), api_name="/brag")
    seen = list(job)  # gradio_client users iterate over the steps
    assert len(seen) == len(acted) + 1 and seen[-1][0] == "Bergen" and seen[-1][1]["finished"]
    assert all(not report["finished"] for _, report in seen[:-1])


def test_the_api_names_its_outputs(client):
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert [r["label"] for r in endpoints["/brag"]["returns"]] == ["answer", "report"]
    assert [p["parameter_name"] for p in endpoints["/brag"]["parameters"]] == [
        "question",
        "corpus",
        "documents",
        "lam",
        "model",
        "hf_token",
        "provider",
        "calibration",
        "cost",
        "price_in",
        "price_out",
        "files",
    ]
    assert [r["label"] for r in endpoints["/calibrate"]["returns"]] == ["calibration"]
    assert [p["parameter_name"] for p in endpoints["/calibrate"]["parameters"]][-2:] == ["files", "self_test"]


def test_pasted_documents_select_your_documents_and_the_result_names_what_was_read(client):
    import app as brag_app

    assert brag_app.use_documents("a passage", "Demo")["value"] == bragkit.serving.corpora.YOUR_DOCUMENTS
    assert (
        brag_app.use_documents("", bragkit.serving.corpora.YOUR_DOCUMENTS)["value"]
        == bragkit.serving.corpora.DEMO
    )
    assert brag_app.use_documents("  ", "MuSiQue")["value"] == "MuSiQue"
    assert (
        brag_app.use_documents(["/tmp/gradio/x/a.pdf"], "Demo")["value"]
        == bragkit.serving.corpora.YOUR_DOCUMENTS
    )
    assert (
        brag_app.use_documents([], bragkit.serving.corpora.YOUR_DOCUMENTS)["value"]
        == bragkit.serving.corpora.DEMO
    )
    answer, report = client.predict(*args(corpus="Your documents"), api_name="/brag")
    assert answer == "Bergen" and report["server"]["corpus"] == "your documents"
    _, headline, *_ = bragkit.serving.presentation.render(answer, report)
    # Untitled passages are named by their first words, not by an index.
    assert "Read: The Glass Tower in Oslo was…" in headline and "#0" not in headline


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"question": "   "}, "question is empty"),
        ({"documents": '["unclosed", '}, "malformed JSON"),
        ({"documents": "", "corpus": "Wikipedia"}, "Unknown corpus: use one of Demo, HotpotQA"),
        ({"documents": "", "corpus": "Your documents"}, "none are given"),
        ({"documents": "", "corpus": ""}, "No corpus"),
        ({"cal": '{"version": 1, "eta": 2}'}, "calibration"),
        ({"cal": "{not json"}, "malformed JSON"),
        ({"model": "not a model id"}, "not a Hugging Face model id"),
        ({"lam": -1}, "Value -1 is less than minimum value 0"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_next_request_works(client, app, overrides, message):
    call = dict(
        zip(
            ["question", "corpus", "documents", "lam", "model", "token", "provider", "cal"],
            args(),
            strict=True,
        )
    )
    call.update(overrides)
    with pytest.raises(AppError, match=message) as err:
        client.predict(*call.values(), api_name="/brag")
    assert "Traceback" not in str(err.value)
    answer, _ = client.predict(*args(), api_name="/brag")
    assert answer == "Bergen" and app.alive()


def test_unreachable_model_is_reported(client):
    with FakeOpenAI() as gone:
        url = gone.url
    with pytest.raises(AppError, match="cannot reach") as err:
        client.predict(*args(model=url + "#m"), api_name="/brag")
    assert "failed: cannot reach" in str(err.value) and "0 LLM calls" in str(err.value)
    assert client.predict(*args(), api_name="/brag")[0] == "Bergen"


def test_rejected_token_and_rate_limit_are_reported_and_the_token_never_echoed(client, app):
    secret = "hf_SECRET_never_echo_me"
    with FakeOpenAI(handler=lambda r: Reply(status=401)) as denied:
        with pytest.raises(AppError, match="token rejected") as err:
            client.predict(*args(model=denied.url + "#m", token=secret), api_name="/brag")
        assert secret not in str(err.value)
        assert (
            denied.headers[0].get("Authorization", denied.headers[0].get("authorization"))
            == f"Bearer {secret}"
        )
    with FakeOpenAI(handler=lambda r: Reply(status=429, headers={"Retry-After": "0"})) as limited:
        with pytest.raises(AppError, match="rate limited"):
            client.predict(*args(model=limited.url + "#m"), api_name="/brag")
    assert secret not in app.log()
    assert client.predict(*args(), api_name="/brag")[0] == "Bergen"


LABELLED = json.dumps([{"question": QUESTION, "gold": ["Bergen"], "id": f"q{i}"} for i in range(30)])


def test_calibrate_round_trips_into_brag(client, llm_server):
    before = len(llm_server.chat_requests)
    fitted = client.predict(LABELLED, "Demo", "", "", "", "auto", api_name="/calibrate")
    cal = json.loads(fitted)
    assert cal["n_questions"] == 30 and cal["fitted"] is True and cal["corpus"] == "Demo"
    assert cal["fitted_on"] == {"kind": "labelled", "questions": 30, "labelled": 30}
    hop_reads = cal["counts"]["R2"]["hops"]["reads"]
    assert hop_reads >= 30  # every question got at least one second hop
    assert len(llm_server.chat_requests) - before == 30 + hop_reads + 30  # R1, the hops, CB: every action
    assert cal["diagnostics"]["R2"]["accuracy"] == 1.0  # the scripted reader is right after hop 2
    answer, report = client.predict(*args(cal=fitted), api_name="/brag")
    assert answer == "Bergen" and report["config"]["calibration"]["source"] == "fitted"
    assert report["server"]["calibration"]["status"] == "fitted for this model on Demo"
    # The fit is kept: a later request reuses it by the name /calibrate gave it.
    assert cal["name"].startswith("fit-")
    answer, by_name = client.predict(*args(cal=cal["name"]), api_name="/brag")
    assert answer == "Bergen" and by_name["server"]["calibration"]["name"] == cal["name"]
    assert by_name["server"]["calibration"]["status"] == report["server"]["calibration"]["status"]


@pytest.mark.parametrize(
    ("labelled", "message"),
    [
        ('[{"question": "q", "gold": ["a"]}]', "at least 30"),
        ("[{", "malformed JSON"),
        ('[{"question": "q", "gold": 5}]', "gold answers are missing"),
        ('[{"text": "q"}]', "'question' is missing"),
        ("Who?", "must be a JSON list"),
    ],
)
def test_calibrate_bad_input_is_a_clear_error(client, labelled, message):
    with pytest.raises(AppError, match=message):
        client.predict(labelled, "Demo", "", "", "", "auto", api_name="/calibrate")


def test_a_self_test_that_keeps_no_question_ends_with_the_fit_it_refines_and_says_why(app):
    # The scripted model writes no question a self-test can use: nothing passes the checks. (A
    # client of its own: the fit is its session's, and the other tests' session keeps the prior.)
    mine = Client(app.url, verbose=False)
    fitted = json.loads(mine.predict("", "Demo", "", "", "", "auto", api_name="/calibrate"))
    assert fitted["fitted_on"]["kind"] == "self-test" and fitted["fitted_on"]["questions"] == 0
    assert fitted["fitted_on"]["checked"].startswith("none of the ")
    assert "the fit it refines is kept as it is" in fitted["fitted_on"]["checked"]
    base = brag.shipped_calibrations()["prior"]  # the scripted model has no fit: the hand-set prior
    assert brag.load_calibration(fitted).actions == base.actions


def test_calibrate_takes_questions_without_gold_and_says_why_it_cannot_fit_them(client, app):
    # Thirty questions and no gold: the scripted reader and closed-book never agree, so nothing
    # tells a right answer from a wrong one.
    questions = [f"Q{i}: where was the architect of the Glass Tower born?" for i in range(30)]
    with pytest.raises(AppError, match="agreed on only 0 of the 30 unlabelled questions"):
        client.predict(json.dumps(questions), "Demo", "", "", "", "auto", api_name="/calibrate")
    # The same over REST, as JSON Lines; and mixed in with labelled ones.
    lines = "\n".join(json.dumps({"question": q, "id": f"u{i}"}) for i, q in enumerate(questions))
    with pytest.raises(RuntimeError, match="agreed on only 0 of the 30 unlabelled questions"):
        rest_call(app.url, "calibrate", [lines, "Demo", "", "", "", "auto"])
    mixed = json.loads(LABELLED)[:20] + questions[:15]
    with pytest.raises(RuntimeError, match="agreed on only 0 of the 15 unlabelled questions"):
        rest_call(app.url, "calibrate", [json.dumps(mixed), "Demo", "", "", "", "auto"])


def test_an_uncalibrated_model_gets_the_prior_and_is_told_so(client):
    _, demo = client.predict(*args(corpus="Demo", documents="", cal=""), api_name="/brag")
    assert (
        demo["server"]["calibration"]["source"] == "prior"
        and demo["server"]["calibration"]["fitted"] is False
    )
    assert "uncalibrated" in demo["server"]["calibration"]["status"]
    assert "run /calibrate for this model" in demo["server"]["calibration"]["status"]
    _, named = client.predict(*args(cal="prior"), api_name="/brag")
    assert named["server"]["calibration"]["name"] == "prior"
    with pytest.raises(AppError, match="the name it gave, or one of the shipped names: prior"):
        client.predict(*args(cal="fit-000000000000"), api_name="/brag")


def test_pasted_corpora_stay_within_the_memory_budget():

    one = (
        bragkit.serving.corpora.CorpusStore(bragkit.serving.limits.Limits())
        .documents(DOC_LINES)
        .memory_bytes()
    )
    store = bragkit.serving.corpora.CorpusStore(
        bragkit.serving.limits.Limits(documents_cache_bytes=int(3.5 * one))
    )
    for i in range(10):
        store.documents(DOC_LINES + f"\nDocument set number {i}.")
        assert store.cached_bytes() <= store.documents_budget
    assert 2 <= len(store._documents) <= 3
    first = store.documents(DOC_LINES + "\nDocument set number 9.")
    assert store.documents(DOC_LINES + "\nDocument set number 9.") is first  # a repeat is a cache hit


def test_allow_list_prefixes_match_whole_hosts_ports_and_path_segments(monkeypatch):

    monkeypatch.setenv("BRAG_ALLOWED_ENDPOINTS", "http://10.0.0.5:8000/v1, https://api.example.com")
    policy = bragkit.serving.models.EndpointPolicy.from_env()
    assert policy.listed("http://10.0.0.5:8000/v1")
    assert policy.listed("http://10.0.0.5:8000/v1/")
    assert policy.listed("https://api.example.com/anything/v1")
    assert policy.listed("https://API.example.com:443/v1")
    for url in (
        "http://10.0.0.5:8001/v1",
        "http://10.0.0.5:8000/v1evil",
        "http://10.0.0.5:8000/",
        "https://10.0.0.5:8000/v1",
        "https://api.example.com.evil.net/v1",
        "https://api.example.com:8443/v1",
        "http://api.example.com/v1",
    ):
        assert not policy.listed(url), url
    monkeypatch.setenv("BRAG_ALLOWED_ENDPOINTS", "*")
    assert bragkit.serving.models.EndpointPolicy.from_env().allow_all


@pytest.mark.parametrize(
    ("env", "value"),
    [("BRAG_REQUEST_TIMEOUT", "soon"), ("BRAG_MAX_QUESTION_CHARS", "-5"), ("BRAG_CONCURRENCY", "0")],
)
def test_a_bad_limit_in_the_environment_stops_the_app_with_a_clear_message(env, value, monkeypatch):

    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit, match=f"{env} must be a positive number"):
        bragkit.serving.server.Settings.from_env()


def fake_report(finished: bool = True) -> dict:
    """A report as BRAG writes it: an R1 read of one untitled passage, then a stop."""
    steps = [
        {
            "step": 1,
            "action": "R1",
            "posterior": {"candidates": [], "residual": 1.0, "p_err": 1.0},
            "scores": {"R1": 0.9, "CB": 0.02},
            "observation": {
                "answer": "Bergen",
                "candidate": 0,
                "evidence": {"answer_p": 0.8312, "answer_p_min": 0.7, "span": 1.0, "in_question": 0.0},
                "vote_type": "R1:hi",
                "follow_up_query": "Lina Berg birthplace",
                "passages": [{"id": 0, "title": "", "label": "The Glass Tower in Oslo…"}],
            },
        },
        {
            "step": 2,
            "action": None if finished else "CB",
            "posterior": {"candidates": [{"answer": "Bergen", "p": 0.8}], "residual": 0.2, "p_err": 0.2},
            "scores": {"CB": 0.004},
        },
    ]
    totals = {
        "llm_calls": 1,
        "prompt_tokens": 90,
        "completion_tokens": 5,
        "tokens_estimated": False,
        "cached_calls": 0,
        "wall_time_s": 1.5,
        "policy_us": 12.0,
    }
    return {
        "steps": steps,
        "finished": finished,
        "p_err": 0.2,
        "stop_reason": "expected gain 0.004 <= lambda 0.05",
        "config": {"lam": 0.05},
        "totals": totals,
        "server": {
            "corpus": "your documents",
            "calibration": {"status": "uncalibrated: a hand-set prior"},
            "elapsed_s": 2.0,
        },
    }


def test_the_steps_table_has_a_column_for_each_action_the_run_offered():
    report = fake_report()
    report["config"] = {**report["config"], "actions": {"offered": ["R1", "R2", "CB", "RT"]}}
    report["steps"][0]["scores"] = {**report["steps"][0]["scores"], "RT": 0.5}
    frame = bragkit.serving.presentation.steps_frame(report)
    assert [c for c in frame.columns if c in brag.action_labels()] == ["R1", "R2", "CB", "RT"]
    assert frame.iloc[0]["RT"] == "0.500 ✓" and frame.iloc[1]["RT"] == "—"
    widths = bragkit.serving.presentation.step_column_widths(list(frame.columns))
    assert len(widths) == len(frame.columns)


def test_the_steps_table_shows_why_each_action_was_chosen():

    frame = bragkit.serving.presentation.steps_frame(fake_report())
    assert list(frame.columns) == bragkit.serving.presentation.STEP_COLUMNS
    assert "RT" not in frame.columns  # an action no calibration offered gets no column
    first, last = frame.iloc[0], frame.iloc[1]
    assert (first["R1"], first["R2"], first["CB"]) == ("0.900 ✓", "—", "0.020")  # λ = 0.05
    assert first["What it read"] == "The Glass Tower in Oslo…" and first["Answer"] == "Bergen"
    assert first["Follow-up query"] == "Lina Berg birthplace"
    assert first["Evidence"] == "answer p 0.83 · span of passage 1 · level R1:hi"
    assert last["Action"] == "stop" and last["What it read"].startswith("expected gain")
    assert last["Evidence"] == ""
    running = bragkit.serving.presentation.steps_frame(fake_report(finished=False)).iloc[1]
    assert running["Action"] == "CB" and running["Answer"] == "running…"


def test_progress_and_headline_while_running_and_when_done():

    progress, headline, _, table, totals = bragkit.serving.presentation.render(
        "Bergen", fake_report(finished=False)
    )
    assert progress.startswith("**Running · step 2 · CB: closed-book samples…**")
    assert "1 LLM call so far · 2.0 s" in progress
    assert headline == "### Best so far: Bergen" and totals == "" and table["visible"] is True
    progress, headline, *_ = bragkit.serving.presentation.render("Bergen", fake_report())
    assert progress == "✔ Done: 1 LLM call in 2.0 s."
    assert "## Bergen" in headline and "Read: The Glass Tower in Oslo…" in headline
    assert "Calibration: uncalibrated" in headline
    assert bragkit.serving.presentation.render("", None)[3] == {
        "__type__": "update",
        "visible": False,
    }  # no empty table


def test_the_calibration_table_has_a_row_per_action_and_case(tmp_path):

    frame = bragkit.serving.presentation.calibration_frame(
        json.dumps(brag.shipped_calibrations()["prior"].to_dict())
    )
    assert list(frame["Case"]) == [
        "strong window",
        "weak window",
        "any window",
        "repeats an earlier answer",
        "new answer",
        *[f"{g} of 5 agree" for g in range(1, 6)],
    ]
    low, high = frame.iloc[0]["ρ 95 % interval"].split(" – ")
    assert float(low) < float(frame.iloc[0]["ρ (right)"]) < float(high)
    # The tab shows the fit the server kept, found by the name in /calibrate's JSON.
    server = bragkit.serving.server.Server(bragkit.serving.server.Settings(cache_dir=tmp_path))
    fit = server.shipped["prior"].to_dict()
    name = server.fits.keep(fit)
    kept = tmp_path / "calibrations"
    table, path = server.show_calibration(json.dumps({**fit, "name": name}, indent=1))
    assert table["visible"] is True and Path(path) == server.fits.path(name)
    assert Path(path).is_relative_to(kept) and Path(path).name == f"{name}.json"
    assert json.loads(Path(path).read_text())["source"] == "prior"
    # JSON the server did not keep (or any other input) shows nothing and writes nothing.
    for sent in (json.dumps(fit), json.dumps({**fit, "name": "fit-000000000000"}), None, 7):
        assert server.show_calibration(sent) == ({"__type__": "update", "visible": False}, None)
    assert [p.name for p in kept.rglob("*") if p.is_file()] == [f"{name}.json"]


def test_posterior_chart_draws_one_line_per_candidate_plus_the_residual():

    report = {
        "steps": [
            {"step": 1, "action": "R1", "posterior": {"candidates": [], "residual": 1.0}},
            {
                "step": 2,
                "action": "CB",
                "posterior": {"candidates": [{"answer": "A<b>", "p": 0.6}], "residual": 0.4},
            },
            {
                "step": 3,
                "action": None,
                "posterior": {
                    "candidates": [{"answer": "A<b>", "p": 0.5}, {"answer": "C", "p": 0.3}],
                    "residual": 0.2,
                },
            },
        ]
    }
    svg = bragkit.serving.presentation.posterior_svg(report)
    assert svg.count('class="series"') == 3 and "A&lt;b&gt;" in svg and "<b>" not in svg
    assert "3·stop" in svg
    assert "appears here" in bragkit.serving.presentation.posterior_svg({})


# ---------------------------------------------------------------------------------- concurrency


class Overlap:
    """An endpoint that counts the calls in flight at once.

    Once armed, a call waits (up to ``patience`` seconds) for ``expected`` calls to be in
    flight together, so parallel requests meet there and serial ones never do; each call then
    takes ``hold`` seconds, so calls that could overlap do.
    """

    def __init__(self, expected: int, hold: float = 0.2, patience: float = 30.0) -> None:
        self.expected, self.hold, self.patience = expected, hold, patience
        self.armed, self.met = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0

    def __call__(self, request: dict) -> Reply:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight) if self.armed.is_set() else self.peak
            if self.in_flight >= self.expected:
                self.met.set()
        try:
            if self.armed.is_set():
                self.met.wait(self.patience)
                time.sleep(self.hold)
            return scripted(request)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.parametrize("limit", [16, 1])
def test_requests_run_in_parallel_up_to_brag_concurrency(limit):
    burst = 8
    endpoint = Overlap(expected=min(limit, burst))
    with (
        FakeOpenAI(handler=endpoint) as server,
        AppProcess({"BRAG_MODEL": server.url + "#m", "BRAG_CONCURRENCY": str(limit)}) as app,
    ):
        clients = [Client(app.url, verbose=False) for _ in range(burst)]
        clients[0].predict(*args(), api_name="/brag")  # the documents are indexed once, first
        endpoint.armed.set()
        with ThreadPoolExecutor(max_workers=burst) as pool:
            answers = list(pool.map(lambda c: c.predict(*args(), api_name="/brag")[0], clients))
    assert answers == ["Bergen"] * burst
    # All eight at the endpoint at once when the app may serve sixteen; one at a time when one.
    assert endpoint.peak == endpoint.expected, endpoint.peak


# ---------------------------------------------------------------------------------- local model


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


needs_qwen = pytest.mark.skipif(
    any(llms.QWEN_CODER.part_path(p) is None for p in llms.QWEN_CODER.parts),
    reason="the embedded model's wheels are not installed (requirements.txt installs them)",
)


@needs_qwen
def test_a_crash_of_the_local_model_costs_one_request_not_the_server():
    long_read = json.dumps(
        [{"title": "Filler", "text": "word " * 1500}, {"title": "Glass Tower", "text": DOC_LINES}]
    )
    with AppProcess({"BRAG_MODEL": "local", "HF_TOKEN": ""}) as app:
        client = Client(app.url, verbose=False)
        client.predict(*args(question="Who designed the Glass Tower?"), api_name="/brag")  # loads the model
        (worker,) = children(app.proc.pid)
        notice = f"local model: worker {worker} generating"
        seen = app.log().count(notice)
        job = client.submit(
            *args(documents=long_read, question="Who designed the Glass Tower?"), api_name="/brag"
        )
        while app.log().count(notice) == seen:  # the worker's own word that it holds the request
            assert not job.done(), job.result()
            time.sleep(0.05)
        os.kill(worker, signal.SIGSEGV)
        with pytest.raises(AppError, match=r"local model crashed while answering \(signal SIGSEGV\).*retry"):
            job.result(timeout=120)
        assert app.alive()
        _answer, report = client.predict(*args(question="Who designed the Glass Tower?"), api_name="/brag")
        assert report["totals"]["llm_calls"] >= 1 and app.alive()
        assert children(app.proc.pid) and worker not in children(app.proc.pid)  # a fresh worker


# ---------------------------------------------------------------------------------- Hub corpora


def test_named_corpus_downloads_once_from_the_hub(tmp_path, llm_server):
    corpus = [
        {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
        {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect, born in Bergen in 1961."},
        {"title": "Oslo", "text": "Oslo is the capital of Norway."},
    ]
    files = {"datasets/test-org/HippoRAG_2/musique_corpus.json": json.dumps(corpus).encode()}
    empty = tmp_path / "data"
    empty.mkdir()
    env = {
        "BRAG_MODEL": llm_server.url + "#m",
        "BRAG_DATA_DIR": str(empty),
        "BRAG_CORPUS_REPO": "test-org/HippoRAG_2",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",  # this test's Hub is on loopback: the download is what it checks
    }
    with FakeHub(files) as hub:
        with AppProcess({**env, "HF_ENDPOINT": hub.url}) as app:
            client = Client(app.url, verbose=False)
            answer, report = client.predict(*args(corpus="MuSiQue", documents=""), api_name="/brag")
            downloads = [r for r in hub.requests if r[0] == "GET"]
            client.predict(*args(corpus="MuSiQue", documents=""), api_name="/brag")
            assert [r for r in hub.requests if r[0] == "GET"] == downloads  # indexed once, kept in memory
            with pytest.raises(AppError, match="cannot download the HotpotQA corpus"):
                client.predict(*args(corpus="HotpotQA", documents=""), api_name="/brag")
    assert answer == "Bergen" and report["server"]["corpus"] == "MuSiQue"
    assert len(downloads) == 1 and downloads[0][1].endswith("/musique_corpus.json")
    assert list((tmp_path / "hf").rglob("musique_corpus.json"))  # cached on disk by huggingface_hub


def test_the_owners_own_index_is_served_from_brag_corpus_dir(tmp_path, llm_server):

    brag.Corpus(json.loads(DOC_JSON)).save(tmp_path / "index", name="Our documents")
    with AppProcess({"BRAG_MODEL": llm_server.url + "#m", "BRAG_CORPUS_DIR": str(tmp_path / "index")}) as app:
        client = Client(app.url, verbose=False)
        answer, report = client.predict(*args(corpus="Our documents", documents=""), api_name="/brag")
        with urllib.request.urlopen(app.url + "config", timeout=10) as page:
            assert "Our documents" in page.read().decode()  # offered in the corpus picker
    assert answer == "Bergen" and report["server"]["corpus"] == "Our documents"
    result = subprocess.run(
        [sys.executable, str(ROOT / "app.py")],
        env={**os.environ, "BRAG_CORPUS_DIR": str(tmp_path), "GRADIO_SERVER_PORT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "is not a folder written by `python -m brag index`" in result.stderr


# ---------------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def slow_reads(request: dict) -> Reply:
    """The scripted reader, taking its time over questions about the Glass Tower (so a browser can
    see a run in progress); everything else at once."""
    reply = scripted(request)
    if "Glass Tower" in request["messages"][-1]["content"]:
        reply.delay = 1.2
    return reply


MARKUP = (
    '<img src="http://127.0.0.1:9/t.png" style="position:fixed"> '
    '<form action="http://127.0.0.1:9/steal"><input name="pw"><button>Sign in</button></form> '
    "[a link](http://127.0.0.1:9/) ![an image](http://127.0.0.1:9/i.png)"
)


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian chromium not installed (.ci/run installs it)"
)
def test_a_real_browser_sees_progress_then_the_answer_an_error_and_a_calibration(tmp_path):
    """Drives the page in Chromium at 1280 px and keeps a screenshot of each state.

    ``BRAG_UPDATE_SCREENSHOTS=1`` copies them to docs/ (the README and the guides show them).
    """
    from playwright.sync_api import sync_playwright

    shots: dict[str, Path] = {}
    with (
        FakeOpenAI(handler=slow_reads) as server,
        AppProcess({"BRAG_MODEL": server.url + "#scripted", "HF_TOKEN": ""}) as slow_app,
        sync_playwright() as p,
    ):
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})

        def shoot(name: str) -> None:
            shots[name] = tmp_path / f"{name}.png"
            page.screenshot(path=str(shots[name]), full_page=True)

        page.goto(slow_app.url, wait_until="domcontentloaded")
        page.get_by_role("button", name="Ask").wait_for(timeout=30_000)
        assert not page.locator("#steps").is_visible()  # no empty table, no "1 2 3" headers
        # The model box is not squeezed into a narrow column at 1280 px.
        assert page.locator("#model").bounding_box()["width"] >= 300
        shoot("home")

        # Pasted text picks "Your documents" in the browser (it is never sent just for that), and
        # clearing it goes back to the Demo corpus.
        from playwright.sync_api import expect

        pasted, corpus = (
            page.get_by_label("Or paste documents", exact=False).first,
            page.get_by_label("Corpus").first,
        )
        pasted.fill(DOC_LINES)
        expect(corpus).to_have_value("Your documents", timeout=15_000)
        pasted.fill("")
        expect(corpus).to_have_value("Demo", timeout=15_000)

        page.get_by_label("Question").first.fill(QUESTION)
        page.get_by_role("button", name="Ask").click()
        # Progress shows in the main column while the run goes on, before the answer exists.
        page.locator("#progress").filter(has_text="Running · step").wait_for(timeout=30_000)
        assert page.locator("#answer h2").count() == 0
        assert page.locator("#progress").filter(has_text=re.compile(r"\d+ LLM calls? so far")).count() == 1
        shoot("running")
        page.locator("#answer h2").filter(has_text="Bergen").wait_for(timeout=60_000)
        page.locator("#progress").filter(has_text="Done").wait_for(timeout=15_000)
        page.get_by_text("LLM calls").first.wait_for(timeout=15_000)
        assert page.locator("#posterior-chart polyline.series").count() >= 2
        headers = page.locator("#steps th").all_inner_texts()
        assert any("What it read" in h for h in headers) and any("Follow-up" in h for h in headers)
        assert "✓" in page.locator("#steps").inner_text()
        # Nothing clipped at 1280 px: the table fits its box.
        clipped = page.evaluate(
            "() => [...document.querySelectorAll('#steps .table-wrap, #steps table')]"
            ".some(e => e.scrollWidth > e.clientWidth + 2)"
        )
        assert not clipped
        shoot("answered")

        # Files: a PDF and a Markdown file; the answer is on the PDF's page 3, and the page says so.
        pdf = tmp_path / "tower.pdf"
        pdf.write_bytes(
            pdf_bytes(["Fjords and hills.", "Nothing here.", "Lina Berg was born in Bergen in 1961."])
        )
        notes = tmp_path / "notes.md"
        notes.write_text("# Notes\n\nThe Glass Tower in Oslo was designed by the architect Lina Berg.\n")
        page.locator("#files input[type=file]").set_input_files([str(pdf), str(notes)])
        page.locator("#files").filter(has_text="notes").filter(has_text="tower").wait_for(timeout=30_000)
        page.get_by_role("button", name="Ask").click()
        page.locator("#answer").filter(has_text="tower.pdf, p. 3").wait_for(timeout=60_000)
        assert "Lina Berg was born in Bergen in 1961." in page.locator("#answer").inner_text()
        assert "corpus: tower.pdf, notes.md" in page.locator("#answer").inner_text()
        shoot("documents")
        # The same tab asks again over the same files: they were read once and are kept for it.
        page.get_by_role("button", name="Ask").click()
        # This run's own progress first: the last run's "Done" is still on the page, and a click
        # while this run goes on would be dropped (a button runs one event at a time).
        page.locator("#progress").filter(has_text="Running · step").wait_for(timeout=30_000)
        page.locator("#progress").filter(has_text="Done").wait_for(timeout=60_000)
        page.locator("#answer").filter(has_text="tower.pdf, p. 3").wait_for(timeout=60_000)

        # A file named in Japanese, with a Japanese heading: the name and the quote read as written.
        japanese = tmp_path / "ベルゲンの建築家 メモ.md"
        japanese.write_text(
            "# 建築家について\n\n"
            "The architect of the Glass Tower, Lina Berg, was born in Bergen in 1961（昭和36年）.\n",
            encoding="utf-8",
        )
        page.locator("#files input[type=file]").set_input_files([str(japanese)])
        page.locator("#files").filter(has_text="ベルゲンの建築家").wait_for(timeout=30_000)
        page.get_by_role("button", name="Ask").click()
        page.locator("#progress").filter(has_text="Running · step").wait_for(timeout=30_000)
        page.locator("#answer").filter(has_text="ベルゲンの建築家 メモ.md › 建築家について").wait_for(
            timeout=60_000
        )
        shown = page.locator("#answer").inner_text()
        assert "1961（昭和36年）" in shown and "ベルゲンの建築家 メモ.md" in shown.split("corpus: ")[1]
        assert "ベルゲンの建築家 メモ.md › 建築家について" in page.locator("#steps").inner_text()

        # A hostile document: markup in a heading and in a passage title is shown as written, and
        # never becomes an element on the page (Gradio's sanitiser keeps img, form and input).
        hostile = tmp_path / "hostile.md"
        hostile.write_text(f"# Notes {MARKUP}\n\nLina Berg was born in Bergen in 1961.\n")
        titled = tmp_path / "titled.json"
        titled.write_text(json.dumps([{"title": f"Tower {MARKUP}", "text": DOC_LINES.splitlines()[0]}]))
        page.locator("#files input[type=file]").set_input_files([str(hostile), str(titled)])
        page.locator("#files").filter(has_text="hostile").wait_for(timeout=30_000)
        # The hand-set prior, named in the calibration box, reads five passages first: both titles.
        page.get_by_text("Advanced: calibration").click()
        calibration = page.get_by_label("Calibration: empty (the one for this model), a name, or JSON")
        calibration.fill("prior")
        page.get_by_role("button", name="Ask").click()
        page.locator("#progress").filter(has_text="Running · step").wait_for(timeout=30_000)
        page.locator("#progress").filter(has_text="Done").wait_for(timeout=60_000)
        shown = page.locator("#answer").inner_text()
        assert "Notes <img" in shown and "<form action=" in shown, shown  # the words, as written
        calibration.fill("")
        planted = "img[src*='127.0.0.1:9'], form, input[name=pw], a[href*='127.0.0.1:9']"
        for area in ("#answer", "#steps", "#posterior-chart"):
            assert page.locator(area).locator(planted).count() == 0, area
        assert page.locator(planted.replace(", form", "")).count() == 0  # nowhere on the page

        # The cost unit: the prices show only for usd, and the totals say what the run cost in it.
        assert not page.get_by_label("$ / M input tokens").is_visible()
        page.get_by_label("Price actions in").click()
        page.get_by_role("option", name="usd").click()
        page.get_by_label("$ / M input tokens").wait_for(state="visible", timeout=15_000)
        page.get_by_label("$ / M input tokens").fill("0.5")
        page.get_by_label("$ / M output tokens").fill("2")
        page.get_by_role("button", name="Ask").click()
        page.get_by_text("priced in usd").first.wait_for(timeout=90_000)
        page.locator("#answer h2").filter(has_text="Bergen").wait_for(timeout=60_000)

        # A question the documents cannot answer: the page says so first, and the steps table too.
        page.get_by_label("Question").first.fill(NOT_ANSWERED)
        page.get_by_role("button", name="Ask").click()
        page.locator("#answer h2").filter(has_text="Not in your documents").wait_for(timeout=60_000)
        assert "Not in your documents" in page.locator("#steps").inner_text()
        shoot("not_found")

        page.get_by_label("Question").first.fill("   ")
        page.get_by_role("button", name="Ask").click()
        page.get_by_text("The question is empty.").first.wait_for(timeout=30_000)
        page.locator("#progress").filter(has_text="failed").wait_for(timeout=15_000)
        assert page.locator("#answer h2").count() == 0  # the last answer is not left beside the error
        assert not page.locator("#steps").is_visible()
        shoot("error")

        page.get_by_role("tab", name="Calibrate").click()
        labelled = json.dumps([{"question": f"Q{i}: which city?", "gold": ["Bergen"]} for i in range(30)])
        page.get_by_label('"gold" is optional', exact=False).fill(labelled)
        page.get_by_role("button", name="Calibrate").click()
        table = page.locator("#calibration-table")
        table.wait_for(state="visible", timeout=120_000)
        assert "repeats an earlier answer" in table.inner_text() and "5 of 5 agree" in table.inner_text()
        assert page.get_by_text("Download the calibration").count() >= 1
        assert page.get_by_text("a labelled fit on 30 questions").count() >= 1
        # The download is served; an upload is not, to anyone.
        link = page.locator("a[href*='fit-']").first
        link.wait_for(timeout=30_000)
        download = page.request.get(link.get_attribute("href"))
        assert download.status == 200 and json.loads(download.body())["name"].startswith("fit-")
        uploaded = upload_over_rest(slow_app.url, "mine.txt", b"hosted?")
        assert page.request.get(f"{slow_app.url}gradio_api/file={uploaded}").status == 403
        shoot("calibration")
        browser.close()
    for name, shot in shots.items():
        assert shot.stat().st_size > 10_000, name
    if os.environ.get("BRAG_UPDATE_SCREENSHOTS"):
        (ROOT / "docs").mkdir(exist_ok=True)
        for name, shot in shots.items():
            shutil.copy(shot, ROOT / "docs" / f"{name}.png")


def test_a_perfect_reader_answers_at_least_80_percent_over_the_app(shared_data):
    """The acceptance check over HTTP.

    An uncalibrated endpoint, the prior it gets, and a reader that is right whenever the
    supporting passages are in its prompt.
    """
    from perfect_reader import PerfectReader, calls_it_needs

    import calibrate

    items = calibrate.read_labelled(shared_data / "hotpotqa" / "hotpotqa_ircot500.json")[300:340]
    with (
        PerfectReader(items) as reader,
        AppProcess({"BRAG_MODEL": reader.url + "#perfect", "BRAG_DATA_DIR": str(shared_data)}) as app,
    ):
        client = Client(app.url, verbose=False)
        right, wasted = 0, {}
        for item in items:
            answer, report = client.predict(
                item.question, "HotpotQA", "", 0.05, "", "", "auto", "", api_name="/brag"
            )
            right += brag.exact_match(answer, item.gold)
            wasted[item.id] = calls_it_needs(report, set(item.supporting))
    assert "uncalibrated" in report["server"]["calibration"]["status"]
    assert right >= 0.8 * len(items), right
    assert not any(wasted.values()), {k: v for k, v in wasted.items() if v}  # the calls it needs


def as_html(markdown: str) -> str:
    """Markdown as a CommonMark renderer (Gradio's marked follows it) turns it into HTML."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(markdown)


def test_a_guess_is_said_plainly_in_the_headline_with_its_runner_up():

    report = fake_report()
    report["confidence"] = {
        "p_correct": 0.19,
        "guess": True,
        "runner_up": {"answer": "Bergen", "p": 0.12},
        "supported": False,
        "summary": "a guess: 19%; runner-up: Bergen (12%); no passage read contains this answer: "
        "the corpus does not seem to hold it",
    }
    _, headline, *_ = bragkit.serving.presentation.render("Oslo", report)
    shown = as_html(headline)
    assert "<h2>Oslo</h2>" in shown
    assert "<strong>A guess: 19%; runner-up: Bergen (12%); no passage read contains this answer: " in shown
    assert "the corpus does not seem to hold it</strong>" in shown
    report["confidence"] = {**report["confidence"], "guess": False, "summary": "P(correct) ≈ 81%"}
    _, headline, *_ = bragkit.serving.presentation.render("Oslo", report)
    shown = as_html(headline)
    assert "P(correct) ≈ 81% · corpus:" in shown and "<strong>" not in shown


def test_not_in_your_documents_comes_first_in_the_headline_the_answer_and_the_steps_table():
    presentation = bragkit.serving.presentation
    report = {**fake_report(), "answer": "Oslo", "found_in_documents": False}
    report["confidence"] = {
        "p_correct": 0.62,
        "guess": True,
        "summary": f"{brag.NOT_FOUND}: what follows is a guess, not an answer from them; a guess: 62%",
    }
    stated = presentation.stated_answer("Oslo", report)
    assert stated == "Not in your documents. A guess, not from them: Oslo"
    _, headline, _, table, _ = presentation.render(stated, report)
    shown = as_html(headline)
    assert shown.startswith("<h2>Not in your documents</h2>") and "A guess, not from them: Oslo" in shown
    assert "<h2>Oslo</h2>" not in shown and "Not in your documents" in table["value"].iloc[-1].tolist()
    # Found, or still running: the answer as it is.
    assert presentation.stated_answer("Oslo", {**report, "found_in_documents": True}) == "Oslo"
    assert presentation.stated_answer("Oslo", {**report, "finished": False}) == "Oslo"
    assert presentation.stated_answer("", report) == "Not in your documents."


def test_the_cost_unit_is_an_optional_input_over_gradio_client_and_rest(client, app):
    answer, report = client.predict(*args(), "tokens", None, None, api_name="/brag")
    assert answer == "Bergen" and report["config"]["cost"]["unit"] == "tokens"
    assert report["config"]["cost"]["per_action"]["R1"] == 1.0
    assert all("priced" in s["cost"] for s in report["steps"] if s["action"])
    _, report = client.predict(*args(), "usd", 0.5, 2.0, api_name="/brag")
    assert report["config"]["cost"]["unit"] == "usd"
    # The first eight inputs alone still work over REST: the cost unit is the default.
    _, report = rest_call(app.url, "brag", args())
    assert report["config"]["cost"]["unit"] == brag.DEFAULT_COST_UNIT == "tokens"
    _, report = rest_call(app.url, "brag", [*args(), "calls", None, None])
    assert report["config"]["cost"]["unit"] == "calls"
    assert set(report["config"]["cost"]["per_action"].values()) == {1.0}
    with pytest.raises(AppError, match="cost usd needs the input and output prices"):
        client.predict(*args(), "usd", None, None, api_name="/brag")
    with pytest.raises(AppError, match="not in the list of choices"):
        client.predict(*args(), "euros", None, None, api_name="/brag")


def test_files_are_uploaded_over_gradio_client_and_rest_read_and_deleted(client, app, tmp_path):
    from gradio_client import handle_file

    pdf = tmp_path / "tower.pdf"
    pdf.write_bytes(
        pdf_bytes(["Fjords and hills.", "Nothing here.", "Lina Berg was born in Bergen in 1961."])
    )
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe Glass Tower in Oslo was designed by the architect Lina Berg.\n")
    files = [handle_file(str(pdf)), handle_file(str(notes))]
    answer, report = client.predict(*args(documents=""), "tokens", None, None, files, api_name="/brag")
    assert answer == "Bergen" and report["server"]["corpus"] == "tower.pdf, notes.md"
    assert report["confidence"]["source"] == {
        "passage": "tower.pdf, p. 3",
        "quote": "Lina Berg was born in Bergen in 1961.",
    }
    read = {p["title"] for s in report["steps"] for p in (s.get("observation") or {}).get("passages", [])}
    assert "tower.pdf, p. 3" in read
    # REST: upload, then name the uploaded file in the call; it is gone once the request ends.
    path = upload_over_rest(app.url, "tower.pdf", pdf.read_bytes())
    assert Path(path).is_file()

    def ask_with(*paths: str) -> list:
        files = [{"path": p, "meta": {"_type": "gradio.FileData"}} for p in paths]
        return rest_call(app.url, "brag", [*args(documents=""), "tokens", None, None, files])

    answer, report = ask_with(path)
    assert answer == "Bergen" and report["server"]["corpus"] == "tower.pdf" and not Path(path).exists()
    # A bad file is named with the reason; a path never uploaded is not read.
    broken = upload_over_rest(app.url, "broken.docx", b"PK\x03\x04 junk")
    with pytest.raises(RuntimeError, match=r"broken\.docx: not a readable Word"):
        ask_with(broken)
    secret = tmp_path / "secret.txt"
    secret.write_text("Lina Berg was born in Bergen.")
    with pytest.raises(RuntimeError) as err:
        ask_with(str(secret))
    assert "Bergen" not in str(err.value) and secret.exists()
    # The calibrate tab takes files too (its last, optional input).
    with pytest.raises(AppError, match="at least 30"):
        client.predict(
            '[{"question": "q", "gold": ["a"]}]',
            "",
            "",
            "",
            "",
            "auto",
            [handle_file(str(notes))],
            api_name="/calibrate",
        )


def test_a_manuals_tree_of_300_files_is_answered_over_under_the_default_limits(client, app, tmp_path):
    from gradio_client import handle_file

    # 300 real pages, the answer on one of them: within BRAG_MAX_FILES as the app ships.
    pages = [(f"page{i}.html", html_page(i)) for i in range(299)]
    pages.append(("people.html", html_page(299, "Lina Berg was born in Bergen in 1961.")))
    paths = upload_many(app.url, pages)  # one upload, as a browser sends a selection
    files = [{"path": p, "meta": {"_type": "gradio.FileData"}} for p in paths]
    answer, report = rest_call(app.url, "brag", [*args(documents=""), "tokens", None, None, files])
    assert (
        answer == "Bergen"
        and report["confidence"]["source"]["passage"] == "people.html › Chapter 299 › Section 299.1"
    )
    assert report["server"]["corpus"] == "page0.html, page1.html, page2.html and 297 more files"
    assert report["server"]["files"]["read"] == 300 and report["server"]["files"]["not_read"] == []
    assert not any(Path(p).exists() for p in paths)  # read, then deleted
    # The same tree as one .zip, with a page that cannot be read and the tree's images: the rest
    # is answered over, and the page says which file was not read and why.
    tree = [(f"manual/html/{name}", data) for name, data in pages[1:]]
    tree += [("manual/html/broken.pdf", b"%PDF-1.4 junk"), ("manual/img/logo.png", b"\x89PNG")]
    manual = tmp_path / "manual.zip"
    manual.write_bytes(zip_bytes(tree))
    answer, report = client.predict(
        *args(documents=""), "tokens", None, None, [handle_file(str(manual))], api_name="/brag"
    )
    assert answer == "Bergen" and report["server"]["corpus"] == "manual.zip"
    assert (
        report["confidence"]["source"]["passage"]
        == "manual.zip/manual/html/people.html › Chapter 299 › Section 299.1"
    )
    read = report["server"]["files"]
    assert (read["read"], read["skipped_types"]) == (299, {".png": 1})
    assert read["not_read"] == [
        {"file": "manual.zip/manual/html/broken.pdf", "reason": "not a readable PDF (PdfStreamError)"}
    ]


@pytest.mark.parametrize(
    ("concurrency", "setting", "expected"),
    [(16, None, 8), (4, None, 2), (2, None, 1), (1, None, 1), (4, 8, 3), (4, 1, 1), (1, 5, 1)],
)
def test_one_address_never_holds_every_worker(concurrency, setting, expected):

    assert bragkit.serving.limits.Limits(per_address=setting).address_share(concurrency) == expected


def test_document_and_model_text_is_shown_as_written_never_as_markup():

    hostile = (
        '<img src=x onerror="alert(1)"> <form><input name=pw></form> [link](javascript:alert(1)) '
        "![img](http://t.example/i.png) **bold** # heading `code` www.example.com a@b.example $$x$$ | -"
    )
    shown = as_html(bragkit.serving.presentation.as_text(hostile))
    assert "<img" not in shown and "<form" not in shown and "<a " not in shown and "<strong>" not in shown
    assert "<code>" not in shown and "<h1>" not in shown
    assert html.unescape(shown.removeprefix("<p>").removesuffix("</p>\n")) == hostile


def test_an_upload_no_question_used_is_deleted_and_a_late_request_is_told_why(llm_server, tmp_path):
    env = {"BRAG_MODEL": llm_server.url + "#scripted", "HF_TOKEN": "", "BRAG_UPLOAD_TTL_SECONDS": "1"}
    with AppProcess(env) as short:
        path = upload_over_rest(short.url, "notes.md", b"# Notes\n\nLina Berg was born in Bergen.\n")
        deadline = time.monotonic() + 60
        while Path(path).exists():  # swept by the ledger within a few seconds
            assert time.monotonic() < deadline, "the upload was never deleted"
            time.sleep(0.2)
        files = [{"path": path, "meta": {"_type": "gradio.FileData"}}]
        with pytest.raises(
            RuntimeError, match=r"waited more than 1 s .*BRAG_UPLOAD_TTL_SECONDS.*upload it again"
        ):
            rest_call(short.url, "brag", [*args(documents=""), "tokens", None, None, files])


def test_a_body_naming_more_files_than_a_request_may_hold_is_refused_before_it_is_parsed():

    parsed: list[bytes] = []

    async def fastapi_like(scope, receive, send):
        """Reads the whole body; like FastAPI, answers 400 when reading it fails."""
        body = b""
        try:
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            parsed.append(body)
            status, answer = 200, b"parsed"
        except Exception:
            status, answer = 400, b"There was an error parsing the body"
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    guard = bragkit.serving.guards.RequestSizeLimit(fastapi_like, max_bytes=20_000_000, max_files=10)

    def body(files: int, question: str = "q") -> bytes:
        items = [{"path": f"/tmp/x{i}", "meta": {"_type": "gradio.FileData"}} for i in range(files)]
        return json.dumps({"data": [question, items]}).encode()

    for size in (body(10), body(10, question='"path": ' * 50)):  # a path key inside a string is text
        headers = {"content-length": str(len(size))}
        assert call_asgi(guard, "/gradio_api/call/brag", size, headers, chunk=7) == (200, b"parsed")
    many = body(100_000)
    status, answer = call_asgi(
        guard, "/gradio_api/call/brag", many, {"content-length": str(len(many))}, chunk=65_536
    )
    assert status == 413 and b"at most 10 files (BRAG_MAX_FILES)" in answer and len(parsed) == 2


def reading_workers(pid: int) -> int:
    """How many file-reading workers the app process ``pid`` is running."""
    count = 0
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            try:
                count += b"parse_worker" in Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
    return count


def test_a_client_that_cancels_stops_the_reading_of_its_files(client, app, tmp_path):
    from gradio_client import handle_file

    slow = tmp_path / "slow.pdf"  # 900,000 cheap operations: seconds of CPU, within every bound
    slow.write_bytes(raw_pdf(1, b"q Q " * 450_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET"))
    files = [handle_file(str(slow)) for _ in range(10)]  # half a minute of reading
    job = client.submit(*args(documents=""), "tokens", None, None, files, api_name="/brag")
    deadline = time.monotonic() + 60
    while not reading_workers(app.proc.pid):
        assert time.monotonic() < deadline and not job.done(), "the files were never read"
        time.sleep(0.05)
    job.cancel()
    deadline = time.monotonic() + 10
    while reading_workers(app.proc.pid):
        assert time.monotonic() < deadline, "the reading went on after the client cancelled"
        time.sleep(0.1)
    answer, _ = client.predict(*args(), api_name="/brag")
    assert answer == "Bergen"


# ------------------------------------------------------------------------------------------
# Self-test: /calibrate with no questions, "Check these documents", and /brag using the fit
# ------------------------------------------------------------------------------------------

SELF_TEST_DOCS = "\n".join(selftest_reader.SENTENCES)


def self_test_reader(request: dict) -> Reply:
    """The self-test reader of tests/selftest_reader.py; while a test holds the self-test, a call
    about zorch waits until the test lets it go (so the test sees the self-test under way)."""
    if HOLD_SELF_TEST.is_set() and "zorch" in request["messages"][-1]["content"].casefold():
        HELD.set()
        RELEASE.wait(timeout=120)
    return Reply(texts=selftest_reader.replies(request["messages"], int(request.get("n") or 1)))


HOLD_SELF_TEST, HELD, RELEASE = threading.Event(), threading.Event(), threading.Event()


@contextlib.contextmanager
def held_self_test():
    """Hold a self-test at its zorch call until the block ends."""
    HELD.clear()
    RELEASE.clear()
    HOLD_SELF_TEST.set()
    try:
        yield
    finally:
        HOLD_SELF_TEST.clear()
        RELEASE.set()


@pytest.fixture(scope="module")
def self_test_app():
    with FakeOpenAI(handler=self_test_reader) as server:
        env = {
            "BRAG_MODEL": server.url + "#selftest",
            "HF_TOKEN": "",
            "BRAG_ALLOWED_ENDPOINTS": "*",
            "BRAG_SELF_TEST_QUESTIONS": "10",
            "BRAG_TRUSTED_PROXIES": "127.0.0.1",  # so a test can be two callers
        }
        with AppProcess(env) as process:
            yield process, server


def test_a_self_test_calibrates_the_documents_and_brag_uses_it_unasked(self_test_app):
    app, server = self_test_app
    client = Client(app.url, verbose=False)
    before = len(server.chat_requests)
    fitted = json.loads(
        client.predict("", "", SELF_TEST_DOCS, "", "", "auto", None, True, api_name="/calibrate")
    )
    assert fitted["fitted_on"]["kind"] == "self-test" and fitted["fitted_on"]["questions"] == 10
    # What its base (the fit across readers, for a model it has no terms for) offers.
    assert set(fitted["actions"]) == {"R1", "R2", "CB", "RT"}
    assert fitted["fitted_on"]["yield"]["kept"] == 10
    sent = server.chat_requests[before:]
    # Writing and checking, then every action a self-test observes (a second hop keeps the base's entry).
    assert len(sent) >= 10 * 2 + 10 * 2
    # No request is sent twice (a focused read, where the base offers one, is its question's roundtrip).
    deterministic = [json.dumps(r, sort_keys=True) for r in sent if r.get("temperature") == 0.0]
    assert len(deterministic) == len(set(deterministic))
    question = "Which folder does Garply write a crash report to?"
    _, report = client.predict(question, "", SELF_TEST_DOCS, 0.05, "", "", "auto", "", api_name="/brag")
    status = report["server"]["calibration"]["status"]
    assert status.startswith("calibrated on 10 self-test questions from your documents (your self-test of ")
    assert status.endswith(f"kept as {fitted['name']})") and fitted["made"] in status
    assert report["config"]["actions"]["offered"] == ["R1", "R2", "CB", "RT"]  # what the fit offers, no more
    # It is this caller's: another caller over the same documents keeps the shipped fit ...
    other = Client(app.url, verbose=False, headers={"X-Forwarded-For": "198.51.100.40"})
    _, theirs = other.predict(question, "", SELF_TEST_DOCS, 0.05, "", "", "auto", "", api_name="/brag")
    assert "self-test" not in theirs["server"]["calibration"]["status"]
    # ... unless it names the fit.
    _, named = other.predict(
        question, "", SELF_TEST_DOCS, 0.05, "", "", "auto", fitted["name"], api_name="/brag"
    )
    assert (
        named["server"]["calibration"]["status"] == "calibrated on 10 self-test questions from your documents"
    )
    # Other documents have no self-test fit: nothing changes for them.
    other = "\n".join(selftest_reader.SENTENCES[:6])
    _, elsewhere = client.predict(question, "", other, 0.05, "", "", "auto", "", api_name="/brag")
    assert elsewhere["server"]["calibration"]["status"].startswith("fitted for other readers")
    assert elsewhere["config"]["actions"]["offered"] == ["R1", "R2", "CB", "RT"]


def test_a_self_test_of_few_questions_ends_with_a_fit_and_one_turned_off_is_a_clear_error(
    self_test_app, tmp_path
):
    app, _ = self_test_app
    client = Client(app.url, verbose=False)
    few = "\n".join(selftest_reader.SENTENCES[:4])
    fitted = json.loads(client.predict("", "", few, "", "", "auto", None, True, api_name="/calibrate"))
    kept = fitted["fitted_on"]["yield"]["kept"]
    assert fitted["fitted_on"]["questions"] == kept and 0 < kept < 10  # it wanted 10
    assert fitted["fitted_on"]["checked"].startswith(f"{kept} of the 10 questions wanted passed the checks")
    server = bragkit.serving.server.Server(
        bragkit.serving.server.Settings(cache_dir=tmp_path, self_test=False)
    )
    with pytest.raises(Exception, match="turned off"):
        server.run_calibrate("", "Demo", "", "", "", "auto")


def test_self_tests_take_turns_and_one_stops_when_cancelled(self_test_app):
    app, server = self_test_app
    client = Client(app.url, verbose=False)
    other = Client(app.url, verbose=False, headers={"X-Forwarded-For": "198.51.100.41"})
    docs = SELF_TEST_DOCS + "\nZorch keeps its spool below the /srv/zorch directory on every host."
    with held_self_test():
        job = client.submit("", "", docs, "", "", "auto", None, True, api_name="/calibrate")
        assert HELD.wait(timeout=60), "the self-test never started"
        # One address holds at most its share of the self-test slots: its second is refused at once.
        with pytest.raises(Exception, match="429"):
            client.predict("", "", docs, "", "", "auto", None, True, api_name="/calibrate")
        # Self-tests take turns (their own slots): another caller's waits, in the lane's line
        # (Gradio runs its event, which waits for a turn: bragkit.serving.lane).
        second = other.submit("", "", docs, "", "", "auto", None, True, api_name="/calibrate")
        deadline = time.monotonic() + 30
        while second.status().code.name not in ("IN_QUEUE", "QUEUE", "PROCESSING"):
            assert time.monotonic() < deadline, f"the second self-test is {second.status().code.name}"
            time.sleep(0.1)
        assert not second.done()
        second.cancel()
        job.cancel()
        deadline = time.monotonic() + 30
        while not (job.done() and second.done()):
            assert time.monotonic() < deadline, "a cancelled self-test went on"
            time.sleep(0.1)
    time.sleep(1.0)  # the held call returns once released; the cancelled run makes no other
    made = len(server.chat_requests)
    time.sleep(2.0)
    assert len(server.chat_requests) == made
    _, report = client.predict(
        "What does zorch accept?", "", docs, 0.05, "", "", "auto", "", api_name="/brag"
    )
    assert "self-test" not in report["server"]["calibration"]["status"]  # nothing was kept


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian chromium not installed (.ci/run installs it)"
)
def test_a_real_browser_checks_the_documents_with_progress_then_says_how_it_is_calibrated(self_test_app):
    from playwright.sync_api import sync_playwright

    app, _ = self_test_app
    docs = SELF_TEST_DOCS + "\nZorch rotates its logs every 3 days unless the operator says otherwise."
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(app.url, wait_until="domcontentloaded")
        page.get_by_role("button", name="Check these documents").wait_for(timeout=30_000)
        page.get_by_label("Or paste documents", exact=False).first.fill(docs)
        with held_self_test():  # the page shows the self-test under way while it is held
            page.get_by_role("button", name="Check these documents").click()
            assert HELD.wait(timeout=60), "the self-test never started"
            page.get_by_text(re.compile(r"Writing questions")).first.wait_for(timeout=60_000)
        status = page.locator("#self-test")
        status.filter(has_text="calibrated on 10 self-test questions from your documents").wait_for(
            timeout=120_000
        )
        # The next answer over these documents says so too.
        page.get_by_label("Question").first.fill("How many days does zorch keep its logs before rotating?")
        page.get_by_role("button", name="Ask").click()
        page.get_by_text("calibrated on 10 self-test questions from your documents").nth(1).wait_for(
            timeout=60_000
        )
        browser.close()


def test_a_self_test_with_a_callers_own_labels_is_returned_but_not_kept_for_others(self_test_app):
    app, _ = self_test_app
    client = Client(app.url, verbose=False)
    docs = SELF_TEST_DOCS + "\nPlugh caches its answers for 90 minutes before it asks again."
    labels = json.dumps([{"question": "How long does plugh cache its answers?", "gold": ["42 hours"]}])
    fitted = json.loads(client.predict(labels, "", docs, "", "", "auto", None, True, api_name="/calibrate"))
    assert fitted["fitted_on"]["labelled"] == 1 and fitted["fitted_on"]["questions"] == 10
    _, report = client.predict(
        "How long does plugh cache?", "", docs, 0.05, "", "", "auto", "", api_name="/brag"
    )
    assert "self-test" not in report["server"]["calibration"]["status"]
    # The caller can still use it, by the name it was kept under.
    _, named = client.predict(
        "How long does plugh cache?", "", docs, 0.05, "", "", "auto", fitted["name"], api_name="/brag"
    )
    assert "and 1 of your own labelled questions" in named["server"]["calibration"]["status"]
