"""The request policy: what a remote caller may send, pick and hold, checked before any work.

Every remote input passes here: the limits (:class:`Limits`), the checks and readers of each
input (``check_*``, ``read_*``), which endpoints and models a caller may name, the server's
secrets, the calibrations /calibrate keeps, session uploads, and how many requests one caller
may run. A refusal is a :class:`RequestRefused` (a ``ValueError``) whose message the caller
reads; ``serving.server`` turns it into the page's error in one place. No Gradio here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import brag
import calibrate
from bragkit import documents as doc_files
from bragkit import llms, storage
from bragkit.serving import parse_worker, uploads

log = logging.getLogger("brag.app")


class RequestRefused(ValueError):
    """A request the policy turns down, with a message the caller reads (and nothing secret)."""


def refused(message: str) -> RequestRefused:
    """A refusal, logged as one line (scrubbed by the log filter), never with a stack trace."""
    log.warning("request failed: %s", message)
    return RequestRefused(message)


class CallerRequest(Protocol):
    """What the policy reads of an HTTP request (a ``gr.Request`` has it)."""

    client: Any
    headers: Mapping[str, str]
    session_hash: str | None


class Secrets:
    """The server's own secret values, and their scrubbing from every text that leaves the server.

    The values are every remote backend's declared credentials (``llms.secret_env_names``:
    ``HF_TOKEN``, ``OPENAI_API_KEY``), ``BRAG_MILVUS_TOKEN`` and the credentials inside ``BRAG_MODEL``'s
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
        # Each backend's declared credentials, and the Milvus server's token.
        names = (*llms.secret_env_names(), "BRAG_MILVUS_TOKEN")
        values = [os.environ.get(name, "") for name in names]
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


# JSON any encoder takes (Gradio's orjson among them): whole numbers within 53 bits (a float's),
# finite floats, string keys, at most this deep.
MAX_JSON_DEPTH = 32
_MAX_SAFE_INT = 2**53


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as any JSON encoder takes it; a part it would refuse becomes a short description.

    A report carries numbers from backends and calibrations a caller chose: one integer past
    64 bits, a NaN or a list nested 300 deep makes Gradio's encoder fail the whole response.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        within = -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT
        return value if within else f"(an integer of {value.bit_length()} bits)"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_JSON_DEPTH:
        return "(nested too deeply)"
    if isinstance(value, dict):
        return {_json_key(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, depth + 1) for v in value]
    return f"({type(value).__name__})"


def _json_key(key: Any) -> str:
    return key if isinstance(key, str) else str(json_safe(key, MAX_JSON_DEPTH))


