"""The app launched for real (``python app.py`` on a free loopback port), its LLM being the tests'
loopback OpenAI-compatible server: gradio_client, REST, concurrency, bad input, the Hub path and
a real browser."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from app_server import AppProcess, rest_call
from conftest import PRIORS, ROOT
from gradio_client import Client
from gradio_client.exceptions import AppError
from hub_server import FakeHub
from openai_server import FakeOpenAI, Reply

import llms

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


def scripted(request: dict) -> Reply:
    """Reads answer Bergen when the Lina Berg passage is in the prompt; CB samples disagree."""
    content = request["messages"][-1]["content"].rsplit("\n\nPassages:\n", 1)[-1]
    if "Passages:" in request["messages"][-1]["content"]:
        if "born in Bergen" in content:
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
    assert report["answer"] == "Bergen" and report["corpus"] == "your documents"
    assert report["totals"]["llm_calls"] == made >= 1
    assert all(key in report["steps"][0] for key in ("posterior", "rates", "action", "policy_us"))


def test_named_demo_corpus_works_without_download(client):
    answer, report = client.predict(*args(corpus="Demo", documents=""), api_name="/brag")
    assert answer == "Bergen" and report["corpus"] == "Demo"
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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"question": "   "}, "question is empty"),
        ({"documents": '["unclosed", '}, "malformed JSON"),
        ({"documents": "", "corpus": "Wikipedia"}, "Wikipedia is not in the list of choices"),
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
    started = time.monotonic()
    with pytest.raises(AppError, match="cannot reach") as err:
        client.predict(*args(model=url + "#m"), api_name="/brag")
    assert time.monotonic() - started < 30
    assert "R1 failed: cannot reach" in str(err.value)
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
    assert len(llm_server.chat_requests) - before == 30 * 3  # every action on every question
    assert cal["diagnostics"]["R2"]["accuracy"] == 1.0  # the scripted reader is right after hop 2
    answer, report = client.predict(*args(cal=fitted), api_name="/brag")
    assert answer == "Bergen" and report["config"]["calibration"]["source"] == "fitted"


@pytest.mark.parametrize(
    ("labelled", "message"),
    [
        ("", "No labelled questions"),
        ('[{"question": "q", "gold": ["a"]}]', "at least 30"),
        ("[{", "malformed JSON"),
        ('[{"question": "q"}]', "unknown layout"),
    ],
)
def test_calibrate_bad_input_is_a_clear_error(client, labelled, message):
    with pytest.raises(AppError, match=message):
        client.predict(labelled, "Demo", "", "", "", "auto", api_name="/calibrate")


def test_brag_picks_the_calibration_of_the_chosen_corpus(client):
    _, demo = client.predict(*args(corpus="Demo", documents="", cal=""), api_name="/brag")
    assert demo["config"]["calibration"]["corpus"] == "HotpotQA"


def test_pasted_corpora_stay_within_the_memory_budget():
    import app as brag_app

    one = brag_app.STORE.documents(DOC_LINES).memory_bytes()
    store = brag_app.CorpusStore(documents_budget=int(3.5 * one))
    for i in range(10):
        store.documents(DOC_LINES + f"\nDocument set number {i}.")
        assert store.cached_bytes() <= store.documents_budget
    assert 2 <= len(store._documents) <= 3
    first = store.documents(DOC_LINES + "\nDocument set number 9.")
    assert store.documents(DOC_LINES + "\nDocument set number 9.") is first  # a repeat is a cache hit


def test_allow_list_prefixes_match_whole_hosts_ports_and_path_segments(monkeypatch):
    import app as brag_app

    monkeypatch.setenv("BRAG_ALLOWED_ENDPOINTS", "http://10.0.0.5:8000/v1, https://api.example.com")
    policy = brag_app.EndpointPolicy.from_env()
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
    assert brag_app.EndpointPolicy.from_env().allow_all


@pytest.mark.parametrize(
    ("env", "value"),
    [("BRAG_REQUEST_TIMEOUT", "soon"), ("BRAG_MAX_QUESTION_CHARS", "-5"), ("BRAG_CONCURRENCY", "0")],
)
def test_a_bad_limit_in_the_environment_stops_the_app_with_a_clear_message(env, value):
    result = subprocess.run(
        [sys.executable, str(ROOT / "app.py")],
        env={**os.environ, env: value, "GRADIO_SERVER_PORT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and f"{env} must be a positive number" in result.stderr
    assert "Traceback" not in result.stderr


def test_posterior_chart_draws_one_line_per_candidate_plus_the_residual():
    import app as brag_app

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
    svg = brag_app.posterior_svg(report)
    assert svg.count('class="series"') == 3 and "A&lt;b&gt;" in svg and "<b>" not in svg
    assert "3·stop" in svg
    assert "appears here" in brag_app.posterior_svg({})


# ---------------------------------------------------------------------------------- concurrency


def slow(request: dict) -> Reply:
    reply = scripted(request)
    reply.delay = 0.5
    return reply


def timed_burst(url: str, n: int = 8) -> tuple[float, float]:
    """Seconds for one request alone, then for n at once (each client its own connection)."""
    clients = [Client(url, verbose=False) for _ in range(n)]
    clients[0].predict(*args(), api_name="/brag")  # warm-up: first index of the documents
    singles = []
    for c in clients[:2]:
        started = time.monotonic()
        c.predict(*args(), api_name="/brag")
        singles.append(time.monotonic() - started)
    single = min(singles)
    barrier = threading.Barrier(n)

    def one(c: Client) -> str:
        barrier.wait()
        return c.predict(*args(), api_name="/brag")[0]

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(one, clients))
    assert answers == ["Bergen"] * n
    return single, time.monotonic() - started


@pytest.mark.parametrize("limit", [16, 1])
def test_requests_run_in_parallel_up_to_brag_concurrency(limit):
    with (
        FakeOpenAI(handler=slow) as server,
        AppProcess({"BRAG_MODEL": server.url + "#m", "BRAG_CONCURRENCY": str(limit)}) as app,
    ):
        single, burst = timed_burst(app.url)
    if limit == 16:
        assert burst < 3 * single, (single, burst)  # 8 requests in far less than 8x one
    else:
        assert burst > 0.8 * 8 * single, (single, burst)  # one at a time


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
        job = client.submit(
            *args(documents=long_read, question="Who designed the Glass Tower?"), api_name="/brag"
        )
        time.sleep(2.0)  # the worker is now reading a prompt of 2,000 tokens
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
    assert answer == "Bergen" and report["corpus"] == "MuSiQue"
    assert len(downloads) == 1 and downloads[0][1].endswith("/musique_corpus.json")
    assert list((tmp_path / "hf").rglob("musique_corpus.json"))  # cached on disk by huggingface_hub


# ---------------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian chromium not installed (.ci/run installs it)"
)
def test_a_real_browser_asks_and_sees_the_answer(app, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
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
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(app.url, wait_until="domcontentloaded")
        page.get_by_label("Question").first.fill(QUESTION)
        page.get_by_role("button", name="Ask").click()
        page.locator("#answer h2").filter(has_text="Bergen").wait_for(timeout=45_000)
        page.get_by_text("LLM calls").first.wait_for(timeout=15_000)
        assert page.locator("#posterior-chart polyline.series").count() >= 2
        shot = tmp_path / "brag.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000
    (ROOT / ".pytest_cache").mkdir(exist_ok=True)
    shutil.copy(shot, ROOT / ".pytest_cache" / "brag-browser.png")
