"""The fifth security review's probes (issue 50): self-tests that cannot hold the server.

One app of the lab (``selftest``) serves them: behind a proxy that appends the caller's address
("*", as a Space's does), four workers, one /calibrate slot, self-tests of ten questions bounded
at ``SELF_TEST_SECONDS``, and loopback endpoints that pass a self-test's checks
(``tests/selftest_reader.py``) at several paces. ``security_probes.probes()`` runs these with
the others; each cleans up after itself on the fixed code, so the next one starts afresh.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import urllib.request
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from app_server import AppProcess
from openai_server import FakeOpenAI, Reply
from selftest_reader import GENERATOR, SENTENCES, replies

import brag

CLOSED_BOOK = brag.CLOSED_BOOK_INSTRUCTIONS

ST_DOCS = "\n".join(SENTENCES)
SELF_TEST_SECONDS = 20
PROMPT_CHARS = 150_000
KEPT_FITS, KEPT_PER_ADDRESS = 10, 3
GRACE = 10.0  # serving.server.STREAM_GRACE
QUESTION = "Where was the architect of the Glass Tower born?"
DOCS = "The Glass Tower was designed by Lina Berg.\nLina Berg was born in Bergen in 1961."


def reader_reply(request: dict[str, Any], owner: Callable[[dict[str, Any]], Reply]) -> Reply:
    """A self-test's questions and reads as selftest_reader answers them; anything else as ``owner``."""
    messages = request["messages"]
    system, question = messages[0]["content"], messages[-1]["content"].rsplit("Question: ", 1)[-1]
    if system.startswith(GENERATOR) or "'" in question:
        return Reply(texts=replies(messages, int(request.get("n") or 1)))
    return owner(request)


def long_questions(request: dict[str, Any], owner: Callable[[dict[str, Any]], Reply]) -> Reply:
    """A caller's endpoint whose questions hold a word of 900,000 characters, and pass every check."""
    messages = request["messages"]
    if messages[0]["content"].startswith(GENERATOR):
        cloze = messages[-1]["content"].removeprefix("Sentence: ")
        return Reply(texts=[f"Question: What completes '{cloze}' in {'x' * 900_000}?"])
    return reader_reply(request, owner)


SLOW_READ = 25.0  # seconds a slow endpoint takes for a five-passage read or closed-book samples


def slow_reads(request: dict[str, Any], owner: Callable[[dict[str, Any]], Reply]) -> Reply:
    """Questions and one-passage reads at once; five-passage reads and closed-book calls in ``SLOW_READ``.

    So a self-test writes its questions quickly, then spends its time running the actions on them.
    """
    messages = request["messages"]
    if "\n[2] " in messages[-1]["content"] or messages[0]["content"].startswith(CLOSED_BOOK):
        time.sleep(SLOW_READ)
    return reader_reply(request, owner)


def start_selftest_app(
    stack: ExitStack, start: Callable[..., AppProcess], owner: Callable[[dict[str, Any]], Reply]
) -> tuple[AppProcess, dict[str, FakeOpenAI]]:
    """The app these probes use, and its endpoints by name."""

    def paced(seconds: float, handler: Callable = reader_reply) -> FakeOpenAI:
        reply = lambda r: (time.sleep(seconds), handler(r, owner))[1]  # noqa: E731
        return stack.enter_context(FakeOpenAI(handler=reply))

    ends = {
        "writer": paced(0.1),
        "steady": paced(0.4),
        "crawl": stack.enter_context(FakeOpenAI(handler=lambda r: slow_reads(r, owner))),
        "fast": paced(0.0),
        "longq": paced(0.0, long_questions),
    }
    app = start(
        "selftest",
        BRAG_MODEL=ends["writer"].url + "#st",
        BRAG_ALLOWED_ENDPOINTS=",".join(e.url for e in ends.values()),
        BRAG_TRUSTED_PROXIES="*",
        BRAG_CONCURRENCY="4",
        BRAG_REQUEST_TIMEOUT="120",
        BRAG_SELF_TEST_QUESTIONS="10",
        BRAG_SELF_TEST_SECONDS=str(SELF_TEST_SECONDS),
        BRAG_SELF_TEST_PROMPT_CHARS=str(PROMPT_CHARS),
        BRAG_MAX_KEPT_FITS=str(KEPT_FITS),
        BRAG_MAX_KEPT_FITS_PER_ADDRESS=str(KEPT_PER_ADDRESS),
    )
    return app, ends


