"""BRAG as a Gradio app: a browser UI plus the ``/brag`` and ``/calibrate`` API endpoints.

    python app.py          # http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT)

Environment: ``HF_TOKEN`` (server secret for Inference Providers), ``BRAG_MODEL`` (default
model), ``BRAG_ALLOWED_MODELS`` and ``BRAG_ALLOWED_ENDPOINTS`` (what callers may pick),
``BRAG_CONCURRENCY`` (requests run at once, default 16; the rest queue), ``BRAG_DATA_DIR``
(local corpora), ``BRAG_CORPUS_REPO`` (Hub dataset with the HippoRAG corpora); the limits are in
:class:`Limits` and the README's public-API section.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import base64
import functools
import hashlib
import html
import json
import logging
import re
import threading
import time
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
from starlette.middleware import Middleware

import brag
import calibrate
import documents as doc_files
import llms
import parse_worker
import uploads

log = logging.getLogger("brag.app")
HERE = Path(__file__).resolve().parent
DEMO = "Demo"
DEMO_CORPUS_PATH = HERE / "data" / "demo_corpus.json"
HIPPORAG_REPO = "osunlp/HippoRAG_2"
YOUR_DOCUMENTS = "Your documents"
ACTIONS = brag.ACTIONS
# Display name -> (folder under BRAG_DATA_DIR, local file names to try in order, Hub file name).
# The shared data holds HippoRAG's own 2Wiki corpus and faithful subsets for the other two.
CORPORA: dict[str, tuple[str, tuple[str, ...], str]] = {
    "HotpotQA": (
        "hotpotqa",
        ("hotpotqa_corpus.json", "hotpotqa_ircot500_corpus.json"),
        "hotpotqa_corpus.json",
    ),
    "2WikiMultihopQA": ("2wikimultihopqa", ("2wikimultihopqa_corpus.json",), "2wikimultihopqa_corpus.json"),
    "MuSiQue": ("musique", ("musique_corpus.json", "musique_migres200_corpus.json"), "musique_corpus.json"),
}
# The first is one the default model answers right (bench/results/examples.md).
EXAMPLES = [
    ["Which political party used the idea coined by Friedrich Ratzel?", DEMO],
    ["Where was the architect of the Glass Tower born?", DEMO],
    ["In which city was the author of The Silent Orchard born?", DEMO],
    ["Into which sea does the river that flows through Marie Curie's birthplace flow?", DEMO],
]


def user_error(message: str) -> gr.Error:
    """An error the user reads; logged as one line (scrubbed by the log filter), no stack trace."""
    log.warning("request failed: %s", message)
    return gr.Error(message, print_exception=False)


class Secrets:
    """The server's own secret values, and their scrubbing from every text that leaves the server.

    The values are ``HF_TOKEN``, ``OPENAI_API_KEY`` and the credentials inside ``BRAG_MODEL``'s
    URL, each also in base64 (the form an ``Authorization: Basic`` header carries, which some
    proxies repeat in their error pages). Errors, answers, reports, streamed events and log
    lines all pass :meth:`scrub`.
    """

    MIN_LENGTH = 6  # shorter values would scrub ordinary words

    def __init__(self, values: Iterable[str]) -> None:
        wanted = {v for v in values if len(v) >= self.MIN_LENGTH}
        forms = wanted | {base64.b64encode(v.encode()).decode() for v in wanted}
        forms |= {f.rstrip("=") for f in forms}
        ordered = sorted(forms, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @classmethod
    def from_env(cls) -> Secrets:
        """The secrets this server holds in its environment."""
        values = [os.environ.get(name, "") for name in ("HF_TOKEN", "OPENAI_API_KEY", "BRAG_MILVUS_TOKEN")]
        model = os.environ.get("BRAG_MODEL", "").strip()
        if model.startswith(("http://", "https://")):
            netloc = urllib.parse.urlsplit(model).netloc
            if "@" in netloc:
                userinfo = netloc.rpartition("@")[0]
                user, _, password = userinfo.partition(":")
                values += [userinfo, urllib.parse.unquote(userinfo), password, urllib.parse.unquote(password)]
                values.append(f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}")
        return cls(values)

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        return self.pattern.sub("***", text) if self.pattern is not None and text else text

    def scrub_data(self, value: Any) -> Any:
        """Every string inside a JSON-like value, scrubbed (a new value; the input is not changed)."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub_data(k): self.scrub_data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_data(v) for v in value]
        return value


def _env_number(name: str, default: float, kind: type = int) -> Any:
    """A positive setting from the environment; a bad one stops the app with a message naming it."""
    try:
        return llms.positive_setting(name, default, kind)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def concurrency() -> int:
    """``BRAG_CONCURRENCY`` (default 16): how many requests run at once."""
    return _env_number("BRAG_CONCURRENCY", 16)


