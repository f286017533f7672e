"""The app's parts without the page: the request checks stand without Gradio, and the server
turns their refusals into the page's errors in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest

import bragkit.serving.callers
import bragkit.serving.inputs
import bragkit.serving.limits
import bragkit.serving.models
import bragkit.serving.redaction
import bragkit.serving.server

ROOT = Path(__file__).resolve().parent.parent


def test_the_request_checks_import_and_refuse_without_gradio():
    blocked = (
        "import sys; sys.modules['gradio'] = None\n"
        "from bragkit.serving import callers, inputs, limits, models, redaction\n"
        "try:\n"
        "    inputs.check_question('  ', limits.Limits())\n"
        "except limits.RequestRefused as err:\n"
        "    print(type(err).__mro__[1].__name__, err)\n"
        "print('gradio' in sys.modules and sys.modules['gradio'] is not None)\n"
    )
    result = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["ValueError The question is empty.", "False"]


def test_a_refusal_reaches_the_page_as_a_gradio_error(tmp_path):
    server = bragkit.serving.server.Server(bragkit.serving.server.Settings(cache_dir=tmp_path))
    with pytest.raises(gr.Error, match="The question is empty") as refused:
        list(server.run_brag("", "Demo", "", 0.05, "local", "", "", ""))
    assert not isinstance(refused.value, bragkit.serving.limits.RequestRefused)
    with pytest.raises(gr.Error, match="λ must lie between 0 and 10"):
        list(server.run_brag("Where?", "Demo", "", 99, "local", "", "", ""))


def test_a_refusal_leaves_the_server_escaped_and_without_its_secrets(tmp_path):
    secrets = bragkit.serving.redaction.Secrets(["sk-owner-secret-1234"])
    server = bragkit.serving.server.Server(
        bragkit.serving.server.Settings(cache_dir=tmp_path, secrets=secrets)
    )
    calibration = '{"version": "<b>sk-owner-secret-1234</b>"}'
    with pytest.raises(gr.Error) as refused:
        list(server.run_brag("Where?", "Demo", "", 0.05, "local", "", "", calibration))
    message = refused.value.message  # the refusal quotes the value: scrubbed, then escaped
    assert "sk-owner-secret-1234" not in message and "&lt;b&gt;***&lt;/b&gt;" in message


def test_an_ask_request_is_built_by_keyword():
    with pytest.raises(TypeError):
        bragkit.serving.server.AskRequest("Where?", "Demo")  # type: ignore[misc]
    ask = bragkit.serving.server.AskRequest(question="Where?", corpus="Demo")
    assert (ask.question, ask.corpus, ask.files) == ("Where?", "Demo", None)


# ------------------------------------------------------------- issue 41: the public app, fourth round

import asyncio
import json
import threading
from types import SimpleNamespace

import orjson
from app_server import call_asgi

import brag
import bragkit.serving.guards
from bragkit import llms
from bragkit.serving import uploads

EXPANDS = "\ufdfa"  # NFKC: 18 characters


def test_pasted_text_and_questions_are_counted_in_the_form_brag_reads():
    limits = bragkit.serving.limits.Limits(documents_bytes=100_000, question_chars=100)
    # Within the byte limit as written (3 bytes each), 18 times over it once normalised.
    with pytest.raises(
        bragkit.serving.limits.RequestRefused, match=r"once normalised .*BRAG_MAX_DOCUMENTS_BYTES"
    ):
        bragkit.serving.inputs.check_documents(EXPANDS * 20_000, limits)
    with pytest.raises(
        bragkit.serving.limits.RequestRefused, match="once normalised"
    ):  # escaped in JSON, too
        bragkit.serving.inputs.check_documents(json.dumps([{"title": "t", "text": EXPANDS * 6_000}]), limits)
    assert len(bragkit.serving.inputs.check_documents("plain words\n" * 8_000, limits)) == 8_000
    assert bragkit.serving.inputs.check_documents(
        "ﬁle ＡＢＣ １２３ カタカナ" * 100, limits
    )  # NFKC-changed, not grown
    with pytest.raises(bragkit.serving.limits.RequestRefused, match="BRAG_MAX_QUESTION_CHARS"):
        bragkit.serving.inputs.check_question(EXPANDS * 10, limits)
    assert bragkit.serving.inputs.check_question("Where?" * 10, limits)


def test_calibration_questions_and_their_gold_are_bounded_like_a_question():
    limits = bragkit.serving.limits.Limits(question_chars=100, labelled_min=2)
    good = [{"question": "Where?", "gold": ["Bergen"]}] * 2
    assert len(bragkit.serving.inputs.read_labelled(json.dumps(good), limits)) == 2
    long_question = [*good, {"question": "x" * 101, "gold": ["a"]}]
    with pytest.raises(
        bragkit.serving.limits.RequestRefused, match=r"Question 3: 101 characters.*QUESTION_CHARS"
    ):
        bragkit.serving.inputs.read_labelled(json.dumps(long_question), limits)
    long_gold = [*good, {"question": "Where?", "gold": ["y" * 5_000]}]
    with pytest.raises(
        bragkit.serving.limits.RequestRefused, match="Question 3: a gold answer of 5,000 characters"
    ):
        bragkit.serving.inputs.read_labelled(json.dumps(long_gold), limits)


def test_a_report_is_json_that_any_encoder_takes():
    nested: list = []
    for _ in range(300):
        nested = [nested]
    hostile = {"name": 2**64, "usage": 2**70, "date": nested, "p": float("nan"), 5: {"x": 10**5000}}
    safe = bragkit.serving.redaction.json_safe(hostile)
    assert json.loads(orjson.dumps(safe)) == json.loads(json.dumps(safe))  # orjson takes it whole
    assert safe["name"] == "(an integer of 65 bits)" and safe["p"] is None and "5" in safe
    depth, value = 0, safe["date"]
    while isinstance(value, list):
        depth, value = depth + 1, value[0]
    assert depth < bragkit.serving.redaction.MAX_JSON_DEPTH and value == "(nested too deeply)"
    plain = {"answer": "Bergen", "steps": [{"p": 0.5, "calls": 3}], "ok": True, "none": None}
    assert bragkit.serving.redaction.json_safe(plain) == plain


def caller(address: str, session: str):
    return SimpleNamespace(client=SimpleNamespace(host=address), headers={}, session_hash=session)


def test_an_endpoint_with_slots_of_its_own_gives_each_address_its_share():
    limits = bragkit.serving.callers.CallerLimits(per_session=5, per_address=5, shares={"calibrate": 1})
    with limits.slot(caller("198.51.100.1", "a"), "calibrate"):
        with pytest.raises(bragkit.serving.limits.RequestRefused, match="1 /calibrate request"):
            with limits.slot(caller("198.51.100.1", "b"), "calibrate"):
                pass
        with limits.slot(caller("198.51.100.1", "c")):  # /brag: the address's other slots
            pass
        with limits.slot(caller("198.51.100.2", "d"), "calibrate"):  # another address
            pass
    assert not limits._running


def asgi_echo(seen: list):
    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_only_brag_and_calibrate_take_a_body_past_the_helpers_bound():
    seen: list[bytes] = []
    large = lambda fn_index, name: fn_index == 7 or name in ("brag", "calibrate")  # noqa: E731
    guard = bragkit.serving.guards.RequestSizeLimit(
        asgi_echo(seen), max_bytes=100_000, max_files=10, helper_bytes=1_000, large=large
    )
    big = {"data": ["x" * 5_000], "session_hash": "s"}
    for fn_index, status in ((7, 200), (3, 413), (None, 413)):
        body = json.dumps({**big, "fn_index": fn_index}).encode()
        assert call_asgi(guard, "/gradio_api/queue/join", body, chunk=700)[0] == status, fn_index
    assert seen == [json.dumps({**big, "fn_index": 7}).encode()]  # handed on whole, unchanged
    # A repeated key means what Gradio's parser makes of it: the last one.
    twice = b'{"fn_index": 7, "data": ["' + b"x" * 5_000 + b'"], "fn_index": 3}'
    assert call_asgi(guard, "/gradio_api/queue/join", twice)[0] == 413
    small = json.dumps({"data": ["x"], "fn_index": 3}).encode()
    assert call_asgi(guard, "/gradio_api/queue/join", small)[0] == 200
    status, answer = call_asgi(guard, "/gradio_api/call/render", json.dumps(big).encode())
    assert status == 413 and b"BRAG_MAX_HELPER_BYTES" in answer
    assert call_asgi(guard, "/gradio_api/call/brag", json.dumps(big).encode())[0] == 200
    assert call_asgi(guard, "/gradio_api/call/v2/calibrate", json.dumps(big).encode())[0] == 200


def queue_of(*addresses: str, running: tuple[str, ...] = ()):
    def event(address: str):
        return SimpleNamespace(request=SimpleNamespace(client=SimpleNamespace(host=address), headers={}))

    waiting = SimpleNamespace(queue=[event(a) for a in addresses])
    queue = SimpleNamespace(
        event_queue_per_concurrency_id={"default": waiting},
        active_jobs=[[event(a)] for a in running] + [None],
    )
    return SimpleNamespace(_queue=queue)


def test_one_address_holds_at_most_its_share_of_the_queue():
    seen: list[bytes] = []
    blocks = queue_of("192.0.2.9", "192.0.2.9", "198.51.100.1", running=("192.0.2.9",))
    share = bragkit.serving.guards.EventShare(asgi_echo(seen), blocks, uploads.Proxies(), limit=3)
    status, answer = call_asgi(
        share, "/gradio_api/queue/join", b"{}"
    )  # three already: two waiting, one running
    assert status == 429 and b"BRAG_MAX_QUEUED_PER_ADDRESS" in answer
    assert call_asgi(share, "/gradio_api/call/brag", b"{}")[0] == 429
    assert call_asgi(share, "/gradio_api/queue/join", b"{}", client=("198.51.100.1", 1))[0] == 200
    assert call_asgi(share, "/gradio_api/info", b"")[0] == 200  # no event: not counted
    blocks._queue.active_jobs = [None]
    assert call_asgi(share, "/gradio_api/queue/join", b"{}")[0] == 200  # one finished


def test_a_cancel_is_recorded_as_it_arrives_and_no_deep_link_is_made():
    seen: list[bytes] = []
    cancels = bragkit.serving.server.RecentIds(size=2)
    routes = bragkit.serving.guards.PublicRoutes(asgi_echo(seen), queue_size=64, cancelled=cancels.add)
    body = json.dumps({"session_hash": "s", "fn_index": 3, "event_id": "e1"}).encode()
    assert call_asgi(routes, "/gradio_api/cancel", body) == (200, b"ok")
    assert "e1" in cancels and seen == [body]  # recorded, and Gradio still gets the cancel
    for event in ("e2", "e3"):
        cancels.add(event)
    assert "e1" not in cancels and "e3" in cancels  # only the newest are kept
    assert call_asgi(routes, "/gradio_api/cancel", b"x" * 20_000)[0] == 413
    assert call_asgi(routes, "/gradio_api/deep_link")[0] == 404 and len(seen) == 1


def test_a_session_keeps_none_of_an_events_values():
    from gradio.state_holder import SessionState

    with bragkit.serving.guards.Blocks() as demo:
        documents, answer = gr.Textbox(), gr.Textbox()
        documents.submit(lambda text: text[:5], documents, answer)
    state = SessionState(demo)
    output = asyncio.run(demo.process_api(0, ["x" * 1_000_000], state=state))
    assert output["data"] == ["xxxxx"]
    assert not state.config_values  # neither the megabyte sent nor the answer is kept
    assert not any("x" * 1_000 in repr(c) for c in state.components)


def test_what_the_page_and_the_guards_derive_from_their_source(tmp_path):
    import app as brag_app
    import bragkit.serving.presentation

    demo = brag_app.build(bragkit.serving.server.Settings(cache_dir=tmp_path))
    optional = {fn.name: bragkit.serving.guards.optional_inputs(fn) for fn in demo.fns.values()}
    assert (
        optional["run_brag"] == 4 and optional["run_calibrate"] == 2
    )  # cost, prices, files; files, self_test
    widths = bragkit.serving.presentation.step_column_widths()
    assert len(widths) == len(bragkit.serving.presentation.STEP_COLUMNS)
    assert abs(sum(float(w.rstrip("%")) for w in widths) - 100) < 0.5
    assert ".jsonl" in brag_app._file_input().label and all(
        s in brag_app._file_input().label for s in brag_app.doc_files.SUFFIXES
    )


def test_the_pool_reads_a_model_string_as_make_llm_does_and_refuses_what_it_does_not_know(
    tmp_path, monkeypatch
):
    from bragkit import llms

    pool = bragkit.serving.server.Server(bragkit.serving.server.Settings(cache_dir=tmp_path)).llms
    for text in ("not a model", "ftp://host/v1", "org/name/extra"):
        with pytest.raises(ValueError) as made:
            llms.make_llm(text)
        with pytest.raises(bragkit.serving.limits.RequestRefused) as refused:
            pool.get(text, "", "")
        assert str(refused.value) == str(made.value)  # one parser, one message
    # A kind the parser learns later is refused here until the pool knows whose keys it may use.
    built = []
    monkeypatch.setattr(llms, "parse_model", lambda text: llms.ModelSpec(text, "future"))
    monkeypatch.setattr(llms, "make_llm", lambda *a, **k: built.append(a))
    with pytest.raises(bragkit.serving.limits.RequestRefused, match="future models are not offered"):
        pool.get("future:thing", "", "")
    assert built == []


def test_only_brags_own_errors_and_the_backends_reach_a_caller_with_their_text():
    import brag
    from bragkit import llms

    for err, shown in (
        (brag.InputError("question is empty"), "question is empty"),
        (brag.CalibrationError("calibration: eta must be a number"), "calibration: eta must be a number"),
        (llms.RateLimited("rate limited by x (HTTP 429)"), "rate limited by x (HTTP 429)"),
    ):
        assert str(bragkit.serving.server._failure(err)) == shown
    for bug in (ValueError("/srv/app/secret.json: bad"), json.JSONDecodeError("Expecting", "/etc/x", 0)):
        message = str(bragkit.serving.server._failure(bug))
        assert message.startswith("Internal error (") and "/srv" not in message and "/etc" not in message
    report = {"totals": {"llm_calls": 1}, "answer": ""}
    for cause, shown in (
        (llms.LLMTimeout("no answer in time"), "no answer in time"),
        (KeyError("/tmp/k"), "KeyError"),
    ):
        try:
            raise brag.RunAborted(f"R1 failed: {cause}", report, "R1") from cause
        except brag.RunAborted as aborted:
            message = str(bragkit.serving.server._failure(aborted))
        assert message.startswith("R1 failed") and shown in message and ("/tmp/k" not in message)


def test_the_owner_turns_self_tests_off_or_bounds_them(monkeypatch):
    monkeypatch.setenv("BRAG_SELF_TEST", "off")
    monkeypatch.setenv("BRAG_SELF_TEST_QUESTIONS", "12")
    monkeypatch.setenv("BRAG_SELF_TEST_SECONDS", "300")
    monkeypatch.setenv("BRAG_SELF_TEST_MODEL", "local")
    settings = bragkit.serving.server.Settings.from_env()
    assert settings.self_test is False and settings.self_test_model == "local"
    assert (settings.limits.self_test_questions, settings.limits.self_test_seconds) == (12, 300.0)
    monkeypatch.setenv("BRAG_SELF_TEST", "sometimes")
    with pytest.raises(SystemExit, match="BRAG_SELF_TEST must be on or off"):
        bragkit.serving.server.Settings.from_env()
    monkeypatch.setenv("BRAG_SELF_TEST", "on")
    monkeypatch.setenv("BRAG_SELF_TEST_QUESTIONS", "0")
    with pytest.raises(SystemExit, match="BRAG_SELF_TEST_QUESTIONS"):
        bragkit.serving.server.Settings.from_env()


def test_a_self_test_needs_no_questions_and_takes_labelled_ones_beside_it():
    limits = bragkit.serving.limits.Limits()
    assert bragkit.serving.inputs.read_labelled("", limits, self_test=True) == []
    one = '[{"question": "Which port?", "gold": ["8421"]}]'
    assert [i.gold for i in bragkit.serving.inputs.read_labelled(one, limits, self_test=True)] == [("8421",)]
    with pytest.raises(bragkit.serving.limits.RequestRefused, match="at least 30"):
        bragkit.serving.inputs.read_labelled(one, limits)


# ------------------------------------------------------------------------------------------
# Self-tests and kept fits on a public server (issue 50)
# ------------------------------------------------------------------------------------------


def calibrate_queue(waiting: dict[str, int], running: tuple[str, ...] = ()):
    """A Gradio queue holding /calibrate events of the given addresses, waiting and running."""

    def event(address: str, group: str = "calibrate"):
        request = SimpleNamespace(client=SimpleNamespace(host=address), headers={})
        return SimpleNamespace(request=request, concurrency_id=group)

    line = SimpleNamespace(queue=[event(a) for a, n in waiting.items() for _ in range(n)])
    queue = SimpleNamespace(
        event_queue_per_concurrency_id={"calibrate": line, "default": SimpleNamespace(queue=[])},
        active_jobs=[[event(a)] for a in running] + [None],
    )
    return SimpleNamespace(_queue=queue)


def calibrate_guard(blocks, seen: list, settle: float = 0.0):
    """The app's chain: the size guard learns a queue/join's event, the share bounds it (fn 5: /calibrate)."""
    share = bragkit.serving.guards.EventShare(
        asgi_echo(seen),
        blocks,
        uploads.Proxies(),
        limit=20,
        groups={"calibrate": (1, 3)},
        group_of=lambda fn_index, name: "calibrate" if fn_index == 5 or name == "calibrate" else "default",
        settle=settle,
    )
    return bragkit.serving.guards.RequestSizeLimit(share, max_bytes=100_000, helper_bytes=1_000)


def test_calibrate_events_have_their_own_bound_per_address_and_in_all_before_the_queue():
    seen: list[bytes] = []
    join = json.dumps({"data": [], "fn_index": 5, "session_hash": "s"}).encode()
    guard = calibrate_guard(calibrate_queue({"192.0.2.9": 1}), seen)
    status, answer = call_asgi(guard, "/gradio_api/queue/join", join)  # its one is waiting
    assert status == 429 and b"/calibrate" in answer
    assert call_asgi(guard, "/gradio_api/call/calibrate", b"{}")[0] == 429  # by name, the same
    assert call_asgi(guard, "/gradio_api/call/brag", b"{}")[0] == 200  # /brag is not bounded by it
    assert call_asgi(guard, "/gradio_api/queue/join", join, client=("198.51.100.1", 1))[0] == 200
    # Three waiting or running in all: another address is refused too, and told why.
    full = calibrate_guard(
        calibrate_queue({"198.51.100.2": 1, "198.51.100.3": 1}, running=("198.51.100.4",)), seen
    )
    status, answer = call_asgi(full, "/gradio_api/queue/join", join, client=("198.51.100.1", 1))
    assert status == 429 and b"BRAG_MAX_CALIBRATE_QUEUE" in answer
    other = json.dumps({"data": [], "fn_index": 2, "session_hash": "s"}).encode()
    assert call_asgi(full, "/gradio_api/queue/join", other, client=("198.51.100.1", 1))[0] == 200


def test_a_calibrate_event_waits_for_the_callers_last_one_to_leave_before_it_is_refused():
    seen: list[bytes] = []
    blocks = calibrate_queue({}, running=("192.0.2.9",))  # its last one, finishing
    join = json.dumps({"data": [], "fn_index": 5, "session_hash": "s"}).encode()
    threading.Timer(0.2, lambda: blocks._queue.active_jobs.clear()).start()
    assert call_asgi(calibrate_guard(blocks, seen, settle=30.0), "/gradio_api/queue/join", join)[0] == 200


def test_an_opened_result_stream_is_recorded_by_session_or_event():
    watched: list[tuple[str, bool]] = []
    routes = bragkit.serving.guards.PublicRoutes(
        asgi_echo([]), queue_size=64, watched=lambda *k: watched.append(k)
    )
    call_asgi(routes, "/gradio_api/queue/data", method="GET", query=b"session_hash=abc123")
    call_asgi(routes, "/gradio_api/call/calibrate/ev42", method="GET")
    call_asgi(routes, "/gradio_api/call/calibrate", b"{}")  # posting an event is not watching it
    call_asgi(routes, "/gradio_api/queue/data", method="GET", query=b"session_hash=" + b"x" * 500)
    assert watched == [("abc123", False), ("ev42", True)]


def test_only_a_session_gradio_holds_is_watched_and_made_up_ones_push_none_out():
    streams = bragkit.serving.server.WatchedStreams(size=3)
    held = {"honest"}
    streams.live = held.__contains__
    streams.add("honest")
    for i in range(100):  # streams opened for sessions that joined nothing
        streams.add(f"made-up-{i}")
    for i in range(3):  # sessions that did join, then ended
        held.add(f"real-{i}")
        streams.add(f"real-{i}")
        held.discard(f"real-{i}")
    assert "honest" in streams and "made-up-7" not in streams


def _server_for(tmp_path, model: str, **limits) -> bragkit.serving.server.Server:
    """A server in this process that may call ``model`` (a loopback endpoint), with these limits."""
    from bragkit.serving.models import EndpointPolicy, ModelPolicy

    settings = bragkit.serving.server.Settings(
        cache_dir=tmp_path,
        endpoints=EndpointPolicy(allow_all=True),
        models=ModelPolicy(model),
        limits=bragkit.serving.limits.Limits(**limits),
    )
    return bragkit.serving.server.Server(settings)


def test_a_self_test_fit_applies_to_the_session_that_made_it_only():
    fits = bragkit.serving.callers.SessionFits(limit=4, per_address=2)
    fits.remember("tab-a", "192.0.2.9", "m", "corpus", "fit-aaaaaaaaaaaa")
    assert fits.recall("tab-a", "192.0.2.9", "m", "corpus") == "fit-aaaaaaaaaaaa"
    assert fits.recall("tab-b", "192.0.2.9", "m", "corpus") is None
    assert fits.recall("tab-a", "192.0.2.9", "other", "corpus") is None
    fits.remember("", "192.0.2.9", "m", "corpus", "fit-bbbbbbbbbbbb")  # no session: nothing to apply to
    for i in range(5):  # another address's many sessions
        fits.remember(f"x{i}", "203.0.113.5", "m", "corpus", "fit-cccccccccccc")
    assert fits.recall("tab-a", "192.0.2.9", "m", "corpus") == "fit-aaaaaaaaaaaa"


def test_a_session_hash_sent_from_another_address_carries_no_self_test_fit():
    # Round 6, finding 2: the hash is the caller's to send, so it cannot be what binds a fit.
    fits = bragkit.serving.callers.SessionFits()
    fits.remember("victim-tab", "192.0.2.9", "m", "corpus", "fit-aaaaaaaaaaaa")
    assert fits.recall("victim-tab", "203.0.113.5", "m", "corpus") is None
    assert fits.recall("victim-tab", "192.0.2.9", "m", "corpus") == "fit-aaaaaaaaaaaa"
    # Nor does a fit made from elsewhere under the victim's hash reach, or replace, the victim's.
    fits.remember("victim-tab", "203.0.113.5", "m", "corpus", "fit-hostilehostile")
    assert fits.recall("victim-tab", "192.0.2.9", "m", "corpus") == "fit-aaaaaaaaaaaa"


@pytest.mark.parametrize("port", ["+8443", "８４４３", "99999", "-1"])
def test_a_model_url_whose_port_cannot_be_read_is_refused_clearly(port):
    with pytest.raises(brag.InputError, match="port must be a number"):
        llms.parse_model(f"https://h:{port}/v1#m")
    pool = bragkit.serving.models.LLMPool(
        bragkit.serving.models.EndpointPolicy(("https://h:8443/v1",)),
        bragkit.serving.models.ModelPolicy("local"),
    )
    with pytest.raises(bragkit.serving.limits.RequestRefused, match="port must be a number"):
        pool.get(f"https://h:{port}/v1#m", "", "auto")
    assert llms.redact_url(llms.parse_model("https://u:p@h:8443/v1#m").text) == "https://***@h:8443/v1#m"


# ------------------------------------------------------------- issue 52: the documents fit


def test_uploads_and_pasted_text_get_the_documents_fit_named_corpora_keep_theirs_and_a_self_test_refines_it(
    tmp_path,
):
    import selftest_reader
    from openai_server import FakeOpenAI, Reply

    def reader(request: dict) -> Reply:
        return Reply(texts=selftest_reader.replies(request["messages"], int(request.get("n") or 1)))

    with FakeOpenAI(handler=reader) as llm_server:
        model = llm_server.url + "#docs"
        server = _server_for(tmp_path, model, self_test_questions=10)
        name = brag.llm_name(llms.make_llm(model))
        prior = brag.shipped_calibrations()["prior"].to_dict()
        fitted = {**prior, "fitted": True, "model": name}
        server.shipped = {
            "prior": brag.load_calibration(prior),
            "pooled": brag.load_calibration({**fitted, "corpus": brag.POOLED, "pooled_from": ["HotpotQA"]}),
            "documents": brag.load_calibration(
                {**fitted, "name": brag.DOCUMENTS, "corpus": brag.DOCUMENTS, "pooled_from": ["bash"]}
            ),
        }
        pasted = "\n".join(selftest_reader.SENTENCES)
        question = "Which folder does Garply write a crash report to?"

        def calibration_of(corpus: str, documents: str) -> dict:
            *_, (_, report) = server.run_brag(question, corpus, documents, 0.05, model, "", "auto", "")
            return report["server"]["calibration"]

        assert calibration_of("", pasted)["corpus"] == brag.DOCUMENTS
        assert "the documents fit for this model" in calibration_of("", pasted)["status"]
        assert calibration_of("Demo", "")["corpus"] == brag.POOLED  # a named corpus is not "your documents"
        # A self-test of the pasted text refines the documents fit, not the benchmark one.
        refit = json.loads(server.run_calibrate("", "", pasted, model, "", "auto", None, True))
        assert refit["refit_of"] == brag.DOCUMENTS and refit["fitted_on"]["questions"] == 10


# ------------------------------------------------------------- issue 61: a documentation tree in one upload


def tree_reader(request: dict) -> object:
    """Reads answer Bergen when the Lina Berg passage is in the prompt; closed-book samples say NONE."""
    from openai_server import Reply

    content = request["messages"][-1]["content"]
    if "Passages:" in content:
        found = "born in Bergen" in content.rsplit("\n\nPassages:\n", 1)[-1]
        return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg" if found else "Answer: NONE"])
    return Reply(texts=["NONE"] * int(request.get("n") or 1))


def uploaded(files: list[tuple[str, bytes]]) -> list[str]:
    """Files as Gradio stores uploads: each in a folder of its own under the upload folder."""
    import uuid

    paths = []
    for name, data in files:
        folder = bragkit.serving.server.upload_folder() / f"brag-test-{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        (folder / name).write_bytes(data)
        paths.append(str(folder / name))
    return paths


def test_many_files_are_read_one_by_one_in_progress_and_those_not_read_are_listed(tmp_path):
    from document_files import html_page, pdf_bytes, zip_bytes
    from openai_server import FakeOpenAI

    tree = [(f"html/page{i}.html", html_page(i)) for i in range(40)]
    tree += [
        ("html/people.html", html_page(99, "Lina Berg was born in Bergen.")),
        ("img/logo.png", b"\x89PNG"),
    ]
    files = [
        ("manual.zip", zip_bytes([*tree, ("html/broken.pdf", b"%PDF-1.4 junk")])),
        ("notes.md", b"# Notes\n\nOslo is the capital of Norway.\n"),
        ("scan.pdf", pdf_bytes([""])),  # no text: a scan
        ("huge.txt", b"words " * 2_000),
    ]
    with FakeOpenAI(handler=tree_reader) as llm_server:
        model = llm_server.url + "#tree"
        server = _server_for(tmp_path, model, file_bytes=10_000)
        said: list[str] = []
        ask = ("Where was Lina Berg born?", "", "", 0.05, model, "", "auto", "", "tokens", None, None)
        *_, (answer, report) = server.run_brag(
            *ask, uploaded(files), progress=lambda fraction, desc="": said.append(desc)
        )
        assert answer == "Bergen"
        assert said[0] == "Reading 1 of 44: manual.zip/html/page0.html"
        assert (
            said[41] == "Reading 42 of 44: manual.zip/html/broken.pdf"
            and said[-1] == "Reading 44 of 44: scan.pdf"
        )
        assert report["server"]["corpus"] == "manual.zip, notes.md, scan.pdf"  # the files read
        names = [f"page{i}.html" for i in range(300)]
        assert (
            bragkit.serving.server.files_label(names)
            == "page0.html, page1.html, page2.html and 297 more files"
        )
        read = report["server"]["files"]
        assert (read["read"], read["not_read_count"], read["skipped_types"]) == (42, 3, {".png": 1})
        assert read["not_read"] == [
            {"file": "huge.txt", "reason": "12,000 bytes, over the limit of 10,000 (BRAG_MAX_FILE_BYTES)"},
            {"file": "manual.zip/html/broken.pdf", "reason": "not a readable PDF (PdfStreamError)"},
            {"file": "scan.pdf", "reason": "no text found (a scanned PDF holds images, not text)"},
        ]
        _, headline, *_ = bragkit.serving.presentation.render(answer, report)
        assert "**Files:** 42 read" in headline and "**3 not read**" in headline
        assert r"- manual\.zip\/html\/broken\.pdf: not a readable PDF \(PdfStreamError\)" in headline
        # No file readable at all: a clear error naming each, and why.
        with pytest.raises(
            gr.Error, match=r"No file could be read: broken\.docx: not a readable Word .*; scan\.pdf"
        ):
            list(server.run_brag(*ask, uploaded([("broken.docx", b"PK\x03\x04 junk"), files[2]])))
        with pytest.raises(gr.Error, match=r"No file could be read: pics\.zip/a\.png: not a type BRAG reads"):
            list(server.run_brag(*ask, uploaded([("pics.zip", zip_bytes([("a.png", b"\x89PNG")]))])))