def via(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


def post(url: str, api: str, data: list[Any], headers: dict[str, str], session: str = "") -> str:
    """POST a REST call without reading its result: "event: <id>", or the refusal."""
    from security_probes import rest_post

    return rest_post(url, api, data, headers, session)


def result(url: str, api: str, data: list[Any], headers: dict[str, str], session: str = "") -> str:
    """One REST call read to its end: "complete: <data>" or "error: <why>"."""
    event = post(url, api, data, headers, session)
    if not event.startswith("event: "):
        return event
    stream = urllib.request.urlopen(
        urllib.request.Request(f"{url}gradio_api/call/{api}/{event[7:]}", headers=headers), timeout=300
    )
    kind = ""
    with stream:
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and kind in ("complete", "error"):
                return f"{kind}: {line.split(':', 1)[1].strip()}"
    return "error: no result"


def self_test_args(documents: str = ST_DOCS, model: str = "") -> list[Any]:
    return ["", "", documents, model, "", "auto", None, True]


def brag_args(documents: str = DOCS, question: str = QUESTION, model: str = "") -> list[Any]:
    return [question, "", documents, 0.05, model, "", "auto", ""]


def status_of(answer: str) -> str:
    """The calibration status of a /brag result ("complete: [answer, report]")."""
    if not answer.startswith("complete: "):
        return answer[:200]
    return json.loads(answer.split(": ", 1)[1])[1]["server"]["calibration"]["status"]


def settle(seconds: float = GRACE + 8) -> None:
    """Wait for what a probe left queued to go: an event nobody watches is gone after the grace."""
    time.sleep(seconds)


def queue_crowded(lab: Any) -> str:
    """50.1: 90 self-tests POSTed to /call/calibrate from five addresses, no stream opened.

    Each address may have 18 events queued here (its share of four workers and a quarter of the
    queue of 64): five of them hold more than the whole queue.
    """
    url = lab.selftest.url
    posted = [post(url, "calibrate", self_test_args(), via(f"203.0.113.{10 + i % 5}")) for i in range(90)]
    answers, waits = [], []
    for _ in range(5):
        started = time.monotonic()
        answers.append(result(url, "brag", brag_args(), via("198.51.100.50")))
        waits.append(time.monotonic() - started)
    settle()
    refused = sum("HTTP 429" in p for p in posted)
    answered = sum(a.startswith('complete: ["Bergen"') for a in answers)
    return (
        f"A: {refused} of 90 refused at the door · B: {answered} of {len(answers)} answered, "
        f"median {statistics.median(waits):.2f} s"
    )


def b_answered_all(lab: Any, response: str) -> str | None:
    return None if "B: 5 of 5 answered" in response else f"the honest caller was refused ({response})"


def unwatched_self_test(lab: Any) -> str:
    """50.2: a self-test POSTed to /call/calibrate whose result stream is never opened.

    Its model (at 0.4 s a call) takes about twice the grace to write and check the questions.
    """
    url, writer = lab.selftest.url, lab.st["steady"]
    docs = ST_DOCS + "\nThe quibble cache keeps 77 entries per user in its table."
    event = post(url, "calibrate", self_test_args(docs, writer.url + "#m"), via("203.0.113.21"))
    started = time.monotonic()
    seen = lambda: len(writer.chat_requests)  # noqa: E731
    base = seen()
    time.sleep(GRACE + 3)
    at_mark = seen()
    time.sleep(4)
    after = seen() - at_mark
    question = brag_args(docs, "What does quibble keep?", writer.url + "#m")
    kept = status_of(result(url, "brag", question, via("198.51.100.51")))
    return (
        f"{event[:12]}… calls after the {GRACE + 3:.0f} s mark: {after} in 4 s "
        f"({at_mark - base} before, {time.monotonic() - started:.0f} s in all) · "
        f"another caller's status: {kept}"
    )


def unwatched_stopped(lab: Any, response: str) -> str | None:
    after = int(response.split("mark: ", 1)[1].split()[0])
    if after:
        return f"the self-test went on without anyone waiting for it ({response})"
    return "kept for everyone" if "self-test" in response.split("status: ", 1)[1] else None


def slow_self_test(lab: Any) -> str:
    """50.2: a watched self-test whose actions take ``SLOW_READ`` a call: how long it holds the slot."""
    started = time.monotonic()
    answer = result(
        lab.selftest.url, "calibrate", self_test_args(model=lab.st["crawl"].url + "#m"), via("203.0.113.22")
    )
    held = time.monotonic() - started
    return f"slot held {held:.0f} s (BRAG_SELF_TEST_SECONDS={SELF_TEST_SECONDS}) · {answer[:160]}"


def within_bound(lab: Any, response: str) -> str | None:
    held = float(response.split("held ", 1)[1].split()[0])
    # The bound, plus the grace a call under way may take (serving.server.SELF_TEST_GRACE).
    return None if held <= SELF_TEST_SECONDS + 30 else f"the slot was held past the bound ({response})"


def identifier_documents(megabytes: float = 2.0) -> str:
    """Passages (JSON) of 10,000 characters, what a read shows of one, of snake_case identifiers.

    Each passage holds 500 of 4,000 identifiers, each once, in short sentences: every one is a
    candidate answer, and each stands in about one passage in eight, so none is rare and no call
    is ever due.
    """
    rng = random.Random(3)
    verbs, things = ["get", "set", "read", "load"], ["user", "item", "node"]
    names = [f"{rng.choice(verbs)}_{rng.choice(things)}_{i}" for i in range(4_000)]
    passages, size = [], 0
    while size < megabytes * 1_000_000:
        chosen = rng.sample(names, 500)
        groups = [chosen[j : j + 5] for j in range(0, len(chosen), 5)]
        text = " ".join(f"The tool calls {' and '.join(group)} here." for group in groups)
        passages.append({"title": f"part {len(passages)}", "text": text[:9_900]})
        size += len(passages[-1]["text"])
    return json.dumps(passages)


def finder_abandoned(lab: Any) -> str:
    """50.3: MBs of pasted identifier passages; the caller hangs up after 3 s: CPU after that."""
    from security_probes import tree_cpu

    url, pid = lab.selftest.url, lab.selftest.proc.pid
    docs = identifier_documents(float(os.environ.get("BRAG_PROBE_MB", 2)))
    result(url, "brag", brag_args(docs), via("203.0.113.23"))  # indexes and caches the corpus first
    event = post(url, "calibrate", self_test_args(docs), via("203.0.113.23"))
    if not event.startswith("event: "):
        return event
    stream = urllib.request.urlopen(f"{url}gradio_api/call/calibrate/{event[7:]}", timeout=60)
    time.sleep(3)
    stream.close()  # the caller hangs up
    time.sleep(1)
    before = tree_cpu(pid)
    time.sleep(5)
    spent = tree_cpu(pid) - before
    settle(2)
    return f"server CPU in the 5 s after the caller left: {spent:.1f} s"


def finder_stopped(lab: Any, response: str) -> str | None:
    spent = float(response.rsplit(": ", 1)[1].split()[0])
    # A self-test still working holds a core: about 5 s of CPU in 5 s, however fast the machine.
    return None if spent < 2.5 else f"the self-test went on without its caller ({response})"


def shared_fit(lab: Any) -> str:
    """50.4: one caller's self-test of pasted text, then another caller's question over the same text."""
    url = lab.selftest.url
    docs = ST_DOCS + "\nThe zibble daemon flushes its journal every 13 minutes by default."
    session = uuid.uuid4().hex
    fitted = result(url, "calibrate", self_test_args(docs), via("203.0.113.24"), session)
    question = brag_args(docs, "How often does zibble flush its journal?")
    mine = status_of(result(url, "brag", question, via("203.0.113.24"), session))
    theirs = status_of(result(url, "brag", question, via("198.51.100.54")))
    return f"fit: {fitted[:40]}… · A's own session: {mine} · B: {theirs}"


def fit_is_the_callers(lab: Any, response: str) -> str | None:
    mine, theirs = response.split(" · A's own session: ", 1)[1].split(" · B: ", 1)
    if "self-test" in theirs:
        return f"another caller's self-test became B's calibration ({theirs})"
    return None if "your self-test" in mine else f"A's own session does not use its fit ({mine})"


def store_flushed(lab: Any) -> str:
    """50.5: the victim keeps a fit; one address then runs self-tests under new model names."""
    url, fast = lab.selftest.url, lab.st["fast"].url
    session = uuid.uuid4().hex
    result(url, "calibrate", self_test_args(), via("198.51.100.55"), session)
    count = int(os.environ.get("BRAG_PROBE_FITS", KEPT_FITS + 4))
    for i in range(count):
        result(url, "calibrate", self_test_args(model=f"{fast}#flood-{i}"), via("203.0.113.25"))
    status = status_of(
        result(url, "brag", brag_args(ST_DOCS, "What does frobnicate read?"), via("198.51.100.55"), session)
    )
    return f"after {count} self-tests of one address: the victim's status: {status}"


def victim_kept(lab: Any, response: str) -> str | None:
    return (
        None
        if "self-test" in response.rsplit("status: ", 1)[1]
        else f"the victim's fit was pushed out ({response})"
    )


def long_written_questions(lab: Any) -> str:
    """50.6: a caller's endpoint writes questions of 900,000 characters."""
    from security_probes import tree_cpu

    pid = lab.selftest.proc.pid
    before = tree_cpu(pid)
    answer = result(
        lab.selftest.url, "calibrate", self_test_args(model=lab.st["longq"].url + "#m"), via("203.0.113.26")
    )
    try:  # a self-test ends with a fit however few questions pass: what it kept, and fitted on
        fitted_on = json.loads(json.loads(answer.removeprefix("complete: "))[0])["fitted_on"]
        kept, tried = fitted_on["yield"]["kept"], fitted_on["yield"]["tried"]
        said = f"kept {kept} of {tried}; fitted on {fitted_on['questions']} "
    except (ValueError, KeyError, TypeError, IndexError):
        said = answer[:200]
    return f"{said} · server CPU {tree_cpu(pid) - before:.1f} s"


def long_questions_refused(lab: Any, response: str) -> str | None:
    refused = response.startswith("kept 0 of") and "fitted on 0 " in response
    return None if refused else f"questions over the limit were kept ({response[:200]})"


def prompt_characters(lab: Any) -> str:
    """50.7: a self-test over passages of 8,000 characters each: prompt characters sent in all."""
    writer = lab.st["writer"]
    filler = " ".join(f"word{i % 97}" for i in range(1_300))
    docs = "\n".join(f"{s} {filler}" for s in SENTENCES)
    start = len(writer.chat_requests)
    answer = result(lab.selftest.url, "calibrate", self_test_args(docs), via("203.0.113.27"))
    sent = sum(len(str(m.get("content", ""))) for r in writer.chat_requests[start:] for m in r["messages"])
    return f"prompt characters sent: {sent:,} (bound {PROMPT_CHARS:,}) · {answer[:160]}"


def within_prompt_bound(lab: Any, response: str) -> str | None:
    sent = int(response.split("sent: ", 1)[1].split()[0].replace(",", ""))
    return None if sent <= PROMPT_CHARS else f"the self-test sent more than its bound ({response})"


def unreadable_port(lab: Any) -> str:
    """50.8: a model URL whose port urlsplit cannot read, on an app with an endpoint allow-list."""
    from security_probes import brag_args as ask
    from security_probes import call

    return " · ".join(
        call(lab, "listed", ask(model=f"https://h:{port}/v1#m")) for port in ("+8443", "８４４３")
    )


def port_refused(lab: Any, response: str) -> str | None:
    wanted = response.count("port must be a number") == 2 and "Internal error" not in response
    return None if wanted else f"not a clear refusal ({response[:200]})"


def selftest_probes() -> list[Any]:
    from security_probes import Probe

    return [
        Probe(
            "50.1 queue: 90 self-tests posted from five addresses, no stream opened",
            "A: 90 POST /call/calibrate (self-test) from 5 addresses; then B asks /brag 5 times",
            "selftest",
            queue_crowded,
            b_answered_all,
            watch="",
            suite=False,  # tests/test_serving.py: calibrate events have their own bound ...
        ),
        Probe(
            "50.2 slot: a self-test whose result stream is never opened",
            "POST /call/calibrate (self-test), no GET; model calls after the grace; then B's /brag status",
            "selftest",
            unwatched_self_test,
            unwatched_stopped,
            watch="",
        ),
        Probe(
            "50.2 slot: a watched self-test whose five-passage reads take 25 s a call",
            f"/calibrate self-test on a slow endpoint, BRAG_SELF_TEST_SECONDS={SELF_TEST_SECONDS}",
            "selftest",
            slow_self_test,
            within_bound,
            watch="",
            suite=False,  # tests/test_calibrate.py: a self-test's clock is read before every action
        ),
        Probe(
            "50.3 finder: MBs of identifier passages, the caller hangs up",
            "/calibrate self-test, BRAG_PROBE_MB (2) MB of 10 kB passages of identifiers; closed after 3 s",
            "selftest",
            finder_abandoned,
            finder_stopped,
            watch="",
        ),
        Probe(
            "50.4 fit: one caller's self-test of pasted text, another caller's question over it",
            "A: /calibrate self-test (session S), /brag in S; B: /brag over the same text",
            "selftest",
            shared_fit,
            fit_is_the_callers,
            watch="",
        ),
        Probe(
            "50.5 store: one address runs self-tests under new model names",
            f"victim keeps a fit; A: BRAG_PROBE_FITS self-tests (default {KEPT_FITS + 4}) on #flood-i",
            "selftest",
            store_flushed,
            victim_kept,
            watch="",
        ),
        Probe(
            "50.6 questions: a caller's endpoint writes 900,000-character questions that pass the checks",
            "/calibrate self-test, model=<longq>#m",
            "selftest",
            long_written_questions,
            long_questions_refused,
            watch="",
        ),
        Probe(
            "50.7 prompts: a self-test over passages of 8,000 characters",
            f"/calibrate self-test; BRAG_SELF_TEST_PROMPT_CHARS={PROMPT_CHARS:,}",
            "selftest",
            prompt_characters,
            within_prompt_bound,
            watch="",
        ),
        Probe(
            "50.8 url: a model URL whose port cannot be read",
            "model=https://h:+8443/v1#m and https://h:８４４３/v1#m, BRAG_ALLOWED_ENDPOINTS set",
            "listed",
            unreadable_port,
            port_refused,
            watch="",
        ),
    ]