# ------------------------------------------------------------------------------------------
# The public boundary: every remote input passes here, and the owner's policy lives here
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one request may cost; each is set by the environment variable named beside it."""

    question_chars: int = 4_000  # BRAG_MAX_QUESTION_CHARS
    documents_bytes: int = 5_000_000  # BRAG_MAX_DOCUMENTS_BYTES
    passages: int = 20_000  # BRAG_MAX_PASSAGES
    calibration_bytes: int = 100_000  # BRAG_MAX_CALIBRATION_BYTES
    labelled_bytes: int = 1_000_000  # BRAG_MAX_LABELLED_BYTES
    labelled_min: int = calibrate.MIN_QUESTIONS  # BRAG_MIN_LABELLED
    labelled_max: int = 300  # BRAG_MAX_LABELLED
    request_timeout: float = 120.0  # BRAG_REQUEST_TIMEOUT: /brag, seconds
    calibrate_timeout: float = 3_600.0  # BRAG_CALIBRATE_TIMEOUT: /calibrate makes 3 calls a question
    documents_cache_bytes: int = 200_000_000  # BRAG_DOCUMENTS_CACHE_BYTES: pasted corpora kept
    per_session: int = 2  # BRAG_MAX_PER_SESSION: requests one browser tab (session) runs at once
    # BRAG_MAX_PER_ADDRESS: requests one client address runs at once; unset (None), half of
    # BRAG_CONCURRENCY; never all of it (Limits.address_share)
    per_address: int | None = None
    queue_size: int = 64  # BRAG_MAX_QUEUE: requests waiting for a worker; more get "busy, retry"
    calibrate_concurrency: int = 1  # BRAG_CALIBRATE_CONCURRENCY: /calibrate runs at once (own slots)
    files: int = 10  # BRAG_MAX_FILES: uploaded files per request
    file_bytes: int = 5_000_000  # BRAG_MAX_FILE_BYTES: bytes per uploaded file
    files_bytes: int = 10_000_000  # BRAG_MAX_FILES_BYTES: bytes of all of a request's files
    pdf_pages: int = 300  # BRAG_MAX_PDF_PAGES: pages per PDF
    text_chars: int = 3_000_000  # BRAG_MAX_TEXT_CHARS: text extracted from a request's files
    upload_store_bytes: int = 200_000_000  # BRAG_MAX_UPLOAD_STORE_BYTES: uploads waiting on disk
    upload_caller_bytes: int = 20_000_000  # BRAG_MAX_UPLOAD_BYTES_PER_CALLER: one address's share of them
    upload_ttl: float = 600.0  # BRAG_UPLOAD_TTL_SECONDS: an upload no request read is deleted then
    parse_memory_mb: int = 512  # BRAG_PARSE_MEMORY_MB: a file reader's address space
    parse_cpu_seconds: int = 30  # BRAG_PARSE_CPU_SECONDS: CPU time to read one file (wall: twice it)
    parse_workers: int = 2  # BRAG_PARSE_WORKERS: file readers at once, server-wide

    def file_limits(self) -> doc_files.FileLimits:
        """What one request's files may hold, for :func:`documents.read_files`."""
        return doc_files.FileLimits(
            self.files, self.file_bytes, self.files_bytes, self.pdf_pages, self.text_chars
        )

    def parse_caps(self) -> parse_worker.Caps:
        """What a file reader may use."""
        return parse_worker.Caps(self.parse_memory_mb, self.parse_cpu_seconds, self.parse_workers)

    def caller_upload_share(self) -> int:
        """One caller's share of the upload store: never less than one request's files."""
        return max(self.upload_caller_bytes, self.files_bytes)

    def address_share(self, concurrency: int) -> int:
        """Requests one address may run among ``concurrency`` workers.

        Unset, half of them; set, at most all but one: one address never holds every worker
        while another waits.
        """
        share = self.per_address if self.per_address is not None else max(1, concurrency // 2)
        return min(share, concurrency - 1) if concurrency > 1 else 1

    @classmethod
    def from_env(cls) -> Limits:
        """The defaults above, overridden by the environment."""
        names = {
            "question_chars": "BRAG_MAX_QUESTION_CHARS",
            "documents_bytes": "BRAG_MAX_DOCUMENTS_BYTES",
            "passages": "BRAG_MAX_PASSAGES",
            "calibration_bytes": "BRAG_MAX_CALIBRATION_BYTES",
            "labelled_bytes": "BRAG_MAX_LABELLED_BYTES",
            "labelled_min": "BRAG_MIN_LABELLED",
            "labelled_max": "BRAG_MAX_LABELLED",
            "request_timeout": "BRAG_REQUEST_TIMEOUT",
            "calibrate_timeout": "BRAG_CALIBRATE_TIMEOUT",
            "documents_cache_bytes": "BRAG_DOCUMENTS_CACHE_BYTES",
            "per_session": "BRAG_MAX_PER_SESSION",
            "queue_size": "BRAG_MAX_QUEUE",
            "calibrate_concurrency": "BRAG_CALIBRATE_CONCURRENCY",
            "files": "BRAG_MAX_FILES",
            "file_bytes": "BRAG_MAX_FILE_BYTES",
            "files_bytes": "BRAG_MAX_FILES_BYTES",
            "pdf_pages": "BRAG_MAX_PDF_PAGES",
            "text_chars": "BRAG_MAX_TEXT_CHARS",
            "upload_store_bytes": "BRAG_MAX_UPLOAD_STORE_BYTES",
            "upload_caller_bytes": "BRAG_MAX_UPLOAD_BYTES_PER_CALLER",
            "upload_ttl": "BRAG_UPLOAD_TTL_SECONDS",
            "parse_memory_mb": "BRAG_PARSE_MEMORY_MB",
            "parse_cpu_seconds": "BRAG_PARSE_CPU_SECONDS",
            "parse_workers": "BRAG_PARSE_WORKERS",
        }
        defaults = cls()
        values = {
            f: _env_number(env, getattr(defaults, f), type(getattr(defaults, f))) for f, env in names.items()
        }
        if "BRAG_MAX_PER_ADDRESS" in os.environ:  # unset means half of BRAG_CONCURRENCY
            values["per_address"] = _env_number("BRAG_MAX_PER_ADDRESS", 8)
        return cls(**values)


def _too_big(what: str, size: int, limit: int, unit: str, variable: str) -> gr.Error:
    return user_error(f"{what}: {size:,} {unit}, over the limit of {limit:,} ({variable}).")


def check_question(question: Any, limits: Limits) -> str:
    """A non-empty question within the length limit."""
    if not isinstance(question, str) or not question.strip():
        raise user_error("The question is empty.")
    if len(question) > limits.question_chars:
        raise _too_big(
            "The question", len(question), limits.question_chars, "characters", "BRAG_MAX_QUESTION_CHARS"
        )
    return question


MIN_PRICE = 1e-6  # dollars per million tokens


def check_cost(unit: Any, price_in: Any, price_out: Any) -> tuple[str, tuple[float, float] | None]:
    """The unit actions are priced in (empty: the default), with the two prices when it is usd."""
    unit = unit.strip() if isinstance(unit, str) and unit.strip() else brag.DEFAULT_COST_UNIT
    if unit not in brag.COST_UNITS:
        raise user_error(f"cost must be one of {', '.join(brag.COST_UNITS)}.")
    if unit != "usd":
        return unit, None
    try:
        prices = (float(price_in), float(price_out))
    except (TypeError, ValueError):
        raise user_error(
            "cost usd needs the input and output prices, in dollars per million tokens."
        ) from None
    # NaN fails too; a price is 0 or at least a millionth of a dollar, so a read never costs 0.
    if not all(p == 0 or MIN_PRICE <= p <= 10_000 for p in prices) or max(prices) <= 0:
        raise user_error(
            "prices must be 0 or lie between 0.000001 and 10,000 dollars per million tokens, not both 0."
        )
    return unit, prices


def check_lam(lam: Any) -> float:
    """λ as a finite number in [0, 10]."""
    try:
        value = float(lam)
    except (TypeError, ValueError):
        raise user_error("λ must be a number.") from None
    if not 0 <= value <= 10:  # NaN fails too
        raise user_error("λ must lie between 0 and 10.")
    return value


def read_calibration(
    text: Any,
    corpus_label: str,
    model: str,
    shipped: Mapping[str, brag.Calibration],
    kept: KeptCalibrations,
    limits: Limits,
) -> brag.Calibration:
    """The calibration a request names: empty, a shipped name, a kept fit's name, or JSON.

    Empty is the one shipped for this model and corpus, else the hand-set prior. Never a path:
    a kept fit's name is checked against its pattern before its file is opened.
    """
    text = (text or "").strip() if isinstance(text, str) else text
    if not text:
        return brag.shipped_calibration(model, corpus_label, shipped)
    if not isinstance(text, str):
        raise user_error("calibration must be JSON text or the name of a calibration.")
    if text in shipped:
        return shipped[text]
    if kept.holds(text):
        return kept.load(text)
    if not text.startswith("{"):
        raise user_error(
            "calibration must be the JSON that /calibrate returns, the name it gave, or one of the "
            "shipped names: " + ", ".join(shipped)
        )
    size = len(text.encode())
    if size > limits.calibration_bytes:
        raise _too_big(
            "The calibration", size, limits.calibration_bytes, "bytes", "BRAG_MAX_CALIBRATION_BYTES"
        )
    try:
        return brag.calibration_from_dict(brag.parse_json(text, "calibration"))
    except ValueError as err:
        raise user_error(str(err)) from None


def read_labelled(text: Any, limits: Limits) -> list[calibrate.Labelled]:
    """Questions, with or without gold, from JSON or JSON Lines text (never a path), within limits."""
    if not isinstance(text, str) or not text.strip():
        raise user_error(
            f'No questions: paste a JSON list of {{"question", "gold": [...]}} objects or of '
            f"questions ({limits.labelled_min} to {limits.labelled_max})."
        )
    size = len(text.encode())
    if size > limits.labelled_bytes:
        raise _too_big(
            "The labelled questions", size, limits.labelled_bytes, "bytes", "BRAG_MAX_LABELLED_BYTES"
        )
    if not text.strip().startswith(("[", "{")):
        raise user_error(
            'questions must be a JSON list of {"question", "gold": [...]} objects or of questions, '
            "or JSON Lines."
        )
    try:
        items = calibrate.read_questions(text)
    except ValueError as err:
        raise user_error(str(err)) from None
    if not limits.labelled_min <= len(items) <= limits.labelled_max:
        raise user_error(
            f"calibration needs at least {limits.labelled_min} and at most {limits.labelled_max} labelled "
            f"questions (BRAG_MIN_LABELLED / BRAG_MAX_LABELLED), got {len(items)}."
        )
    return items


class SessionUploads:
    """Files a browser session uploaded, kept in memory once read (the disk copy is deleted).

    So the same tab can ask again over them; the oldest go first past ``budget`` bytes. Only
    the session that uploaded a file can name it again.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._files: OrderedDict[tuple[str, str], tuple[str, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, session: str, path: str, name: str, data: bytes) -> None:
        """Keep a file ``session`` uploaded to ``path`` (nothing without a session)."""
        if not session:
            return  # called from Python: nothing to ask again from
        with self._lock:
            self._files[session, path] = (name, data)
            while sum(len(d) for _, d in self._files.values()) > self.budget:
                self._files.popitem(last=False)

    def recall(self, session: str, path: str) -> tuple[str, bytes] | None:
        """The file ``session`` uploaded to ``path`` before, if it is still kept."""
        with self._lock:
            found = self._files.get((session, path)) if session else None
            if found is not None:
                self._files.move_to_end((session, path))
            return found

    def known(self, path: str) -> bool:
        """True when some session keeps a file it uploaded to ``path`` (which session: :meth:`recall`)."""
        with self._lock:
            return any(kept_path == path for _, kept_path in self._files)


def read_uploads(
    files: Any,
    limits: Limits,
    kept: SessionUploads | None = None,
    session: str = "",
    ledger: uploads.UploadLedger | None = None,
) -> list[tuple[str, bytes]]:
    """The uploaded files' names and bytes, each deleted from disk once read.

    Only files Gradio stored in its upload folder are read, or ones this session uploaded
    before (``kept``): a path a caller writes into a request never names a place on this server.
    """
    if files is None or files == []:
        return []
    files = files if isinstance(files, list) else [files]
    if len(files) > limits.files:
        raise _too_big("The upload", len(files), limits.files, "files", "BRAG_MAX_FILES")
    folder = Path(gr.utils.get_upload_folder()).resolve()
    found: list[Path | tuple[str, bytes]] = []
    for item in files:
        path = item.get("path") if isinstance(item, dict) else item
        resolved = Path(path).resolve() if isinstance(path, str) and path and "\0" not in path else None
        if resolved is not None and resolved.is_relative_to(folder) and resolved.is_file():
            found.append(resolved)
        elif resolved is not None and kept is not None and (again := kept.recall(session, str(resolved))):
            found.append(again)
        elif resolved is not None and ledger is not None and ledger.expired(str(resolved)):
            raise user_error(
                f"An uploaded file waited more than {limits.upload_ttl:g} s for a question and was deleted "
                "(BRAG_UPLOAD_TTL_SECONDS): upload it again."
            )
        else:
            raise user_error("Files must be uploaded with the request (a file input, or handle_file).")
    read: list[tuple[str, bytes]] = []
    try:
        total = 0
        for entry in found:
            name, size = (
                (entry.name, entry.stat().st_size) if isinstance(entry, Path) else (entry[0], len(entry[1]))
            )
            if size > limits.file_bytes:
                raise _too_big(name, size, limits.file_bytes, "bytes", "BRAG_MAX_FILE_BYTES")
            total += size
            if total > limits.files_bytes:
                raise _too_big("The files", total, limits.files_bytes, "bytes", "BRAG_MAX_FILES_BYTES")
            data = entry.read_bytes() if isinstance(entry, Path) else entry[1]
            if isinstance(entry, Path) and kept is not None:
                kept.remember(session, str(entry), name, data)
            read.append((name, data))
    finally:
        for entry in found:
            if isinstance(entry, Path):
                entry.unlink(missing_ok=True)
                if ledger is not None:
                    ledger.release(str(entry))
    return read


def documents_from_files(
    files: list[tuple[str, bytes]],
    limits: Limits,
    readers: parse_worker.FileReaders,
    cancelled: Callable[[], bool] = lambda: False,
    caller: str = "",
) -> list[Any]:
    """Uploaded files cut into passages, read in a capped worker process; a clear error names a bad file.

    The reading is part of the request: it ends at the request's deadline, and when the caller
    (its address) has gone (``cancelled``).
    """
    left = llms.time_left(error=parse_worker.ReadingAbandoned)
    deadline = None if left is None else time.monotonic() + left
    try:
        rows = readers.read(
            files, limits.file_limits(), deadline=deadline, cancelled=cancelled, caller=caller
        )
    except doc_files.DocumentError as err:
        raise user_error(f"{err}.") from None
    passages = doc_files.as_passages(rows)
    if len(passages) > limits.passages:
        raise _too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    return passages


def check_documents(documents: str, limits: Limits) -> list[Any]:
    """Pasted documents as passages: a JSON list, or one passage per line; within the limits."""
    size = len(documents.encode())
    if size > limits.documents_bytes:
        raise _too_big("The documents", size, limits.documents_bytes, "bytes", "BRAG_MAX_DOCUMENTS_BYTES")
    stripped = documents.strip()
    if stripped.startswith(("[", "{")):
        passages = brag.parse_json(stripped, "documents")
        if not isinstance(passages, list):
            raise user_error(
                "documents: a JSON document must be a list of strings or of {title, text} objects."
            )
    else:
        passages = [line for line in stripped.splitlines() if line.strip()]
    if len(passages) > limits.passages:
        raise _too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    return passages


_PROVIDER = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


@dataclass(frozen=True)
class EndpointPolicy:
    """Where a caller-chosen model URL may point (``BRAG_ALLOWED_ENDPOINTS``).

    Unset: any public http(s) host; loopback, private, link-local and multicast addresses are
    refused at connection time, by the address actually connected to. ``*``: anything (a local
    deployment). Otherwise a comma-separated list of URL prefixes; a URL must share a prefix's
    scheme, host and port and extend its path. The owner's model (``BRAG_MODEL``, else the
    default) is always allowed and is the only one that gets the server's secrets.
    """

    prefixes: tuple[str, ...] = ()
    allow_all: bool = False

    @classmethod
    def from_env(cls) -> EndpointPolicy:
        """The policy ``BRAG_ALLOWED_ENDPOINTS`` sets."""
        raw = os.environ.get("BRAG_ALLOWED_ENDPOINTS", "").strip()
        if raw == "*":
            return cls(allow_all=True)
        prefixes = tuple(p.strip() for p in raw.split(",") if p.strip())
        for prefix in prefixes:
            if urllib.parse.urlsplit(prefix).scheme not in ("http", "https"):
                raise SystemExit(f"BRAG_ALLOWED_ENDPOINTS: {llms.redact_url(prefix)} is not an http(s) URL")
        return cls(prefixes)

    def listed(self, url: str) -> bool:
        """True when ``url`` extends one of the allowed prefixes."""
        target = _url_parts(url)
        for prefix in self.prefixes:
            scheme, host, port, path = _url_parts(prefix)
            if target[:3] == (scheme, host, port) and (
                target[3] == path or target[3].startswith(path.rstrip("/") + "/")
            ):
                return True
        return False


def _has_dot_segments(url: str) -> bool:
    """A path with ``.``/``..`` segments, backslashes or encoded slashes (in any encoding depth).

    Servers resolve these, so ``/tenantA/v1/../../tenantB`` would match the prefix ``/tenantA``
    and reach another tenant; they have no use in an endpoint URL, so they are refused.
    """
    path = urllib.parse.urlsplit(url).path
    for _ in range(4):  # %252e decodes to %2e, then to "."
        lowered = path.lower()
        if "\\" in path or "%2f" in lowered or "%5c" in lowered:
            return True
        if any(segment in (".", "..") for segment in path.split("/")):
            return True
        decoded = urllib.parse.unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True


@dataclass(frozen=True)
class ModelPolicy:
    """Which models callers may pick beyond URLs, and which of them the server's secrets pay for.

    The owner's default model (``BRAG_MODEL``, else the one :func:`llms.default_model` picks) is
    always offered and gets the server's secrets. ``BRAG_ALLOWED_MODELS`` lists more: Hugging
    Face model ids that the server's ``HF_TOKEN`` may pay for, and embedded models (``local``,
    ``local:smollm2``) that callers may start. Any other Hugging Face model needs the caller's
    own token; any other embedded model is refused.
    """

    default: str
    allowed: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls) -> ModelPolicy:
        """The policy ``BRAG_MODEL`` and ``BRAG_ALLOWED_MODELS`` set."""
        raw = os.environ.get("BRAG_ALLOWED_MODELS", "")
        listed = frozenset(_canonical_model(m) for m in raw.split(",") if m.strip())
        for spec in listed:
            if spec.startswith(("http://", "https://")):
                raise SystemExit(
                    "BRAG_ALLOWED_MODELS lists model names; endpoint URLs go in BRAG_ALLOWED_ENDPOINTS"
                )
        return cls(_canonical_model(llms.default_model()), listed)

    def owner(self, spec: str) -> bool:
        """True for the owner's default model."""
        return _canonical_model(spec) == self.default

    def listed(self, spec: str) -> bool:
        """True for the default and for every model the owner lists."""
        return self.owner(spec) or _canonical_model(spec) in self.allowed

    def describe(self) -> str:
        """The offered models, for an error message."""
        return ", ".join(sorted({llms.redact_url(self.default), *self.allowed}))


