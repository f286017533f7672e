"""Hostile-caller probes against the real app over HTTP (tests/test_security.py, bench/security.py).

Each probe reproduces one finding of the security review: a request a hostile caller could send
to a public deployment. Two apps run side by side with the server secrets set: ``public`` has
the default endpoint policy (public hosts only), ``listed`` allows the probes' own loopback
"attacker" endpoints through ``BRAG_ALLOWED_ENDPOINTS``, so what they receive can be recorded.
A probe passes when the request is refused or bounded as it should be, nothing reaches a place
it must not, and the server keeps answering.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app_server import AppProcess, free_port, rest_call
from gradio_client import Client
from openai_server import FakeOpenAI, Reply

ROOT = Path(__file__).resolve().parent.parent
SERVER_OPENAI_KEY = "sk-server-secret-openai"
SERVER_HF_TOKEN = "hf_server_secret_token"
ENV_SECRET = "API_KEY=sk-leak-me"
URL_PASSWORD = "s3cret-url-pw"
QUESTION = "Where was the architect of the Glass Tower born?"
DOCS = "The Glass Tower was designed by Lina Berg.\nLina Berg was born in Bergen in 1961."
REQUEST_TIMEOUT = 6.0


def owner_reply(request: dict[str, Any]) -> Reply:
    """The owner's model: reads answer Bergen; a question with FAIL in it gets an HTTP 500."""
    content = request["messages"][-1]["content"]
    if "FAIL" in content:
        return Reply(status=500)
    if "Passages:" in content:
        return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg"])
    return Reply(texts=["Oslo", "Rome", "Lima", "Bergen", "Paris"][: request.get("n", 1)])


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Lab:
    """The apps and the loopback endpoints the probes use."""

    owner: FakeOpenAI
    attacker: FakeOpenAI
    trickle: FakeOpenAI
    public: AppProcess
    listed: AppProcess
    clients: dict[str, Client] = field(default_factory=dict)
    mark: int = 0  # how many requests the attacker endpoint had seen before the current probe

    def attacker_auth(self) -> list[str]:
        """The Authorization headers the attacker endpoint received during the current probe."""
        return [
            h.get("Authorization", h.get("authorization", "")) for h in self.attacker.headers[self.mark :]
        ]

    def client(self, which: str) -> Client:
        if which not in self.clients:
            self.clients[which] = Client(getattr(self, which).url, verbose=False)
        return self.clients[which]


def start_lab(stack: ExitStack) -> Lab:
    owner = stack.enter_context(FakeOpenAI(handler=owner_reply))
    attacker = stack.enter_context(FakeOpenAI(answer="Answer: Atlantis\nFollow-up query: x"))
    trickle = stack.enter_context(FakeOpenAI(handler=lambda r: Reply(trickle=1.0)))
    host, port = owner.url.split("//")[1].split("/")[0].split(":")
    env = {
        "BRAG_MODEL": f"http://user:{URL_PASSWORD}@{host}:{port}/v1#m",
        "OPENAI_API_KEY": SERVER_OPENAI_KEY,
        "HF_TOKEN": SERVER_HF_TOKEN,
        "SECRET_NOTE": ENV_SECRET,
        "BRAG_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
        "BRAG_DOCUMENTS_CACHE_BYTES": "20000000",
        "BRAG_ALLOWED_ENDPOINTS": "",
    }
    public = stack.enter_context(AppProcess(env))
    # The listed app's own model URL has no credentials in it, so its Bearer token is visible.
    listed_env = {
        **env,
        "BRAG_MODEL": owner.url + "#m",
        "BRAG_ALLOWED_ENDPOINTS": f"{attacker.url},{trickle.url}",
    }
    listed = stack.enter_context(AppProcess(listed_env))
    return Lab(owner, attacker, trickle, public, listed)


def brag_args(
    question: str = QUESTION, documents: str = DOCS, model: str = "", token: str = "", cal: str = ""
):
    return [question, "", documents, 0.05, model, token, "auto", cal]


def call(lab: Lab, which: str, args: list[Any], api: str = "/brag") -> str:
    """The answer, or the error message, of one request through gradio_client."""
    try:
        result = lab.client(which).predict(*args, api_name=api)
    except Exception as err:
        return f"error: {err}"
    if api == "/brag":
        answer, report = result
        return f"answer: {answer} (model {report.get('model')})"
    return "calibration returned"