def env_number(name: str, default: float, kind: type = int) -> Any:
    """A positive setting from the environment; a bad one stops the app with a message naming it."""
    try:
        return llms.positive_setting(name, default, kind)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def concurrency() -> int:
    """``BRAG_CONCURRENCY`` (default 16): how many requests run at once."""
    return env_number("BRAG_CONCURRENCY", 16)


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
    # BRAG_MAX_QUEUED_PER_ADDRESS: events one address has waiting or running; unset, its share
    # of the workers and a quarter of the queue (Limits.queued_share)
    queued_per_address: int | None = None
    helper_bytes: int = 1_000_000  # BRAG_MAX_HELPER_BYTES: a request to one of the page's helpers
    sessions: int = 1_000  # BRAG_MAX_SESSIONS: browser and API sessions whose state Gradio keeps
    calibrate_concurrency: int = 1  # BRAG_CALIBRATE_CONCURRENCY: /calibrate runs at once (own slots)
    # BRAG_MAX_CALIBRATE_QUEUE: /calibrate events (self-tests among them) waiting for a slot, in
    # all; checked before Gradio's queue, so they never crowd /brag out of it
    calibrate_queue: int = 4
    self_test_questions: int = 30  # BRAG_SELF_TEST_QUESTIONS: a self-test keeps at most this many
    self_test_seconds: float = 1_800.0  # BRAG_SELF_TEST_SECONDS: one self-test, writing and running
    # BRAG_SELF_TEST_PROMPT_CHARS: characters of every prompt one self-test sends, in all
    self_test_prompt_chars: int = 3_000_000
    kept_fits: int = 500  # BRAG_MAX_KEPT_FITS: fits /calibrate keeps, in all
    kept_fits_per_address: int = 20  # BRAG_MAX_KEPT_FITS_PER_ADDRESS: one address's share of them
    files: int = 10  # BRAG_MAX_FILES: uploaded files per request
    file_bytes: int = 5_000_000  # BRAG_MAX_FILE_BYTES: bytes per uploaded file
    files_bytes: int = 10_000_000  # BRAG_MAX_FILES_BYTES: bytes of all of a request's files
    pdf_pages: int = 300  # BRAG_MAX_PDF_PAGES: pages per PDF
    text_chars: int = 3_000_000  # BRAG_MAX_TEXT_CHARS: text extracted from a request's files
    upload_store_bytes: int = 200_000_000  # BRAG_MAX_UPLOAD_STORE_BYTES: uploads waiting on disk
    upload_caller_bytes: int = 20_000_000  # BRAG_MAX_UPLOAD_BYTES_PER_CALLER: one address's share of them
    upload_caller_files: int = 50  # BRAG_MAX_UPLOAD_FILES_PER_CALLER: one address's files waiting
    upload_store_files: int = 5_000  # BRAG_MAX_UPLOAD_STORE_FILES: files waiting in all
    upload_ttl: float = 600.0  # BRAG_UPLOAD_TTL_SECONDS: an upload no request read is deleted then
    parse_memory_mb: int = 512  # BRAG_PARSE_MEMORY_MB: a file reader's address space
    parse_cpu_seconds: int = 30  # BRAG_PARSE_CPU_SECONDS: CPU time to read one file (wall: twice it)
    parse_workers: int = 2  # BRAG_PARSE_WORKERS: file readers at once, server-wide

    def file_limits(self) -> doc_files.FileLimits:
        """What one request's files may hold, for :func:`documents.read_files`."""
        return doc_files.FileLimits(
            self.files, self.file_bytes, self.files_bytes, self.pdf_pages, self.text_chars, self.passages
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

    def queued_share(self, concurrency: int) -> int:
        """Events one address may have waiting or running at once (checked before the queue).

        Unset, its share of the workers and a quarter of the queue: however fast one address
        posts, three quarters of the queue stay for the others.
        """
        if self.queued_per_address is not None:
            return self.queued_per_address
        return self.address_share(concurrency) + max(1, self.queue_size // 4)

    def calibrate_share(self) -> int:
        """/calibrate events one address may have waiting or running: its share of the slots."""
        return self.address_share(self.calibrate_concurrency)

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
            "helper_bytes": "BRAG_MAX_HELPER_BYTES",
            "sessions": "BRAG_MAX_SESSIONS",
            "calibrate_concurrency": "BRAG_CALIBRATE_CONCURRENCY",
            "calibrate_queue": "BRAG_MAX_CALIBRATE_QUEUE",
            "self_test_questions": "BRAG_SELF_TEST_QUESTIONS",
            "self_test_seconds": "BRAG_SELF_TEST_SECONDS",
            "self_test_prompt_chars": "BRAG_SELF_TEST_PROMPT_CHARS",
            "kept_fits": "BRAG_MAX_KEPT_FITS",
            "kept_fits_per_address": "BRAG_MAX_KEPT_FITS_PER_ADDRESS",
            "files": "BRAG_MAX_FILES",
            "file_bytes": "BRAG_MAX_FILE_BYTES",
            "files_bytes": "BRAG_MAX_FILES_BYTES",
            "pdf_pages": "BRAG_MAX_PDF_PAGES",
            "text_chars": "BRAG_MAX_TEXT_CHARS",
            "upload_store_bytes": "BRAG_MAX_UPLOAD_STORE_BYTES",
            "upload_caller_bytes": "BRAG_MAX_UPLOAD_BYTES_PER_CALLER",
            "upload_caller_files": "BRAG_MAX_UPLOAD_FILES_PER_CALLER",
            "upload_store_files": "BRAG_MAX_UPLOAD_STORE_FILES",
            "upload_ttl": "BRAG_UPLOAD_TTL_SECONDS",
            "parse_memory_mb": "BRAG_PARSE_MEMORY_MB",
            "parse_cpu_seconds": "BRAG_PARSE_CPU_SECONDS",
            "parse_workers": "BRAG_PARSE_WORKERS",
        }
        defaults = cls()
        values = {
            f: env_number(env, getattr(defaults, f), type(getattr(defaults, f))) for f, env in names.items()
        }
        if "BRAG_MAX_PER_ADDRESS" in os.environ:  # unset means half of BRAG_CONCURRENCY
            values["per_address"] = env_number("BRAG_MAX_PER_ADDRESS", 8)
        if "BRAG_MAX_QUEUED_PER_ADDRESS" in os.environ:  # unset means twice the address's share
            values["queued_per_address"] = env_number("BRAG_MAX_QUEUED_PER_ADDRESS", 16)
        return cls(**values)


def too_big(what: str, size: int, limit: int, unit: str, variable: str) -> RequestRefused:
    """A refusal that names what was too big, by how much, and the setting that bounds it."""
    return refused(f"{what}: {size:,} {unit}, over the limit of {limit:,} ({variable}).")


def check_question(question: Any, limits: Limits, what: str = "The question") -> str:
    """A non-empty question within the length limit, as written and in the form BRAG reads (NFKC)."""
    if not isinstance(question, str) or not question.strip():
        raise refused(f"{what} is empty.")
    size = max(len(question), doc_files.normalized_length(question, limits.question_chars))
    if size > limits.question_chars:
        raise too_big(what, size, limits.question_chars, "characters", "BRAG_MAX_QUESTION_CHARS")
    return question


MIN_PRICE = 1e-6  # dollars per million tokens


def check_cost(unit: Any, price_in: Any, price_out: Any) -> tuple[str, tuple[float, float] | None]:
    """The unit actions are priced in (empty: the default), with the two prices when it is usd."""
    unit = unit.strip() if isinstance(unit, str) and unit.strip() else brag.DEFAULT_COST_UNIT
    if unit not in brag.COST_UNITS:
        raise refused(f"cost must be one of {', '.join(brag.COST_UNITS)}.")
    if unit != "usd":
        return unit, None
    try:
        prices = (float(price_in), float(price_out))
    except (TypeError, ValueError):
        raise refused("cost usd needs the input and output prices, in dollars per million tokens.") from None
    # NaN fails too; a price is 0 or at least a millionth of a dollar, so a read never costs 0.
    if not all(p == 0 or MIN_PRICE <= p <= 10_000 for p in prices) or max(prices) <= 0:
        raise refused(
            "prices must be 0 or lie between 0.000001 and 10,000 dollars per million tokens, not both 0."
        )
    return unit, prices


def check_lam(lam: Any) -> float:
    """λ as a finite number in [0, 10]."""
    try:
        value = float(lam)
    except (TypeError, ValueError):
        raise refused("λ must be a number.") from None
    if not 0 <= value <= 10:  # NaN fails too
        raise refused("λ must lie between 0 and 10.")
    return value


def read_calibration(
    text: Any,
    corpus_label: str | None,
    model: str,
    shipped: Mapping[str, brag.Calibration],
    kept: KeptCalibrations,
    limits: Limits,
) -> brag.Calibration:
    """The calibration a request names: empty, a shipped name, a kept fit's name, or JSON.

    Empty is the one shipped for this model and corpus (``corpus_label`` None: the caller's
    documents), else the hand-set prior. Never a path:
    a kept fit's name is checked against its pattern before its file is opened.
    """
    text = (text or "").strip() if isinstance(text, str) else text
    if not text:
        return brag.shipped_calibration(model, corpus_label, shipped)
    if not isinstance(text, str):
        raise refused("calibration must be JSON text or the name of a calibration.")
    if text in shipped:
        return shipped[text]
    if kept.holds(text):
        return kept.load(text)
    if not text.startswith("{"):
        raise refused(
            "calibration must be the JSON that /calibrate returns, the name it gave, or one of the "
            "shipped names: " + ", ".join(shipped)
        )
    size = len(text.encode())
    if size > limits.calibration_bytes:
        raise too_big(
            "The calibration", size, limits.calibration_bytes, "bytes", "BRAG_MAX_CALIBRATION_BYTES"
        )
    try:
        return brag.calibration_from_dict(brag.parse_json(text, "calibration"))
    except brag.InputError as err:
        raise refused(str(err)) from None


def read_labelled(text: Any, limits: Limits, self_test: bool = False) -> list[calibrate.Labelled]:
    """Questions, with or without gold, from JSON or JSON Lines text (never a path), within limits.

    With ``self_test`` they are added to a self-test's questions: none is fine, and those
    without gold are left out.
    """
    if self_test and (text is None or (isinstance(text, str) and not text.strip())):
        return []
    if not isinstance(text, str) or not text.strip():
        raise refused(
            f'No questions: paste a JSON list of {{"question", "gold": [...]}} objects or of '
            f"questions ({limits.labelled_min} to {limits.labelled_max})."
        )
    size = len(text.encode())
    if size > limits.labelled_bytes:
        raise too_big(
            "The labelled questions", size, limits.labelled_bytes, "bytes", "BRAG_MAX_LABELLED_BYTES"
        )
    if not text.strip().startswith(("[", "{")):
        raise refused(
            'questions must be a JSON list of {"question", "gold": [...]} objects or of questions, '
            "or JSON Lines."
        )
    try:
        items = calibrate.read_questions(text)
    except brag.InputError as err:
        raise refused(str(err)) from None
    minimum = 0 if self_test else limits.labelled_min
    if not minimum <= len(items) <= limits.labelled_max:
        raise refused(
            f"calibration needs at least {limits.labelled_min} and at most {limits.labelled_max} labelled "
            f"questions (BRAG_MIN_LABELLED / BRAG_MAX_LABELLED), got {len(items)}."
        )
    for number, item in enumerate(items, 1):
        check_question(item.question, limits, f"Question {number}")
        for gold in item.gold:
            size = max(len(gold), doc_files.normalized_length(gold, MAX_GOLD_CHARS))
            if size > MAX_GOLD_CHARS:
                raise refused(
                    f"Question {number}: a gold answer of {size:,} characters; answers are short "
                    f"(at most {MAX_GOLD_CHARS:,} characters)."
                )
    return items


# A reader's answer is cut at brag.MAX_ANSWER_CHARS; a gold answer far longer can never match it.
MAX_GOLD_CHARS = 1_000


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
    *,
    folder: Path,
) -> list[tuple[str, bytes]]:
    """The uploaded files' names and bytes, each deleted from disk once read.

    Only files stored in the upload ``folder`` (Gradio's) are read, or ones this session
    uploaded before (``kept``): a path a caller writes into a request never names a place on
    this server.
    """
    if files is None or files == []:
        return []
    files = files if isinstance(files, list) else [files]
    if len(files) > limits.files:
        raise too_big("The upload", len(files), limits.files, "files", "BRAG_MAX_FILES")
    folder = folder.resolve()
    found: list[Path | tuple[str, bytes]] = []
    for item in files:
        path = item.get("path") if isinstance(item, dict) else item
        resolved = Path(path).resolve() if isinstance(path, str) and path and "\0" not in path else None
        if resolved is not None and resolved.is_relative_to(folder) and resolved.is_file():
            found.append(resolved)
        elif resolved is not None and kept is not None and (again := kept.recall(session, str(resolved))):
            found.append(again)
        elif resolved is not None and ledger is not None and ledger.expired(str(resolved)):
            raise refused(
                f"An uploaded file waited more than {limits.upload_ttl:g} s for a question and was deleted "
                "(BRAG_UPLOAD_TTL_SECONDS): upload it again."
            )
        else:
            raise refused("Files must be uploaded with the request (a file input, or handle_file).")
    read: list[tuple[str, bytes]] = []
    try:
        total = 0
        for entry in found:
            name, size = (
                (entry.name, entry.stat().st_size) if isinstance(entry, Path) else (entry[0], len(entry[1]))
            )
            if size > limits.file_bytes:
                raise too_big(name, size, limits.file_bytes, "bytes", "BRAG_MAX_FILE_BYTES")
            total += size
            if total > limits.files_bytes:
                raise too_big("The files", total, limits.files_bytes, "bytes", "BRAG_MAX_FILES_BYTES")
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
        raise refused(f"{err}.") from None
    passages = doc_files.as_passages(rows)
    if len(passages) > limits.passages:
        raise too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    return passages