def _canonical_model(spec: str) -> str:
    spec = spec.strip()
    return "local" if spec == "local:qwen" else spec


def _url_parts(url: str) -> tuple[str, str, int | None, str]:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path or "/"


class KeptCalibrations:
    """Fits that /calibrate made, kept on disk under a name derived from their content.

    The name (``fit-`` and 12 hex digits) is what a later /brag request passes as
    ``calibration``; only names of that exact form are ever turned into a file name. The
    oldest go first beyond ``limit`` files.
    """

    NAME = re.compile(r"^fit-[0-9a-f]{12}$")

    def __init__(self, directory: Path, limit: int = 500) -> None:
        self.directory, self.limit = directory, limit

    def holds(self, name: str) -> bool:
        """True when ``name`` names a kept fit."""
        return bool(self.NAME.match(name)) and (self.directory / f"{name}.json").is_file()

    def path(self, name: str) -> Path | None:
        """The file of a kept fit, for a name of the kept form that exists; else None."""
        return self.directory / f"{name}.json" if self.holds(name) else None

    def load(self, name: str) -> brag.Calibration:
        """A kept fit by name."""
        if not self.NAME.match(name):
            raise user_error("not the name of a kept calibration")
        try:
            return brag.load_calibration(self.directory / f"{name}.json")
        except ValueError:
            raise user_error(f"the kept calibration {name} cannot be read; run /calibrate again") from None

    def keep(self, result: dict[str, Any]) -> str:
        """Store a fit and return its name."""
        digest = hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()
        name = f"fit-{digest[:12]}"
        brag.write_atomic(self.directory / f"{name}.json", json.dumps({**result, "name": name}, indent=1))
        kept = sorted(self.directory.glob("fit-*.json"), key=lambda p: p.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self.limit)]:
            old.unlink(missing_ok=True)
        return name


# A FileData's "path" key in a JSON body (inside a string value its quote would be escaped).
_PATH_KEY = re.compile(rb'(?<!\\)"path"\s*:')


class RequestSizeLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is refused before it is parsed.

    The per-field limits above act on parsed values; this bounds what a caller can make the
    server read at all (JSON escaping can triple a field's size, hence the allowance). A JSON
    body that names more than ``max_files`` files is refused too, before it is parsed: a list
    of 100,000 FileData would cost the parser and the files check far more than its bytes.
    """

    def __init__(
        self, app: Any, max_bytes: int, upload_bytes: int | None = None, max_files: int | None = None
    ) -> None:
        self.app, self.max_bytes, self.max_files = app, max_bytes, max_files
        self.upload_bytes = max_bytes if upload_bytes is None else upload_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, counting its body; refuse it with 413 once it is too large."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # An upload's body holds files; every other body is JSON, bounded by its own fields.
        upload = scope.get("path", "").rstrip("/").endswith("/upload")
        limit = self.upload_bytes if upload else self.max_bytes
        declared = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            await self._refuse(send, self._too_large())
            return
        received = paths = 0
        tail = b""
        started = more = False
        refusal: _TooLarge | None = None

        async def counted_receive() -> dict[str, Any]:
            nonlocal received, paths, tail, more, refusal
            message = await receive()
            chunk, more = message.get("body", b""), bool(message.get("more_body"))
            received += len(chunk)
            if received > limit:
                refusal = _TooLarge(self._too_large())
                raise refusal
            if not upload and self.max_files is not None:
                seen = tail + chunk  # a key may straddle two chunks: the last few bytes go again
                paths += len(_PATH_KEY.findall(seen)) - len(_PATH_KEY.findall(tail))
                tail = seen[-16:]
                if paths > self.max_files:
                    refusal = _TooMany(f"a request names at most {self.max_files:,} files (BRAG_MAX_FILES)")
                    raise refusal
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refusal is not None:
                return  # the app's own answer to a body it could not read (FastAPI says 400)
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            pass  # refusal holds it
        if refusal is None or started:
            return
        # The rest of a body within its declared size is read, so the caller sees the answer.
        while isinstance(refusal, _TooMany) and more:
            more = bool((await receive()).get("more_body"))
        await self._refuse(send, str(refusal))

    def _too_large(self) -> str:
        return f"request body over {self.max_bytes:,} bytes (BRAG_MAX_REQUEST_BYTES)"

    async def _refuse(self, send: Any, why: str) -> None:
        await uploads.json_response(send, 413, {"error": why})


class _TooLarge(Exception):
    """A body past a bound: its message says which."""


class _TooMany(_TooLarge):
    """A body naming more files than a request may hold (its size is within bounds)."""


class PublicRoutes:
    """ASGI middleware that rewords a full queue's answer (Gradio's 503) as "busy, retry".

    Uploads and served files are bounded by :class:`uploads.UploadRoutes`.
    """

    def __init__(self, app: Any, queue_size: int) -> None:
        self.app, self.queue_size = app, queue_size

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Reword a full queue's answer."""
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.endswith("/queue/join") and "/call/" not in path:
            await self.app(scope, receive, send)
            return
        busy = False

        async def reworded(message: dict[str, Any]) -> None:
            nonlocal busy
            if message["type"] == "http.response.start" and message["status"] == 503:
                busy = True
                return
            if busy:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    detail = (
                        f"The server is busy: {self.queue_size} requests are waiting (BRAG_MAX_QUEUE). "
                        "Retry in a minute."
                    )
                    await uploads.json_response(send, 503, {"detail": detail}, {"retry-after": "30"})
                return
            await send(message)

        await self.app(scope, receive, reworded)


# Inputs an event may be called without, at the end of its list (filled with None, which
# means the default): /brag's cost unit and prices came after its first eight inputs.
OPTIONAL_INPUTS = {"run_brag": 4, "run_calibrate": 1}


class Blocks(gr.Blocks):
    """Gradio Blocks that check a call's inputs before Gradio touches them.

    - A wrong input count is refused naming only the counts: Gradio's own message lists every
      value received, a token among them, and prints it to the server log with a traceback.
    - A files input is checked (:func:`uploads.check_file_data`) before Gradio moves a file to
      its cache or downloads a URL: ``check_files`` is set by :func:`build`.
    """

    check_files: Callable[[Any], None] | None = None
    ledger: uploads.UploadLedger | None = None  # the uploads in the store, set by build
    downloads: tuple[gr.File, ...] = ()  # output components whose files may be served

    def serves(self, path: str) -> bool:
        """True for a file Gradio made for one of ``downloads``, and never for an upload."""
        if self.ledger is not None and self.ledger.holds(path):
            return False
        return any(path in {str(Path(p).resolve()) for p in block.temp_files} for block in self.downloads)

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        """Refuse a call with too few inputs or files Gradio should not touch; pad the optional ones."""
        total = len(block_fn.inputs)
        required = total - OPTIONAL_INPUTS.get(block_fn.name, 0)
        if len(inputs) < required:
            extra = f" (up to {total} with the optional ones)" if required < total else ""
            raise gr.Error(
                f"/{block_fn.api_name or block_fn.name} takes {required} inputs{extra}, got "
                f"{len(inputs)}: see the API page for their order",
                print_exception=False,
            )
        inputs.extend([None] * (total - len(inputs)))
        for block, value in zip(block_fn.inputs, inputs, strict=False):
            if isinstance(block, gr.File) and self.check_files is not None:
                self.check_files(value)


