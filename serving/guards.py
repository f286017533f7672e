"""The guards in front of the endpoints, below Gradio and inside it.

Request size and rate (ASGI), the routes a public server serves, the inputs an event accepts
(``Blocks``), private page helpers (``ui_helper``), and secrets kept out of the log.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

import uploads

from .policy import Limits, Secrets, env_number

log = logging.getLogger("brag.app")


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
      its cache or downloads a URL: ``check_files`` is set by ``app.build``.
    """

    check_files: Callable[[Any], None] | None = None
    ledger: uploads.UploadLedger | None = None  # the uploads in the store, set by app.build
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


def max_request_bytes(limits: Limits) -> int:
    """``BRAG_MAX_REQUEST_BYTES``: by default room for the largest documents and calibration, escaped."""
    default = 3 * (limits.documents_bytes + limits.labelled_bytes) + limits.calibration_bytes + 1_000_000
    return env_number("BRAG_MAX_REQUEST_BYTES", default)


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
