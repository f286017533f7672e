"""What one request may cost, and the refusal a caller reads when it is over a bound.

:class:`Limits` holds every bound the owner sets through the environment (a bad value stops the
app with a message naming it); a request over one, or any input the serving modules turn down,
is a :class:`RequestRefused` (a ``ValueError``) whose message the caller reads, and
``serving.server`` turns it into the page's error in one place. No Gradio here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import calibrate
from bragkit import documents as doc_files
from bragkit import llms
from bragkit.serving import parse_worker

log = logging.getLogger("brag.app")


class RequestRefused(ValueError):
    """A request the policy turns down, with a message the caller reads (and nothing secret)."""


def refused(message: str) -> RequestRefused:
    """A refusal, logged as one line (scrubbed by the log filter), never with a stack trace."""
    log.warning("request failed: %s", message)
    return RequestRefused(message)


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