class RedactSecrets(logging.Filter):
    """Scrub every log record: URL credentials, bearer tokens, HF tokens, the server's own secrets."""

    def __init__(self, secrets: Secrets) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message without secrets; never drop it."""
        original = message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:  # a traceback names values too
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info, record.exc_text = None, None
        cleaned = self.secrets.scrub(message)
        cleaned = re.sub(r"(\w+://)[^/\s@]+@", r"\1***@", cleaned)
        cleaned = re.sub(r"(?i)(bearer\s+|basic\s+|hf_)[\w.\-+/=]{6,}", r"\1***", cleaned)
        if cleaned != original:  # scrubbed, or a traceback folded in: the record carries it now
            record.msg, record.args = cleaned, ()
        return True


def configure_logging(secrets: Secrets) -> None:
    """One line per event on stderr, every line scrubbed of secrets."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("httpx", "httpx2"):  # a line per HTTP request, with its full URL
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactSecrets(secrets))


def trusted_proxies() -> frozenset[str]:
    """``BRAG_TRUSTED_PROXIES``: proxy addresses whose X-Forwarded-For names the client (``*``: any)."""
    # On a Space every request comes through Hugging Face's proxy, which sets X-Forwarded-For.
    default = "*" if os.environ.get("SPACE_ID") else ""
    try:
        return uploads.trusted_addresses(os.environ.get("BRAG_TRUSTED_PROXIES", default))
    except ValueError as err:
        raise SystemExit(f"BRAG_TRUSTED_PROXIES: {err}") from None


class CallerLimits:
    """How many requests one caller may run at once: per browser tab and per client address.

    A caller is its Gradio session (``session_hash``, one per tab or client) and its address.
    A REST caller can open a new session per call, so the address is the bound that holds; it is
    the peer's, or behind a proxy listed in ``BRAG_TRUSTED_PROXIES`` (``*``: any, as on a
    Space), the last address of ``X-Forwarded-For`` that no trusted proxy wrote. A request over
    either limit is refused at once with "busy, retry"; one that waited in the queue is refused
    when it reaches a worker, which costs that worker microseconds, so queued requests of one
    caller cannot hold the others up.
    """

    def __init__(self, per_session: int, per_address: int, trusted: frozenset[str] = frozenset()) -> None:
        self.per_session, self.per_address, self.trusted = per_session, per_address, trusted
        self._running: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def address(self, request: gr.Request) -> str:
        """The client's address, through trusted proxies."""
        peer = request.client.host if request.client is not None else ""
        return uploads.client_address(peer, request.headers.get("x-forwarded-for", ""), self.trusted)

    @contextmanager
    def slot(self, request: gr.Request | None) -> Iterator[None]:
        """Hold one of the caller's slots for the block; refuse when the caller has none left."""
        if request is None:  # called from Python, not over HTTP
            yield
            return
        keys = [("session", request.session_hash or ""), ("address", self.address(request))]
        with self._lock:
            if self._running[keys[0]] >= self.per_session:
                raise user_error(
                    f"Busy: this session already runs {self.per_session} request(s) "
                    "(BRAG_MAX_PER_SESSION); retry when one has finished."
                )
            if self._running[keys[1]] >= self.per_address:
                raise user_error(
                    f"Busy: your address already runs {self.per_address} request(s) "
                    "(BRAG_MAX_PER_ADDRESS); retry when one has finished."
                )
            self._running.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._running.subtract(keys)
                for key in keys:
                    if self._running[key] <= 0:
                        del self._running[key]


def max_request_bytes(limits: Limits) -> int:
    """``BRAG_MAX_REQUEST_BYTES``: by default room for the largest documents and calibration, escaped."""
    default = 3 * (limits.documents_bytes + limits.labelled_bytes) + limits.calibration_bytes + 1_000_000
    return _env_number("BRAG_MAX_REQUEST_BYTES", default)


# ------------------------------------------------------------------------------------------
# Corpora: named ones indexed once per process, pasted documents per request
# ------------------------------------------------------------------------------------------


def corpus_file(name: str) -> Path:
    """The corpus JSON: from BRAG_DATA_DIR when there, else downloaded once from the Hub."""
    if name == DEMO:
        return DEMO_CORPUS_PATH
    folder, local_names, hub_name = CORPORA[name]
    root = brag.data_dir()
    if root is not None:
        for candidate in (root / folder / f for f in local_names):
            if candidate.is_file():
                return candidate
    from huggingface_hub import hf_hub_download

    repo = os.environ.get("BRAG_CORPUS_REPO", HIPPORAG_REPO)
    try:
        return Path(hf_hub_download(repo_id=repo, filename=hub_name, repo_type="dataset"))
    except Exception as err:  # offline, repository gone, file renamed
        raise user_error(f"cannot download the {name} corpus ({hub_name} from {repo}): {err}") from None


@dataclass(frozen=True)
class MilvusSettings:
    """``BRAG_MILVUS_URI`` (with ``BRAG_MILVUS_TOKEN``): the owner's Milvus, never a caller's.

    ``BRAG_MILVUS_COLLECTIONS`` (comma-separated, default ``brag``) are offered in the corpus
    picker under their own names.
    """

    uri: str
    token: str
    collections: tuple[str, ...]

    @classmethod
    def from_env(cls) -> MilvusSettings | None:
        """The owner's Milvus, or None when ``BRAG_MILVUS_URI`` is unset."""
        uri = os.environ.get("BRAG_MILVUS_URI", "").strip()
        if not uri:
            return None
        names = os.environ.get("BRAG_MILVUS_COLLECTIONS", "brag")
        collections = tuple(n.strip() for n in names.split(",") if n.strip())
        if not collections:
            raise SystemExit("BRAG_MILVUS_COLLECTIONS: name at least one collection")
        return cls(uri, os.environ.get("BRAG_MILVUS_TOKEN", ""), collections)


def open_milvus(settings: MilvusSettings, collection: str) -> Any:
    """A Milvus collection as the corpus (``milvus_corpus.py``); a clear error when it cannot be."""
    import milvus_corpus

    try:
        return milvus_corpus.open_corpus(settings.uri, collection, settings.token)
    except milvus_corpus.MilvusError as err:
        raise user_error(f"The corpus {collection} is not available: {err}.") from None


def own_index() -> tuple[str, Path] | None:
    """``BRAG_CORPUS_DIR``: the owner's collection, indexed by ``python -m brag index``; its name."""
    configured = os.environ.get("BRAG_CORPUS_DIR", "").strip()
    if not configured:
        return None
    folder = Path(configured)
    try:
        return brag.Corpus.saved_name(folder), folder
    except ValueError:
        raise SystemExit(
            f"BRAG_CORPUS_DIR: {folder} is not a folder written by `python -m brag index`"
        ) from None


class CorpusStore:
    """Named corpora, indexed once and shared; pasted document sets, kept to a memory budget."""

    def __init__(
        self, limits: Limits, own: tuple[str, Path] | None = None, milvus: MilvusSettings | None = None
    ) -> None:
        self.limits, self.own, self.milvus = limits, own, milvus
        self.readers = parse_worker.FileReaders(limits.parse_caps())
        # Every corpus a request may name: the demo, the owner's own index and Milvus
        # collections, and the HippoRAG ones.
        collections = list(milvus.collections) if milvus else []
        self.names = [DEMO, *([own[0]] if own else []), *collections, *CORPORA]
        self._corpora: dict[str, brag.Corpus] = {}
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in self.names}
        # Each pasted set with its memory estimate, taken once: the estimate walks every passage.
        self._documents: OrderedDict[str, tuple[brag.Corpus, int]] = OrderedDict()
        self._documents_lock = threading.Lock()
        self.documents_budget = limits.documents_cache_bytes

    def named(self, name: str) -> brag.Corpus:
        """A named corpus, opened once and shared.

        The owner's own index (``BRAG_CORPUS_DIR``) is memory-mapped; a HippoRAG corpus is
        indexed the first time its file is seen and kept under ``BRAG_CACHE_DIR``, so a restart
        memory-maps it instead of indexing it again.
        """
        with self._locks[name]:
            if name not in self._corpora:
                started = time.perf_counter()
                if self.own is not None and name == self.own[0]:
                    corpus = brag.Corpus.load(self.own[1])
                elif self.milvus is not None and name in self.milvus.collections:
                    corpus = open_milvus(self.milvus, name)
                else:
                    corpus = brag.cached_corpus(corpus_file(name), name)
                self._corpora[name] = corpus
                log.info(
                    "opened %s (%d passages) in %.2f s", name, len(corpus), time.perf_counter() - started
                )
            return self._corpora[name]

    def documents(
        self,
        text: str,
        files: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
    ) -> brag.Corpus:
        """Pasted documents and uploaded files, checked against the limits and indexed once.

        Files are read in capped worker processes (``parse_worker.py``), within the request's
        deadline and only while ``cancelled()`` is False. The corpora stay cached in memory
        while the budget allows, and are never written to disk.
        """
        digest = hashlib.sha256(text.encode())
        for name, data in files:
            digest.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(data).digest())
        key = digest.hexdigest()
        with self._documents_lock:
            if key in self._documents:
                self._documents.move_to_end(key)
                return self._documents[key][0]
        pasted = check_documents(text, self.limits) if text.strip() else []
        uploaded = documents_from_files(files, self.limits, self.readers, cancelled, caller) if files else []
        if len(pasted) + len(uploaded) > self.limits.passages:
            count = len(pasted) + len(uploaded)
            raise _too_big("The documents", count, self.limits.passages, "passages", "BRAG_MAX_PASSAGES")
        corpus = brag.Corpus([*pasted, *uploaded])
        size = corpus.memory_bytes()
        with self._documents_lock:
            self._documents[key] = corpus, size
            while self._documents and self.cached_bytes() > self.documents_budget:
                self._documents.popitem(last=False)
            log.info(
                "documents cache: %d sets, %d of %d bytes",
                len(self._documents),
                self.cached_bytes(),
                self.documents_budget,
            )
        return corpus

    def cached_bytes(self) -> int:
        """Estimated memory held by the cached pasted corpora."""
        return sum(size for _, size in self._documents.values())