@dataclass
class Probe:
    """One hostile request and what must hold after it."""

    finding: str
    sent: str  # what the caller sent, for the results table
    app: str  # "public" or "listed"
    send: Callable[[Lab], str]
    check: Callable[[Lab, str], str | None]  # None when it holds, else why not
    watch: str = "owner"  # the endpoint whose request count must not grow ("" for none)


@dataclass
class Outcome:
    """What a probe observed."""

    probe: Probe
    response: str
    seconds: float
    rss_before: float
    rss_after: float
    failure: str | None


def error_matching(pattern: str, *, absent: tuple[str, ...] = ()) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        if not response.startswith("error:") or not re.search(pattern, response):
            return f"expected an error matching {pattern!r}"
        for secret in (*absent, SERVER_OPENAI_KEY, SERVER_HF_TOKEN, ENV_SECRET, URL_PASSWORD, "Traceback"):
            if secret in response:
                return f"the response holds {secret!r}"
        return None

    return check


NOT_A_PATH = r"must be the JSON that /calibrate returns"


def same_error_for_every_path(lab: Lab) -> str:
    paths = ["/etc/passwd", "/proc/self/environ", "/nonexistent/brag.json", "/tmp", "/root"]
    replies = {call(lab, "public", brag_args(cal=path)) for path in paths}
    return replies.pop() if len(replies) == 1 else f"different replies: {sorted(replies)}"


def no_server_secret_sent(lab: Lab, response: str) -> str | None:
    sent = lab.attacker_auth()
    if not sent:
        return "the attacker endpoint received nothing, so the probe proved nothing"
    if any(SERVER_OPENAI_KEY in a or SERVER_HF_TOKEN in a for a in sent):
        return f"a server secret went to the caller's URL: {sent}"
    return None


def caller_token_only(lab: Lab, response: str) -> str | None:
    sent = set(lab.attacker_auth())
    return None if sent == {"Bearer caller-own-token"} else f"the caller's URL received {sent}"


def owner_gets_the_secret(lab: Lab, response: str) -> str | None:
    sent = lab.owner.headers[-1].get("Authorization", lab.owner.headers[-1].get("authorization", ""))
    if not response.startswith("answer: Bergen"):
        return "the owner's model did not answer"
    if URL_PASSWORD in response:
        return "report.model holds the URL's password"
    return None if SERVER_OPENAI_KEY in sent else "the owner's endpoint did not get OPENAI_API_KEY"


def loopback(lab: Lab, host: str) -> str:
    return f"http://{host}:{lab.attacker.url.rsplit(':', 1)[1]}"


def port_scan(lab: Lab) -> str:
    open_port = int(lab.attacker.url.rsplit(":", 1)[1].split("/")[0])
    replies = []
    for port in (open_port, free_port()):
        reply = call(lab, "public", brag_args(model=f"http://127.0.0.1:{port}/v1#m"))
        replies.append(reply.replace(str(port), "PORT"))
    return replies[0] if replies[0] == replies[1] else f"open and closed ports differ: {replies}"


def config_and_log_clean(lab: Lab, response: str) -> str | None:
    with urllib.request.urlopen(lab.public.url + "config", timeout=10) as page:
        config = page.read().decode()
    for where, text in (("/config", config), ("the error", response), ("the log", lab.public.log())):
        for secret in (URL_PASSWORD, SERVER_OPENAI_KEY, SERVER_HF_TOKEN, "caller-secret-in-log"):
            if secret in text:
                return f"{where} holds {secret!r}"
    return None if "user:" not in config else "/config holds the URL's user name"


