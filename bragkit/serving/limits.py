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
from bragkit.serving import parse_worker, uploads

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
    passages: int = 50_000  # BRAG_MAX_PASSAGES: pasted, and from a request's files
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
    # The /calibrate lane (bragkit.serving.lane): the longest a request waits in line for a slot,
    # a running self-test's share once others wait, and one address's seconds of it an hour.
    self_test_wait: float = 600.0  # BRAG_SELF_TEST_WAIT_SECONDS
    self_test_share: float = 300.0  # BRAG_SELF_TEST_SHARE_SECONDS
    self_test_per_hour: float = 1_800.0  # BRAG_SELF_TEST_SECONDS_PER_HOUR
    kept_fits: int = 500  # BRAG_MAX_KEPT_FITS: fits /calibrate keeps, in all
    kept_fits_per_address: int = 20  # BRAG_MAX_KEPT_FITS_PER_ADDRESS: one address's share of them
    # BRAG_MAX_FILES: files per request, a .zip's members counted as files (a manual's tree)
    files: int = 300
    # BRAG_MAX_FILE_BYTES: bytes per file (a .zip's member unpacked; a .zip itself, all the files')
    file_bytes: int = 5_000_000
    # BRAG_MAX_FILES_BYTES: bytes of all of a request's files (a .zip's members unpacked)
    files_bytes: int = 30_000_000
    pdf_pages: int = 300  # BRAG_MAX_PDF_PAGES: pages per PDF
    text_chars: int = 15_000_000  # BRAG_MAX_TEXT_CHARS: text extracted from a request's files
    upload_store_bytes: int = 640_000_000  # BRAG_MAX_UPLOAD_STORE_BYTES: uploads waiting on disk
    # BRAG_MAX_UPLOAD_BYTES_PER_CALLER: one address's share of them (Limits.caller_upload_share)
    upload_caller_bytes: int = 64_000_000
    # BRAG_MAX_UPLOAD_FILES_PER_CALLER: one address's files waiting (Limits.caller_upload_files)
    upload_caller_files: int = 600
    upload_store_files: int = 12_000  # BRAG_MAX_UPLOAD_STORE_FILES: files waiting in all
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
        """One caller's share of the upload store, in bytes of disk: never less than one request's files.

        Each file is charged its blocks and a block for its folder (``uploads.disk_charge``), and an
        upload is admitted by its body's size, framing included: a request's files at their limits
        fit in one share.
        """
        request = self.files_bytes + 2 * uploads.BLOCK * self.files + uploads.MB
        return max(self.upload_caller_bytes, request)

    def caller_upload_files(self) -> int:
        """Files one caller may have waiting in the upload store: never fewer than one request's."""
        return max(self.upload_caller_files, self.files)

    def upload_file_bytes(self) -> int:
        """The largest file the upload route takes: a .zip may hold all of a request's files."""
        return max(self.file_bytes, self.files_bytes)

    def upload_body_bytes(self) -> int:
        """The largest upload body: a request's files, and room for the multipart framing."""
        return self.upload_file_bytes() + uploads.MB

    def check(self) -> None:
        """The bounds that must hold together; ValueError names the settings that do not.

        The upload store holds at least two callers' shares (bytes and files), so one caller
        can never fill it for everyone.
        """
        share, files = self.caller_upload_share(), self.caller_upload_files()
        if self.upload_store_bytes < 2 * share:
            raise ValueError(
                f"BRAG_MAX_UPLOAD_STORE_BYTES ({self.upload_store_bytes:,}) must hold at least two callers' "
                f"shares of {share:,} bytes (BRAG_MAX_UPLOAD_BYTES_PER_CALLER, at least one request's files: "
                "BRAG_MAX_FILES_BYTES and a block per file); raise it or lower those"
            )
        if self.upload_store_files < 2 * files:
            raise ValueError(
                f"BRAG_MAX_UPLOAD_STORE_FILES ({self.upload_store_files:,}) must hold at least two callers' "
                f"shares of {files:,} files (BRAG_MAX_UPLOAD_FILES_PER_CALLER, at least BRAG_MAX_FILES); "
                "raise it or lower those"
            )

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

    def calibrate_events(self) -> int:
        """/calibrate events let in at once: the lane's slots, its line, and one newcomer.

        The lane (:class:`bragkit.serving.lane.Lane`) holds them to ``calibrate_concurrency``
        running; the one more lets a newcomer reach a full line and take the place of a waiter
        that has had more of the lane.
        """
        return self.calibrate_concurrency + self.calibrate_queue + 1

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
            "self_test_wait": "BRAG_SELF_TEST_WAIT_SECONDS",
            "self_test_share": "BRAG_SELF_TEST_SHARE_SECONDS",
            "self_test_per_hour": "BRAG_SELF_TEST_SECONDS_PER_HOUR",
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
        limits = cls(**values)
        try:
            limits.check()
        except ValueError as err:
            raise SystemExit(str(err)) from None
        return limits


def too_big(what: str, size: int, limit: int, unit: str, variable: str) -> RequestRefused:
    """A refusal that names what was too big, by how much, and the setting that bounds it."""
    return refused(f"{what}: {size:,} {unit}, over the limit of {limit:,} ({variable}).")