# ------------------------------------------------------------------------------------------
# Endpoints
# ------------------------------------------------------------------------------------------

ACTION_TEXT = {
    "R1": "R1: reading the top passages",
    "R2": "R2: second retrieval hop",
    "CB": "CB: closed-book samples",
}


class LLMPool:
    """Backends reused across requests, one per (model, token, provider), built under the policy.

    Building an HTTP client costs about 0.1 s (TLS set-up), and every backend is thread-safe, so
    concurrent requests share one. Every request for the local model shares its one runner.
    """

    def __init__(self, policy: EndpointPolicy, models: ModelPolicy, size: int = 64) -> None:
        self._pool: OrderedDict[tuple[str, str, str], llms.LLM] = OrderedDict()
        self._lock = threading.Lock()
        self.policy, self.models = policy, models
        self.size = size

    def get(self, model: Any, hf_token: Any, provider: Any) -> llms.LLM:
        """The backend for this request, built on first use."""
        spec = model.strip() if isinstance(model, str) else ""
        spec = spec or llms.default_model()
        token = (hf_token.strip() if isinstance(hf_token, str) else "") or None
        provider = (provider.strip() if isinstance(provider, str) else "") or "auto"
        if len(spec) > 2_000:
            raise user_error("The model name or URL is too long.")
        if not _PROVIDER.match(provider):
            raise user_error("provider must be an Inference Providers name such as 'auto' or 'together'.")
        key = (spec, hashlib.sha256((token or "").encode()).hexdigest(), provider)
        with self._lock:
            if key in self._pool:
                self._pool.move_to_end(key)
                return self._pool[key]
        try:
            llms.check_token(token)
            backend = self._build(spec, token, provider)
        except (ValueError, llms.LLMError) as err:
            raise user_error(str(err)) from None
        with self._lock:
            backend = self._pool.setdefault(key, backend)
            while len(self._pool) > self.size:
                self._pool.popitem(last=False)
        return backend

    def _build(self, spec: str, token: str | None, provider: str) -> llms.LLM:
        if self.models.owner(spec):
            return llms.make_llm(spec, token, provider)  # the server's own secrets may go there
        if spec == "local" or spec.startswith("local:"):
            return self._local(spec)
        if not spec.startswith(("http://", "https://")):
            return self._hosted(spec, token, provider)
        if any(ch.isspace() for ch in spec) or not urllib.parse.urlsplit(spec).hostname:
            raise ValueError("model: that is not a valid http(s) URL")
        url = spec.partition("#")[0]
        if _has_dot_segments(url):
            raise ValueError("model: the URL's path may not hold '.' or '..' segments or encoded slashes")
        if not self.policy.allow_all and self.policy.prefixes and not self.policy.listed(url):
            raise llms.EndpointRefused(
                f"{llms.redact_url(url)} is not an endpoint this server may call (BRAG_ALLOWED_ENDPOINTS)"
            )
        # A caller's URL gets the caller's token or none, never the server's.
        public_only = not self.policy.allow_all and not self.policy.prefixes
        return llms.make_llm(spec, token, provider, secrets_from_env=False, public_only=public_only)

    def _local(self, spec: str) -> llms.LLM:
        """An embedded model the owner offers: its default, or one ``BRAG_ALLOWED_MODELS`` lists."""
        choice = spec.partition(":")[2]
        if choice and choice not in llms.LOCAL_MODELS:
            names = ", ".join(["local", *(f"local:{name}" for name in llms.LOCAL_MODELS)])
            raise ValueError(f"model: a local model is named {names}; paths are not accepted here")
        if not self.models.listed(spec):
            raise llms.EndpointRefused(
                f"model: {spec} is not offered on this server (its owner lists models in BRAG_ALLOWED_MODELS)"
            )
        return llms.make_llm(spec)

    def _hosted(self, spec: str, token: str | None, provider: str) -> llms.LLM:
        """A Hugging Face model: the server's HF_TOKEN pays only for models the owner lists."""
        if not llms.is_model_id(spec):
            return llms.make_llm(spec)  # raises the error that names the accepted forms
        if self.models.listed(spec):
            return llms.make_llm(spec, token, provider)
        if token is None:
            raise llms.TokenRejected(
                f"model: {spec} needs your own HF token here; this server spends its own only on "
                f"{self.models.describe()} (BRAG_ALLOWED_MODELS)"
            )
        return llms.make_llm(spec, token, provider, secrets_from_env=False)


def _failure(err: Exception) -> gr.Error:
    """The message a user sees for a failed request; never a stack trace, never the token."""
    if isinstance(err, brag.RunAborted):
        report = err.report
        done = report["totals"]["llm_calls"]
        best = report["answer"] or "none yet"
        return user_error(
            f"{err} — work done before the failure: {plural(done, 'LLM call')}, best answer so far: {best}"
        )
    if isinstance(err, ValueError | llms.LLMError):
        return user_error(str(err))
    log.exception("unexpected error")
    return user_error(f"Internal error ({type(err).__name__}); the server is still up, please retry.")


@dataclass(frozen=True)
class Settings:
    """Everything the owner sets through the environment, read and checked once at start-up.

    ``Settings.from_env()`` reads it (a bad value stops the app with a message naming the
    variable); a test builds one directly and passes it to :func:`build`.
    """

    limits: Limits = field(default_factory=Limits)
    endpoints: EndpointPolicy = field(default_factory=EndpointPolicy)
    models: ModelPolicy = field(default_factory=lambda: ModelPolicy("local"))
    secrets: Secrets = field(default_factory=lambda: Secrets(()))
    trusted_proxies: frozenset[str] = frozenset()
    own_index: tuple[str, Path] | None = None  # BRAG_CORPUS_DIR: its name and folder
    milvus: MilvusSettings | None = None  # BRAG_MILVUS_URI: the owner's collections
    concurrency: int = 16
    cache_dir: Path = field(default_factory=brag.cache_dir)

    @classmethod
    def from_env(cls) -> Settings:
        """The settings this process's environment gives."""
        try:  # read now, so a bad value stops the app at start-up, not the first request
            llms.max_response_bytes()
            llms.local_idle_timeout()
        except ValueError as err:
            raise SystemExit(str(err)) from None
        return cls(
            limits=Limits.from_env(),
            endpoints=EndpointPolicy.from_env(),
            models=ModelPolicy.from_env(),
            secrets=Secrets.from_env(),
            trusted_proxies=trusted_proxies(),
            own_index=own_index(),
            milvus=MilvusSettings.from_env(),
            concurrency=concurrency(),
            cache_dir=brag.cache_dir(),
        )


@dataclass
class AskRequest:
    """The inputs of one /brag request, as the caller sent them (checked by the server)."""

    question: Any
    corpus: Any
    documents: Any
    lam: Any
    model: Any
    hf_token: Any
    provider: Any
    calibration: Any
    cost: Any = brag.DEFAULT_COST_UNIT
    price_in: Any = None
    price_out: Any = None
    files: Any = None
    session: str = ""  # the browser session, which may name the files it uploaded before
    gone: Callable[[], bool] = lambda: False  # whether the caller has gone (caller_gone)
    caller: str = ""  # the caller's address, through trusted proxies