def raw_post(lab: Lab, body: bytes) -> str:
    request = urllib.request.Request(
        lab.public.url + "gradio_api/call/brag", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        return f"error: HTTP {err.code} {err.read()[:200].decode(errors='replace')}"
    except (ConnectionError, urllib.error.URLError) as err:
        return f"error: connection closed ({err})"


def too_few_inputs(lab: Lab) -> str:
    try:
        rest_call(lab.public.url, "brag", [QUESTION, "", DOCS, 0.05, "", "caller-secret-in-log", "auto"])
    except RuntimeError as err:
        return f"error: {err}"
    return "answered"


DISTINCT_SETS = 8


def distinct_documents(lab: Lab) -> str:
    for i in range(DISTINCT_SETS):
        lines = "\n".join(
            f"Passage {i}-{j} about the town number {j} and its river {i * j}." for j in range(12_000)
        )
        reply = call(lab, "public", brag_args(documents=f"{DOCS}\n{lines}"))
        if not reply.startswith("answer:"):
            return reply
    return f"{DISTINCT_SETS} distinct 0.8 MB document sets answered"


LABELLED_301 = json.dumps([{"question": f"Q{i}?", "gold": ["a"]} for i in range(301)])
DEMO_JSON = str(ROOT / "data" / "demo_corpus.json")
SHIPPED_FILE = str(ROOT / "data" / "calibration_prior.json")


def probes() -> list[Probe]:
    """Every finding, as a probe."""
    return [
        Probe(
            "file read: /dev/zero as calibration (memory exhaustion)",
            "calibration=/dev/zero",
            "public",
            lambda lab: call(lab, "public", brag_args(cal="/dev/zero")),
            error_matching(NOT_A_PATH),
        ),
        Probe(
            "file read: /dev/urandom as labelled questions",
            "labelled_json=/dev/urandom",
            "public",
            lambda lab: call(lab, "public", ["/dev/urandom", "", DOCS, "", "", "auto"], "/calibrate"),
            error_matching("must be a JSON list"),
        ),
        Probe(
            "file read and existence oracle: /etc/passwd, /proc/self/environ, a missing file, folders",
            "calibration=/etc/passwd, /proc/self/environ, /nonexistent/brag.json, /tmp, /root",
            "public",
            same_error_for_every_path,
            error_matching(NOT_A_PATH),
        ),
        Probe(
            "a valid calibration file elsewhere on disk",
            f"calibration={SHIPPED_FILE}",
            "public",
            lambda lab: call(lab, "public", brag_args(cal=SHIPPED_FILE)),
            error_matching(NOT_A_PATH),
        ),
        Probe(
            "a question file on disk as labelled questions (LLM calls billed to the owner)",
            f"labelled_json={DEMO_JSON}",
            "public",
            lambda lab: call(lab, "public", [DEMO_JSON, "", DOCS, "", "", "auto"], "/calibrate"),
            error_matching("must be a JSON list"),
        ),
        Probe(
            "server secret to a caller's URL (no token given)",
            "model=<attacker>/v1#m, token empty",
            "listed",
            lambda lab: call(lab, "listed", brag_args(model=lab.attacker.url + "#m")),
            no_server_secret_sent,
            watch="",
        ),
        Probe(
            "a caller's URL gets the caller's token",
            "model=<attacker>/v1#m, token=caller-own-token",
            "listed",
            lambda lab: call(
                lab, "listed", brag_args(model=lab.attacker.url + "#m", token="caller-own-token")
            ),
            caller_token_only,
            watch="",
        ),
        Probe(
            "the owner's model still gets the server's OPENAI_API_KEY",
            "model empty (BRAG_MODEL)",
            "listed",
            lambda lab: call(lab, "listed", brag_args()),
            owner_gets_the_secret,
            watch="",
        ),
        *[
            Probe(
                f"SSRF: loopback {how}",
                f"model=http://{host}:<attacker port>/v1#m",
                "public",
                lambda lab, host=host: call(lab, "public", brag_args(model=loopback(lab, host) + "#m")),
                error_matching("is not allowed"),
                watch="attacker",
            )
            for how, host in (
                ("by IP", "127.0.0.1"),
                ("by name", "localhost"),
                ("as a decimal number", "2130706433"),
                ("in IPv6", "[::1]"),
            )
        ],
        Probe(
            "SSRF: cloud metadata (link-local)",
            "model=http://169.254.169.254/latest#m",
            "public",
            lambda lab: call(lab, "public", brag_args(model="http://169.254.169.254/latest#m")),
            error_matching("is not allowed"),
        ),
        Probe(
            "SSRF: private network",
            "model=http://10.1.2.3:8000/v1#m",
            "public",
            lambda lab: call(lab, "public", brag_args(model="http://10.1.2.3:8000/v1#m")),
            error_matching("is not allowed"),
        ),
        Probe(
            "port scan: an open and a closed loopback port answer alike",
            "model=http://127.0.0.1:<open|closed>",
            "public",
            port_scan,
            error_matching("is not allowed"),
            watch="attacker",
        ),
        Probe(
            "allow-list: a loopback port not on the list",
            "model=http://127.0.0.1:<other port>/v1#m",
            "listed",
            lambda lab: call(lab, "listed", brag_args(model=f"http://127.0.0.1:{free_port()}/v1#m")),
            error_matching("BRAG_ALLOWED_ENDPOINTS"),
        ),
        Probe(
            "allow-list: a path that only starts like an allowed one",
            "model=<attacker>/v1evil#m",
            "listed",
            lambda lab: call(lab, "listed", brag_args(model=lab.attacker.url + "evil#m")),
            error_matching("BRAG_ALLOWED_ENDPOINTS"),
            watch="attacker",
        ),
        Probe(
            "local:<path> loads a server file",
            "model=local:/etc/passwd",
            "public",
            lambda lab: call(lab, "public", brag_args(model="local:/etc/passwd")),
            error_matching("paths are not accepted"),
        ),
        Probe(
            "no deadline: an endpoint that trickles one byte a second",
            "model=<trickle>/v1#m",
            "listed",
            lambda lab: call(lab, "listed", brag_args(model=lab.trickle.url + "#m")),
            error_matching("time limit|did not answer in time"),
            watch="",
        ),
        Probe(
            "size: a 10 MB question",
            "question of 10,000,000 characters",
            "public",
            lambda lab: call(lab, "public", brag_args(question="why " * 2_500_000)),
            error_matching(r"over the limit of 4,000 \(BRAG_MAX_QUESTION_CHARS\)"),
        ),
        Probe(
            "size: 8 MB of documents",
            "documents of 8,000,000 bytes",
            "public",
            lambda lab: call(lab, "public", brag_args(documents=(DOCS + "\n") * 95_000)),
            error_matching(r"BRAG_MAX_DOCUMENTS_BYTES"),
        ),
        Probe(
            "size: a 25 MB request body",
            "POST /gradio_api/call/brag with 25 MB",
            "public",
            lambda lab: raw_post(lab, b'{"data": ["' + b"x" * 25_000_000 + b'"]}'),
            error_matching("413|connection closed"),
        ),
        Probe(
            "size: distinct pasted corpora stay cached without bound",
            "8 distinct 0.8 MB document sets",
            "public",
            distinct_documents,
            lambda lab, r: None if r.startswith("8 distinct") else r,
            watch="",
        ),
        Probe(
            "size: /calibrate with 301 questions",
            "labelled_json with 301 questions",
            "public",
            lambda lab: call(lab, "public", [LABELLED_301, "", DOCS, "", "", "auto"], "/calibrate"),
            error_matching("at most 300"),
        ),
        Probe(
            "credentials in BRAG_MODEL's URL echoed in /config, errors and the log",
            "question with FAIL (the owner's endpoint answers 500)",
            "public",
            lambda lab: call(lab, "public", brag_args(question="FAIL please")),
            lambda lab, r: error_matching("HTTP 500")(lab, r) or config_and_log_clean(lab, r),
            watch="",
        ),
        Probe(
            "a token with CR/LF echoed in an error",
            "token=hf_abc\\r\\nX-Evil: 1",
            "public",
            lambda lab: call(lab, "public", brag_args(token="hf_abc\r\nX-Evil: 1")),
            error_matching("line breaks", absent=("X-Evil", "Illegal header")),
        ),
        Probe(
            "inputs (a token among them) in the log: too few inputs",
            "REST /brag with 7 inputs",
            "public",
            too_few_inputs,
            lambda lab, r: (
                error_matching("takes 8 inputs", absent=("caller-secret",))(lab, r)
                or config_and_log_clean(lab, r)
            ),
        ),
        Probe(
            "raw error: all-emoji documents",
            "documents=😀😀😀",
            "public",
            lambda lab: call(lab, "public", brag_args(documents="😀😀😀\n\0\0\0")),
            error_matching("nothing to search"),
        ),
    ]


def requests_seen(lab: Lab, watch: str) -> int:
    return len(getattr(lab, watch).requests) if watch else 0


def run(lab: Lab) -> list[Outcome]:
    """Every probe in turn; after each, the server that took it must still answer a question."""
    outcomes = []
    for probe in probes():
        app = getattr(lab, probe.app)
        before_rss, before_seen = rss_mb(app.proc.pid), requests_seen(lab, probe.watch)
        lab.mark = len(lab.attacker.headers)
        started = time.monotonic()
        response = probe.send(lab)
        seconds = time.monotonic() - started
        failure = probe.check(lab, response)
        if probe.watch and requests_seen(lab, probe.watch) != before_seen:
            failure = failure or f"the {probe.watch} endpoint received a request"
        if failure is None and not call(lab, probe.app, brag_args()).startswith("answer: Bergen"):
            failure = "the server stopped answering"
        if failure is None and not app.alive():
            failure = "the server died"
        outcomes.append(Outcome(probe, response, seconds, before_rss, rss_mb(app.proc.pid), failure))
    return outcomes