def check_documents(documents: str, limits: Limits) -> list[Any]:
    """Pasted documents as passages: a JSON list, or one passage per line; within the limits."""
    size = len(documents.encode())
    if size > limits.documents_bytes:
        raise too_big("The documents", size, limits.documents_bytes, "bytes", "BRAG_MAX_DOCUMENTS_BYTES")
    stripped = documents.strip()
    if stripped.startswith(("[", "{")):
        passages = brag.parse_json(stripped, "documents")
        if not isinstance(passages, list):
            raise refused("documents: a JSON document must be a list of strings or of {title, text} objects.")
    else:
        passages = [line for line in stripped.splitlines() if line.strip()]
    if len(passages) > limits.passages:
        raise too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    check_normalized(passages, limits.documents_bytes)
    return passages


def check_normalized(passages: list[Any], limit: int) -> None:
    """Pasted passages hold at most ``limit`` characters in the form BRAG reads (NFKC).

    Each character of the pasted text is at least a byte, so text within the byte limit holds
    at most that many characters as written; NFKC can make one character eighteen, and every
    later step (the index, the reads' checks) works on that form.
    """
    left = limit
    for item in passages:
        fields = [item] if isinstance(item, str) else list(item.values()) if isinstance(item, dict) else []
        for text in fields:
            if isinstance(text, str):
                left -= doc_files.normalized_length(text, max(left, 0))
        if left < 0:
            raise refused(
                f"The documents hold more than {limit:,} characters once normalised (Unicode NFKC, "
                "the form BRAG reads text in): some characters stand for many (BRAG_MAX_DOCUMENTS_BYTES)."
            )