class Server:
    """The app's state, built from :class:`Settings`, and the endpoints that use it.

    ``run_brag`` and ``run_calibrate`` are ``/brag`` and ``/calibrate``: each holds one of the
    caller's slots (:class:`CallerLimits`), sets the request's deadline, turns every failure
    into a clear message and scrubs the server's secrets from all it returns.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings, self.limits = settings, settings.limits
        # The shipped calibrations by name: the hand-set prior and those fitted for particular
        # models. A request names one, names one that /calibrate kept, or sends JSON.
        self.shipped = brag.shipped_calibrations()
        self.kept = KeptCalibrations(settings.cache_dir / "calibrations")
        self.store = CorpusStore(settings.limits, settings.own_index, settings.milvus)
        self.llms = LLMPool(settings.endpoints, settings.models)
        per_address = settings.limits.address_share(settings.concurrency)
        self.callers = CallerLimits(settings.limits.per_session, per_address, settings.trusted_proxies)
        self.secrets = settings.secrets
        self.session_files = SessionUploads(settings.limits.files_bytes * 4)
        limits = settings.limits
        self.ledger = uploads.UploadLedger(
            limits.upload_store_bytes, limits.caller_upload_share(), limits.upload_ttl
        )

    def check_files(self, value: Any) -> None:
        """A files input, before Gradio touches the disk (:func:`uploads.check_file_data`)."""
        folder = Path(gr.utils.get_upload_folder()).resolve()
        # A path a session keeps, or one deleted for its age, goes on to read_uploads, which
        # serves the first and explains the second.
        known = lambda path: self.session_files.known(path) or self.ledger.expired(path)  # noqa: E731
        try:
            uploads.check_file_data(value, folder, self.limits.files, known)
        except ValueError as err:
            raise user_error(str(err)) from None

    def pick_corpus(
        self,
        corpus: Any,
        documents: Any,
        files: Any = None,
        session: str = "",
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
    ) -> tuple[brag.Corpus, str]:
        """Uploaded files and pasted documents win over a named corpus; none is an error."""
        given = read_uploads(files, self.limits, self.session_files, session, self.ledger)
        text = documents if isinstance(documents, str) else ""
        if given or text.strip():
            label = ", ".join(name for name, _ in given) if given else "your documents"
            return self.store.documents(text, given, cancelled, caller), label
        name = (corpus or "").strip() if isinstance(corpus, str) else ""
        if name == YOUR_DOCUMENTS:
            raise user_error(
                "“Your documents” is selected but none are given: upload files or paste text, or "
                "choose a corpus."
            )
        if not name:
            raise user_error(
                "No corpus: choose one or paste documents (one passage per line, or a JSON list)."
            )
        if name not in self.store.names:
            raise user_error(f"Unknown corpus: use one of {', '.join(self.store.names)}, or paste documents.")
        return self.store.named(name), name

    def run_brag(
        self,
        question: str,
        corpus: str,
        documents: str,
        lam: float,
        model: str,
        hf_token: str,
        provider: str,
        calibration: str,
        cost: str = brag.DEFAULT_COST_UNIT,
        price_in: float | None = None,
        price_out: float | None = None,
        files: list[str] | None = None,
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio passes it; not an API input
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Answer a question over a corpus, step by step.

        Yields ``(best answer so far, report so far)`` as each step starts (the report's
        ``finished`` is False), then the final ``(answer, report)``. ``cost`` prices the actions
        (calls, tokens, seconds, or usd with the two prices per million tokens).
        """
        ask = AskRequest(
            question,
            corpus,
            documents,
            lam,
            model,
            hf_token,
            provider,
            calibration,
            cost,
            price_in,
            price_out,
            files,
            getattr(request, "session_hash", None) or "",
            caller_gone(),
            self.callers.address(request) if request is not None else "",
        )
        with self._scrubbed_errors(), self.callers.slot(request):
            for answer, report in self._answer(ask):
                yield self.secrets.scrub(answer), self.secrets.scrub_data(report)

    def _answer(self, ask: AskRequest) -> Iterator[tuple[str, dict[str, Any]]]:
        """The run under the request's deadline, each report naming the corpus and the model."""
        question = check_question(ask.question, self.limits)
        lam = check_lam(ask.lam)
        pricing = check_cost(ask.cost, ask.price_in, ask.price_out)
        started = time.monotonic()
        end = started + self.limits.request_timeout
        try:
            with llms.deadline_at(end):
                chosen, label, controller = self._controller(ask, lam, pricing)
            steps = controller.stream(question, chosen)
            while True:
                # Gradio may run each step of a generator in another thread, so the deadline is
                # set around every step rather than once around the loop.
                with llms.deadline_at(end):
                    item = next(steps, None)
                if item is None:
                    break
                answer, report = item
                report.update(
                    corpus=label,
                    engine=chosen.stats().get("engine", "bm25s"),  # which engine served the passages
                    calibration=report["config"]["calibration"],
                    model=model_label(ask.model),
                    elapsed_s=round(time.monotonic() - started, 3),  # the whole request
                )
                yield answer, report
        except gr.Error:
            raise
        except Exception as err:
            raise _failure(err) from None
        _log_answered(report)

    def _controller(
        self, ask: AskRequest, lam: float, pricing: tuple[str, tuple[float, float] | None]
    ) -> tuple[brag.Corpus, str, brag.BRAG]:
        """The corpus, the backend and the calibration a request names, as a controller."""
        chosen, label = self.pick_corpus(
            ask.corpus, ask.documents, ask.files, ask.session, ask.gone, ask.caller
        )
        backend = self.llms.get(ask.model, ask.hf_token, ask.provider)
        cal = read_calibration(
            ask.calibration, label, brag.llm_name(backend), self.shipped, self.kept, self.limits
        )
        unit, prices = pricing
        return chosen, label, brag.BRAG(backend, calibration=cal, lam=lam, cost=unit, prices=prices)

    def run_calibrate(
        self,
        labelled_json: str,
        corpus: str,
        documents: str,
        model: str,
        hf_token: str,
        provider: str,
        files: list[str] | None = None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom)
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio passes it; not an API input
    ) -> str:
        """Fit a calibration for a model and corpus from labelled questions (JSON out; kept by name)."""
        with self._scrubbed_errors(), self.callers.slot(request):
            items = read_labelled(labelled_json, self.limits)
            try:
                with llms.deadline(self.limits.calibrate_timeout):  # one call: no yields inside
                    session = getattr(request, "session_hash", None) or ""
                    caller = self.callers.address(request) if request is not None else ""
                    chosen, label = self.pick_corpus(corpus, documents, files, session, caller_gone(), caller)
                    backend = self.llms.get(model, hf_token, provider)
                    result = _fit(items, chosen, label, backend, model, progress)
            except gr.Error:
                raise
            except Exception as err:
                raise _failure(err) from None
            name = self.kept.keep(result)
            return self.secrets.scrub(json.dumps({**result, "name": name}, indent=1))

    def show_calibration(self, text: Any) -> tuple[Any, Any]:
        """The calibration tab's table and its file to download, for the fit /calibrate just kept.

        The browser sends back /calibrate's JSON, but any caller can send anything here, so
        only the kept name is taken from it: the table and the file are the server's own kept
        copy, and nothing is written.
        """
        data = (
            brag.parse_json(text, "calibration") if isinstance(text, str) and text.startswith("{") else None
        )
        name = data.get("name") if isinstance(data, dict) else None
        path = self.kept.path(name) if isinstance(name, str) else None
        if path is None:
            return gr.update(visible=False), None
        text = path.read_text(encoding="utf-8")
        label = f"Fitted, per action and case: {fitted_on_text(json.loads(text))}"
        return gr.update(value=calibration_frame(text), visible=True, label=label), str(path)

    @contextmanager
    def _scrubbed_errors(self) -> Iterator[None]:
        """A message that leaves the server holds none of its secrets."""
        try:
            yield
        except gr.Error as err:
            # The page shows a message as HTML (Gradio sanitises it, but keeps tags such as img
            # and form), and a message can quote a document or a model: escaped, after scrubbing.
            message = html.escape(self.secrets.scrub(str(err.message)), quote=False)
            raise gr.Error(message, print_exception=False) from None


def caller_gone() -> Callable[[], bool]:
    """Whether the caller of the request this thread runs has gone: a check to ask later.

    Gradio marks a running event not alive when its client disconnects, closed when its
    browser tab goes, and drops it from the running jobs when the client cancels it. Outside an
    event Gradio runs (a direct Python call) the caller never goes.
    """
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    queue = getattr(blocks, "_queue", None)
    if queue is None or event_id is None:
        return lambda: False

    def gone() -> bool:
        try:
            for job in list(queue.active_jobs):
                for event in job or ():
                    if event._id == event_id:
                        return not event.alive or event.closed
        except (AttributeError, TypeError):  # another Gradio: the request's deadline still holds
            return False
        return True  # no longer running: cancelled

    return gone


def _fit(
    items: list[calibrate.Labelled],
    corpus: brag.Corpus,
    label: str,
    backend: llms.LLM,
    model: Any,
    progress: gr.Progress,
) -> dict[str, Any]:
    progress(0.0, desc=f"Running R1, R2 and CB on {len(items)} questions")
    labelled = sum(bool(item.gold) for item in items)
    return calibrate.calibrate(
        items,
        corpus,
        backend,
        on_progress=lambda done, total: progress(done / total, desc=f"Question {done} of {total}"),
        meta={
            "model_spec": model_label(model),
            "corpus": label,
            "note": f"fitted in the app on {len(items)} questions, {labelled} with gold answers",
        },
    )


def model_label(model: Any) -> str:
    """The model a request names, or the default, as reports show it: credentials redacted."""
    spec = model.strip() if isinstance(model, str) else ""
    return llms.redact_url(spec or llms.default_model())


def _log_answered(report: dict[str, Any]) -> None:
    totals = report["totals"]
    log.info(
        "answered: corpus=%s model=%s calls=%d tokens=%d %.2fs",
        report["corpus"],
        report["model"],
        totals["llm_calls"],
        totals["prompt_tokens"] + totals["completion_tokens"],
        totals["wall_time_s"],
    )


def ui_helper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an event that only the page uses (``api_visibility="private"``).

    Gradio's queue still runs such an event for any caller who names its ``fn_index``, with any
    data. So each helper writes nothing, reads no path from its input and is bounded in work,
    and whatever it raises reaches the caller as one plain sentence, never the exception's text
    (which can name server paths).
    """

    @functools.wraps(fn)
    def guarded(*args: Any) -> Any:
        try:
            return fn(*args)
        except gr.Error:
            raise
        except Exception as err:
            log.warning("%s refused its input (%s)", fn.__name__, type(err).__name__)
            raise gr.Error("The page could not show that.", print_exception=False) from None

    return guarded


# ------------------------------------------------------------------------------------------
# Presentation of a report
# ------------------------------------------------------------------------------------------

# What the page draws of a report at most. A server-made report stays far below both; a
# caller can send any report to the page's render event.
MAX_SHOWN_STEPS = 100
MAX_SHOWN_CANDIDATES = 50


def shown_steps(report: Any) -> list[dict[str, Any]]:
    """A report's steps as the page draws them, at most MAX_SHOWN_STEPS of MAX_SHOWN_CANDIDATES each."""
    steps = report.get("steps") if isinstance(report, dict) else None
    if not isinstance(steps, list):
        return []
    shown = []
    for step in steps[:MAX_SHOWN_STEPS]:
        posterior = dict(step["posterior"])
        posterior["candidates"] = list(posterior["candidates"][:MAX_SHOWN_CANDIDATES])
        shown.append({**step, "posterior": posterior})
    return shown


PALETTE = ["#4f46e5", "#059669", "#d97706", "#dc2626", "#0891b2", "#7c3aed"]


def posterior_svg(report: dict[str, Any], width: int = 560, height: int = 230) -> str:
    """A line chart of each candidate's posterior after every step (the residual dashed)."""
    steps = shown_steps(report)
    if not steps:
        return "<p style='opacity:.6'>The posterior after each step appears here.</p>"
    names: dict[str, None] = {}  # first seen first, found in constant time
    for step in steps:
        for cand in step["posterior"]["candidates"]:
            names.setdefault(str(cand["answer"]), None)
    series: dict[str, list[float]] = {name: [] for name in list(names)[: len(PALETTE)]}
    residual = []
    for step in steps:
        probs = {str(c["answer"]): float(c["p"]) for c in step["posterior"]["candidates"]}
        for name, points in series.items():
            points.append(probs.get(name, 0.0))
        residual.append(float(step["posterior"]["residual"]))
    left, right, top, bottom = 44, 30, 10, 26
    plot_w, plot_h = width - left - right, height - top - bottom

    def xy(i: int, p: float) -> tuple[float, float]:
        return left + plot_w * i / max(len(steps) - 1, 1), top + plot_h * (1 - p)

    grey = 'fill="#6b7280" font-size="11"'
    parts = [f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="posterior per step">']
    for tick in (0, 0.25, 0.5, 0.75, 1):
        _, y = xy(0, tick)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" {grey}>{tick:.0%}</text>')
    for i, step in enumerate(steps):
        x, _ = xy(i, 0)
        label = html.escape(f"{step['step']}·{step['action'] or 'stop'}")
        parts.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle" {grey}>{label}</text>')
    lines = [(name, points, PALETTE[k], "") for k, (name, points) in enumerate(series.items())]
    lines.append(("(none of these)", residual, "#9ca3af", ' stroke-dasharray="5 4"'))
    for name, points, color, dash in lines:
        coords = [xy(i, p) for i, p in enumerate(points)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        parts.append(
            f'<polyline class="series" points="{path}" fill="none" stroke="{color}" stroke-width="2.5"{dash}>'
            f"<title>{html.escape(name)}</title></polyline>"
        )
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in coords]
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="margin-right:12px"><span style="display:inline-block;width:10px;height:10px;'
        f'background:{color};border-radius:2px;margin-right:4px"></span>{html.escape(name[:40])}</span>'
        for name, _, color, _ in lines
    )
    return f'<div id="posterior-chart">{"".join(parts)}<div style="font-size:12px">{legend}</div></div>'


def read_labels(seen: dict[str, Any], new_only: bool = True) -> list[str]:
    """What a read looked at: passage titles, or their first words when untitled."""
    passages = seen.get("passages", [])
    if new_only and "new_passages" in seen:  # a second hop: what it added
        passages = passages[len(passages) - len(seen["new_passages"]) :]
    return [p.get("label") or p.get("title") or f"passage {p['id']}" for p in passages]


STEP_COLUMNS = [
    "Step",
    "P(error)",
    "R1",
    "R2",
    "CB",
    "Action",
    "What it read",
    "Answer",
    "Evidence",
    "Follow-up query",
]


def evidence_cell(seen: dict[str, Any]) -> str:
    """What a step's vote rested on, e.g. ``answer p 0.83 · span of passage 1 · level R1:hi``."""
    if seen.get("candidate") is None:
        return ""
    if "samples" in seen:
        return f"level CB_{seen['agreement']}"
    parts = [brag.evidence_text(seen.get("evidence") or {})]
    if seen.get("vote_type"):
        parts.append(f"level {seen['vote_type']}")
    return " · ".join(p for p in parts if p)


def steps_frame(report: dict[str, Any]) -> pd.DataFrame:
    """Each decision and why: P(error), each action's expected gain per call against λ, and what it saw.

    A score that beats λ is marked ✓; "—" means the action was not available at that step.
    """
    lam = report.get("config", {}).get("lam", 0.0)
    rows = []
    for step in report.get("steps", []):
        scores = step.get("scores", {})
        cells = {
            a: (f"{scores[a]:.3f} ✓" if scores[a] > lam else f"{scores[a]:.3f}") if a in scores else "—"
            for a in ACTIONS
        }
        seen = step.get("observation") or {}
        action = step["action"] or "stop"
        if "samples" in seen:
            read, answer = f"{len(seen['samples'])} closed-book samples", seen["answer"] or "NONE"
            answer += f" ({seen['agreement']}/{len(seen['samples'])} agree)" if seen["answer"] else ""
        elif seen:
            read, answer = "; ".join(read_labels(seen)), seen.get("answer") or "NONE"
        else:
            read = answer = "running…" if step["action"] and not report.get("finished", True) else ""
        if action == "stop":
            read = report.get("stop_reason", "")
        p_err = f"{step['posterior']['p_err']:.3f}"
        follow_up = seen.get("follow_up_query", "")
        rows.append(
            [step["step"], p_err, *cells.values(), action, read, answer, evidence_cell(seen), follow_up]
        )
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def totals_markdown(report: dict[str, Any]) -> str:
    """Calls, tokens and time as one line, and the cost in the unit actions were priced in."""
    t = report["totals"]
    cost = report.get("config", {}).get("cost") or {}
    unit = cost.get("unit", "calls")
    priced = sum((s.get("cost") or {}).get("priced", 0.0) for s in report.get("steps", []))
    in_unit = "" if unit == "calls" else f" · priced in {unit}: {priced:.4g}"
    estimated = " (estimated)" if t["tokens_estimated"] else ""
    cached = f" · {t['cached_calls']} from cache" if t["cached_calls"] else ""
    return (
        f"**{t['llm_calls']}** {plural(t['llm_calls'], 'LLM call', number=False)}{cached} · "
        f"**{t['prompt_tokens'] + t['completion_tokens']}** tokens "
        f"({t['prompt_tokens']} prompt + {t['completion_tokens']} completion){estimated} · "
        f"**{t['wall_time_s']:.2f} s** · controller {t['policy_us']:.0f} µs{in_unit} · "
        f"stop: {report['stop_reason']}"
    )


def plural(n: int, noun: str, number: bool = True) -> str:
    """``1 LLM call``, ``2 LLM calls`` (just the noun when ``number`` is False)."""
    word = noun if n == 1 else f"{noun}s"
    return f"{n} {word}" if number else word


def progress_markdown(report: dict[str, Any]) -> str:
    """Where a run is: the step and action now running, the calls so far, the time so far."""
    steps, totals = report.get("steps", []), report.get("totals", {})
    calls, elapsed = totals.get("llm_calls", 0), report.get("elapsed_s", totals.get("wall_time_s", 0.0))
    if report.get("finished", True):
        return f"✔ Done: {plural(calls, 'LLM call')} in {elapsed:.1f} s."
    step = steps[-1]
    doing = f"**Running · step {step['step']} · {ACTION_TEXT[step['action']]}…**"
    return f"{doing} · {plural(calls, 'LLM call')} so far · {elapsed:.1f} s"


# Every ASCII punctuation character: CommonMark shows a backslash-escaped one as itself.
_MARKUP = re.compile(r"([!-/:-@\[-`{-~])")


def as_text(value: Any) -> str:
    """Text from a document, a file name or a model, for a Markdown component: shown as written.

    Every ASCII punctuation character is backslash-escaped and line breaks become spaces, so no
    tag, link, image, heading, emphasis or autolink can form from it.
    """
    return _MARKUP.sub(r"\\\1", " ".join(str(value).split()))


def trust_line(report: dict[str, Any]) -> str:
    """How far to trust the answer (``report["confidence"]``): in bold when it is a guess."""
    confidence = report.get("confidence") or {}
    summary = str(confidence.get("summary") or f"P(correct) ≈ {1 - float(report['p_err']):.0%}")
    summary = as_text(summary[:1].upper() + summary[1:])
    return f"**{summary}**" if confidence.get("guess") else summary


def render(answer: str, report: dict[str, Any] | None) -> tuple[Any, ...]:
    """What the page shows for a report, while the run goes on and when it is done."""
    if not report or not isinstance(report, dict):
        return "", "", posterior_svg({}), gr.update(visible=False), ""
    report = {**report, "steps": shown_steps(report)}
    finished = report.get("finished", True)
    read = list(
        dict.fromkeys(x for s in report["steps"] for x in read_labels(s.get("observation") or {}, False))
    )
    status = (report.get("calibration") or {}).get("status", "")
    if not finished:
        headline = f"### Best so far: {as_text(answer)}" if answer else "### Working…"
    elif answer:
        corpus = as_text(report.get("corpus", ""))
        headline = f"## {as_text(answer)}\n\n{trust_line(report)} · corpus: {corpus}"
        source = (report.get("confidence") or {}).get("source")
        if source:
            headline += f"\n\n> {as_text(source['quote'])}\n>\n> — *{as_text(source['passage'])}*"
    else:
        headline = "## No answer found\n\nNo action returned an answer the controller could vote for."
    if finished:
        headline += f"\n\nRead: {', '.join(map(as_text, read)) if read else 'no passage'}"
        headline += f"\n\nCalibration: {as_text(status)}" if status else ""
    totals = totals_markdown(report) if finished else ""
    table = gr.update(value=steps_frame(report), visible=True)
    return progress_markdown(report), headline, posterior_svg(report), table, totals


def starting() -> tuple[Any, ...]:
    """Clear the last run's outputs the moment a new one starts, so nothing stale stays up."""
    return (
        "**Starting** · loading the corpus and the model…",
        "",
        posterior_svg({}),
        gr.update(visible=False),
        "",
    )


def failed() -> str:
    """The progress line after a failed run (the error itself shows as a message)."""
    return "✖ The run failed (the message says why); the last run's results were cleared."


def fitted_on_text(calibration: Mapping[str, Any]) -> str:
    """Which kind of fit a calibration is, on how many questions."""
    fitted_on = calibration.get("fitted_on") or {}
    n, labelled = fitted_on.get("questions"), fitted_on.get("labelled")
    if fitted_on.get("kind") == "mixed":
        return f"a mixed fit on {n} questions, {labelled} with gold answers (EM over the others)"
    if fitted_on.get("kind") == "unlabelled":
        return f"an unlabelled fit on {n} questions (EM)"
    return f"a labelled fit on {calibration.get('n_questions', n)} questions"


def calibration_frame(text: str) -> pd.DataFrame:
    """A fitted calibration per action and agreement level: q, ρ with its 95 % interval, and D."""
    from scipy.stats import beta

    cal = brag.load_calibration(json.loads(text))
    rates = cal.rates()
    rows = []

    def row(name: str, level: str, q: float, a: float, b: float, rate: float, share: str = "") -> None:
        low, high = beta.ppf([0.025, 0.975], a, b)
        rows.append(
            [name, level, f"{q:.2f}", share, f"{a / (a + b):.2f}", f"{low:.2f} – {high:.2f}", f"{rate:.3f}"]
        )

    for name in ("R1", "R2"):
        prior = cal.actions[name]
        case = "any window" if prior.weak is None else "strong window"
        row(name, case, prior.q, prior.a, prior.b, rates[name])
        if prior.weak is not None:
            weak = prior.on_weak_window()
            row(name, "weak window", weak.q, weak.a, weak.b, rates[f"{name}_weak"])
    same, new = cal.branches()
    q_r2, q_cb = cal.actions["R2"].q, cal.actions["CB"].q
    for case, branch in (("repeats an earlier answer", same), ("new answer", new)):
        row(
            "R2",
            case,
            q_r2,
            branch.a,
            branch.b,
            brag.vote_information(branch.mean, cal.eta),
            f"{branch.pi:.2f}",
        )
    for level in cal.actions["CB"].levels:
        rate = brag.vote_information(level.mean, cal.eta)
        row("CB", f"{level.g} of {cal.m} agree", q_cb, level.a, level.b, rate, f"{level.pi:.2f}")
    columns = ["Action", "Case", "q (answers)", "share", "ρ (right)", "ρ 95 % interval", "information rate D"]
    return pd.DataFrame(rows, columns=columns)


# ------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------