# An Inference Providers name, as a caller may give it ("auto", "together", ...).
PROVIDER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


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


def has_dot_segments(url: str) -> bool:
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
    ``calibration``; only names of that exact form are ever turned into a file name. Each fit
    is kept in a folder of the address that made it (a digest, never the caller's text): one
    address keeps at most ``per_caller`` fits, its least recently used going first, and past
    ``limit`` in all a fit goes from whoever keeps the most, so no caller can push another's out.
    """

    NAME = re.compile(r"^fit-[0-9a-f]{12}$")

    def __init__(self, directory: Path, limit: int = 500, per_caller: int = 20) -> None:
        self.directory, self.limit, self.per_caller = directory, limit, per_caller
        self._lock = threading.Lock()

    def holds(self, name: str) -> bool:
        """True when ``name`` names a kept fit."""
        return self._find(name) is not None

    def path(self, name: str) -> Path | None:
        """The file of a kept fit, for a name of the kept form that exists; else None."""
        return self._find(name)

    def _find(self, name: str) -> Path | None:
        if not self.NAME.match(name):
            return None
        # A fit kept before fits had owners' folders lies at the top.
        for found in [self.directory / f"{name}.json", *self.directory.glob(f"a-*/{name}.json")]:
            if found.is_file():
                return found
        return None

    def load(self, name: str) -> brag.Calibration:
        """A kept fit by name; it counts as used now (the least recently used go first)."""
        if not self.NAME.match(name):
            raise refused("not the name of a kept calibration")
        path = self._find(name)
        try:
            if path is None:
                raise brag.InputError(name)
            found = brag.load_calibration(path)
        except brag.InputError:
            raise refused(f"the kept calibration {name} cannot be read; run /calibrate again") from None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: it was read whole
        return found

    def keep(self, result: dict[str, Any], caller: str = "") -> str:
        """Store a fit that ``caller`` (an address) made and return its name."""
        digest = hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()
        name = f"fit-{digest[:12]}"
        folder = self.directory / f"a-{hashlib.sha256(caller.encode()).hexdigest()[:16]}"
        with self._lock:
            storage.write_atomic(folder / f"{name}.json", json.dumps({**result, "name": name}, indent=1))
            entries = []
            for path in [*self.directory.glob("fit-*.json"), *self.directory.glob("a-*/fit-*.json")]:
                try:
                    entries.append((path.parent.name, path.stat().st_mtime, path))
                except OSError:
                    continue
            for old in fair_evictions(entries, folder.name, self.per_caller, self.limit):
                old.unlink(missing_ok=True)
        return name


def fair_evictions(
    entries: Iterable[tuple[str, float, Any]], owner: str, per_owner: int, total: int
) -> list[Any]:
    """Which of ``entries`` (owner, last used, key) go, so that no one can push another's out.

    ``owner`` (who just added one) keeps at most ``per_owner``, its least recently used going
    first; past ``total`` in all, the least recently used of whoever keeps the most goes.
    """
    held: dict[str, list[tuple[float, Any]]] = {}
    for who, used, key in entries:
        held.setdefault(who, []).append((used, key))
    for kept in held.values():
        kept.sort(key=lambda entry: entry[0])
    gone = []
    mine = held.get(owner, [])
    while len(mine) > max(1, per_owner):
        gone.append(mine.pop(0)[1])
    count = sum(len(kept) for kept in held.values())
    while count > max(1, total):
        most = max((who for who in held if held[who]), key=lambda who: (len(held[who]), -held[who][0][0]))
        gone.append(held[most].pop(0)[1])
        count -= 1
    return gone


class SessionFits:
    """The self-test fit each browser session (or API session) made, by model and corpus.

    A caller's self-test applies to that caller's session unasked, and to requests that name
    it; never to anyone else's. Held in memory, with the shares of :func:`fair_evictions`.
    """

    def __init__(self, limit: int = 10_000, per_address: int = 20) -> None:
        self.limit, self.per_address = limit, per_address
        self._fits: dict[tuple[str, str, str], tuple[str, str, float]] = {}
        self._lock = threading.Lock()

    def remember(self, session: str, address: str, model: str, corpus: str, name: str) -> None:
        """``session`` (from ``address``) made the kept fit ``name`` for ``model`` over ``corpus``."""
        if not session:
            return  # called from Python: there is no session to apply it to
        with self._lock:
            self._fits[session, model, corpus] = (name, address, time.monotonic())
            entries = [(who, used, key) for key, (_, who, used) in self._fits.items()]
            for key in fair_evictions(entries, address, self.per_address, self.limit):
                del self._fits[key]

    def recall(self, session: str, model: str, corpus: str) -> str | None:
        """The name of the fit this session made for ``model`` over ``corpus``, if any."""
        with self._lock:
            found = self._fits.get((session, model, corpus)) if session else None
            if found is None:
                return None
            self._fits[session, model, corpus] = (found[0], found[1], time.monotonic())
            return found[0]


def trusted_proxies() -> uploads.Proxies:
    """``BRAG_TRUSTED_PROXIES`` (addresses, or ``*`` for any peer) and ``BRAG_PROXY_HOPS`` (default 1).

    On a Space every request comes through Hugging Face's proxy, which appends the address it
    was reached from to ``X-Forwarded-For``: ``*`` is the default there, and the client is the
    last hop (``BRAG_PROXY_HOPS`` more proxies in front each append one more).
    """
    default = "*" if os.environ.get("SPACE_ID") else ""
    try:
        trusted = uploads.trusted_addresses(os.environ.get("BRAG_TRUSTED_PROXIES", default))
    except ValueError as err:
        raise SystemExit(f"BRAG_TRUSTED_PROXIES: {err}") from None
    return uploads.Proxies(trusted, env_number("BRAG_PROXY_HOPS", 1))


class CallerLimits:
    """How many requests one caller may run at once: per browser tab and per client address.

    A caller is its Gradio session (``session_hash``, one per tab or client) and its address.
    A REST caller can open a new session per call, so the address is the bound that holds; it is
    the peer's, or behind the proxies of ``BRAG_TRUSTED_PROXIES`` the one they name
    (:class:`uploads.Proxies`). An endpoint with slots of its own (``shares``: /calibrate) also
    gives each address only its share of them. A request over any limit is refused at once
    with "busy, retry"; one that waited in the queue is refused when it reaches a worker, which
    costs that worker microseconds, so queued requests of one caller cannot hold the others up.
    """

    def __init__(
        self,
        per_session: int,
        per_address: int,
        proxies: uploads.Proxies = uploads.Proxies(),  # noqa: B008 (frozen)
        shares: Mapping[str, int] | None = None,
    ) -> None:
        self.per_session, self.per_address, self.proxies = per_session, per_address, proxies
        self.shares = dict(shares or {})
        self._running: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def address(self, request: CallerRequest) -> str:
        """The client's address, through trusted proxies."""
        peer = request.client.host if request.client is not None else ""
        return self.proxies.client(peer, request.headers.get("x-forwarded-for", ""))

    @contextmanager
    def slot(self, request: CallerRequest | None, endpoint: str = "") -> Iterator[None]:
        """Hold one of the caller's slots for the block; refuse when the caller has none left.

        ``endpoint``: one of ``shares``, whose slots the caller's address shares with others.
        """
        if request is None:  # called from Python, not over HTTP
            yield
            return
        address = self.address(request)
        keys = [("session", request.session_hash or ""), ("address", address)]
        limits = [self.per_session, self.per_address]
        if endpoint in self.shares:
            keys.append((endpoint, address))
            limits.append(self.shares[endpoint])
        with self._lock:
            for key, limit in zip(keys, limits, strict=True):
                if self._running[key] >= limit:
                    raise _busy(key[0], limit)
            self._running.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._running.subtract(keys)
                for key in keys:
                    if self._running[key] <= 0:
                        del self._running[key]


def _busy(kind: str, limit: int) -> RequestRefused:
    if kind == "session":
        return refused(
            f"Busy: this session already runs {limit} request(s) (BRAG_MAX_PER_SESSION); retry when "
            "one has finished."
        )
    if kind == "address":
        return refused(
            f"Busy: your address already runs {limit} request(s) (BRAG_MAX_PER_ADDRESS); retry when "
            "one has finished."
        )
    return refused(
        f"Busy: your address already runs {limit} /{kind} request(s), its share of them; retry when "
        "one has finished."
    )