CSS = """
#answer h2 { font-size: 2rem; margin: 0.2rem 0; }
#answer { min-height: 4rem; }
#progress { min-height: 1.6rem; }
#steps th, #steps td { white-space: normal; word-break: normal; overflow-wrap: anywhere; }
#steps th { min-width: 4.5rem; }
"""


def use_documents(documents: Any, corpus: str) -> Any:
    """Pasted documents or uploaded files select "Your documents"; clearing them goes back to Demo."""
    if (isinstance(documents, str) and documents.strip()) or (isinstance(documents, list) and documents):
        return gr.update(value=YOUR_DOCUMENTS)
    return gr.update(value=DEMO if corpus == YOUR_DOCUMENTS else corpus)


INTRO = (
    "# BRAG · cost-aware question answering\n"
    "A Bayesian controller decides which LLM calls are worth making: read the top passages "
    "(R1), take a second retrieval hop (R2), or sample closed-book answers (CB), and stops "
    "when another call is worth less than its price λ."
)


def build(settings: Settings | None = None) -> Blocks:
    """The Gradio Blocks app for ``settings`` (by default the environment's)."""
    server = Server(settings or Settings.from_env())
    choices = [*server.store.names, YOUR_DOCUMENTS]
    # Files Gradio makes for downloads are deleted ten minutes after they were made.
    with Blocks(title="BRAG · cost-aware question answering", delete_cache=(300, 600)) as demo:
        gr.Markdown(INTRO)
        with gr.Tab("Ask"):
            _ask_tab(server, choices)
        with gr.Tab("Calibrate"):
            download = _calibrate_tab(server, choices)
    demo.check_files, demo.ledger, demo.downloads = server.check_files, server.ledger, (download,)
    demo.queue(default_concurrency_limit=server.settings.concurrency, max_size=server.limits.queue_size)
    llms.bound_hub_calls()  # deadlines and response caps hold for Inference Providers calls too
    return demo


def _file_input() -> gr.File:
    """Documents as files, several at once; they are read once and deleted when the request ends."""
    return gr.File(
        label="Your files (optional): .txt .md .pdf .docx .html, or passages as .json / .jsonl",
        file_count="multiple",
        file_types=list(doc_files.SUFFIXES),
        type="filepath",
        elem_id="files",
    )


def _model_row() -> list[gr.Textbox]:
    """The model, HF token and provider inputs, as both tabs show them.

    The model gets a line of its own, so a long id or URL stays readable at 1280 px.
    """
    with gr.Group():
        model = gr.Textbox(
            label="Model",
            placeholder=f"default: {llms.redact_url(llms.default_model())}",
            info="HF model id, an OpenAI-compatible URL, or 'local'",
            elem_id="model",
        )
        with gr.Row():
            hf_token = gr.Textbox(label="HF token", type="password", placeholder="optional", scale=2)
            provider = gr.Textbox(label="Provider", value="auto", scale=1, min_width=100)
    return [model, hf_token, provider]


def _ask_tab(server: Server, choices: list[str]) -> None:
    """The question, its corpus and model on the left; the answer, the chart and the steps."""
    with gr.Row():
        with gr.Column(scale=2):
            question = gr.Textbox(label="Question", placeholder="Ask a question about the corpus", lines=2)
            with gr.Row():
                # Custom values pass through to pick_corpus, which names the valid ones; the API
                # also takes "" with documents, as SPEC's signature has it.
                corpus = gr.Dropdown(
                    choices,
                    value=DEMO,
                    label="Corpus",
                    info="files or pasted documents below select “Your documents”",
                    allow_custom_value=True,
                )
                lam = gr.Slider(0.0, 0.5, value=0.05, step=0.005, label="λ (price of one LLM call)")
            cost = _cost_row()
            files = _file_input()
            documents = gr.Textbox(
                label="Or paste documents (optional: one passage per line, or a JSON list)", lines=3
            )
            model_row = _model_row()
            with gr.Accordion("Advanced: calibration", open=False):
                calibration = gr.Textbox(
                    label="Calibration: empty (the one for this model), a name, or JSON", lines=4
                )
            ask = gr.Button("Ask", variant="primary")
            gr.Examples(EXAMPLES, inputs=[question, corpus])
        with gr.Column(scale=3):
            progress, answer_md, chart, totals = _answer_panel()
    shown = [progress, answer_md, chart, _steps_table(), totals]  # what render() returns, in order
    with gr.Accordion("Raw report", open=False):
        report = gr.JSON(label="report")
    answer = gr.Textbox(label="answer", visible=False)
    for given in (documents, files):
        given.change(ui_helper(use_documents), [given, corpus], corpus, api_visibility="private")
    inputs = [question, corpus, documents, lam, *model_row, calibration, *cost, files]
    for trigger, name in ((ask.click, "brag"), (question.submit, None)):
        started = trigger(starting, None, shown, api_visibility="private", show_progress="hidden")
        ran = started.then(
            server.run_brag,
            inputs,
            [answer, report],
            api_name=name,
            api_visibility="public" if name else "private",
            show_progress="hidden",
        )
        ran.failure(failed, None, progress, api_visibility="private")
    report.change(
        ui_helper(render),
        [answer, report],
        shown,
        api_visibility="private",
        show_progress="hidden",
        trigger_mode="always_last",
    )


def _cost_row() -> list[Any]:
    """The unit actions are priced in, and the two prices when it is usd."""
    with gr.Row():
        unit = gr.Dropdown(
            list(brag.COST_UNITS),
            value=brag.DEFAULT_COST_UNIT,
            label="Price actions in",
            info="relative to one read, so λ keeps its meaning",
            scale=2,
        )
        price_in = gr.Number(label="$ / M input tokens", value=None, visible=False, scale=1)
        price_out = gr.Number(label="$ / M output tokens", value=None, visible=False, scale=1)
    unit.change(ui_helper(show_prices), unit, [price_in, price_out], api_visibility="private")
    return [unit, price_in, price_out]


def show_prices(unit: Any) -> tuple[Any, Any]:
    """The price inputs show only for usd."""
    visible = unit == "usd"
    return gr.update(visible=visible), gr.update(visible=visible)


def _steps_table() -> gr.Dataframe:
    return gr.Dataframe(
        headers=STEP_COLUMNS,
        label=(
            "Steps: each action's expected drop in P(error) per unit of cost (a read = 1), ✓ above λ; "
            "the best one runs"
        ),
        wrap=True,
        visible=False,
        elem_id="steps",
        column_widths=["5%", "7%", "7%", "7%", "7%", "6%", "25%", "15%", "21%"],
    )


def _answer_panel() -> list[Any]:
    """Progress, the headline answer, the totals and the chart (the steps table follows)."""
    # No LaTeX: the answer and its source are a document's and a model's words, shown as written.
    progress = gr.Markdown(elem_id="progress", latex_delimiters=[])
    answer_md = gr.Markdown(elem_id="answer", latex_delimiters=[])
    totals = gr.Markdown(latex_delimiters=[])
    gr.Markdown("**How the belief moved** (posterior after each step)")
    chart = gr.HTML(posterior_svg({}))
    return [progress, answer_md, chart, totals]


def _calibrate_tab(server: Server, choices: list[str]) -> gr.File:
    """Labelled questions, corpus and model in; the fitted table, a download and the JSON out.

    Returns the download, the one component whose files the app serves.
    """
    limits = server.limits
    gr.Markdown(
        "Fit the controller's reliabilities for your model and corpus from your questions "
        f"({limits.labelled_min} to {limits.labelled_max}). Give gold answers where you have them: "
        f"questions without gold are fitted by EM only alongside at least {calibrate.MIN_QUESTIONS} "
        "with gold, and the fit says which kind it is. The fit is kept under the name it returns: "
        "give that name (or paste the JSON) as the calibration on the Ask tab."
    )
    labelled = gr.Textbox(
        label='Questions: [{"question": ..., "gold": [...]}, ...]; "gold" is optional', lines=6
    )
    with gr.Row():
        cal_corpus = gr.Dropdown(choices, value=DEMO, label="Corpus", allow_custom_value=True)
        cal_documents = gr.Textbox(label="Or paste documents (optional)", lines=2)
    cal_files = _file_input()
    model_row = _model_row()
    fit = gr.Button("Calibrate", variant="primary")
    cal_table = gr.Dataframe(
        label="Fitted, per action and case", wrap=True, visible=False, elem_id="calibration-table"
    )
    cal_file = gr.File(label="Download the calibration (JSON)")
    with gr.Accordion("Calibration JSON", open=False):
        cal_out = gr.Code(label="calibration", language="json")
    for given in (cal_documents, cal_files):
        given.change(ui_helper(use_documents), [given, cal_corpus], cal_corpus, api_visibility="private")
    fit.click(
        server.run_calibrate,
        [labelled, cal_corpus, cal_documents, *model_row, cal_files],
        cal_out,
        api_name="calibrate",
        # Its own slots, so an hour-long fit never holds up /brag.
        concurrency_id="calibrate",
        concurrency_limit=limits.calibrate_concurrency,
    ).success(ui_helper(server.show_calibration), cal_out, [cal_table, cal_file], api_visibility="private")
    return cal_file


def launch_options(settings: Settings, demo: Blocks) -> dict[str, Any]:
    """What ``launch`` needs beyond the page: error policy, file serving, the ASGI guards."""
    return {
        "server_name": os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        "theme": gr.themes.Soft(),
        "css": CSS,
        # Only gr.Error's own words reach a caller; any other exception's text (which can name
        # server paths) stays in the log.
        "show_error": False,
        # Gradio serves the kept fit the calibration tab offers for download from there.
        "allowed_paths": [str(settings.cache_dir / "calibrations")],
        "max_file_size": settings.limits.file_bytes,
        "app_kwargs": {
            "middleware": [
                Middleware(
                    RequestSizeLimit,
                    max_bytes=max_request_bytes(settings.limits),
                    # a request's files, and room for the multipart framing
                    upload_bytes=settings.limits.files_bytes + 1_000_000,
                    max_files=settings.limits.files,
                ),
                Middleware(PublicRoutes, queue_size=settings.limits.queue_size),
                Middleware(
                    uploads.UploadRoutes,
                    ledger=demo.ledger,
                    served=demo.serves,
                    trusted=settings.trusted_proxies,
                ),
            ]
        },
    }


def main() -> None:
    """Read the settings, then serve the app until stopped."""
    settings = Settings.from_env()
    configure_logging(settings.secrets)
    demo = build(settings)
    demo.launch(**launch_options(settings, demo))


if __name__ == "__main__":
    main()
