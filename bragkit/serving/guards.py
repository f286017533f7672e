"""The guards in front of the endpoints, below Gradio and inside it.

Request size (ASGI: every body, and a smaller bound for the page's helpers), queued events per
address (ASGI, before Gradio's queue), the routes a public server serves (a cancel recorded as
it arrives), the inputs an event accepts and what a session keeps (``Blocks``), private page
helpers (``ui_helper``), and secrets and forged lines kept out of the log.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import re
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gradio as gr

from bragkit.serving import uploads

from .limits import Limits, env_number
from .redaction import Secrets

log = logging.getLogger("brag.app")


# A FileData's "path" key in a JSON body (inside a string value its quote would be escaped).
_PATH_KEY = re.compile(rb'(?<!\\)"path"\s*:')


class RequestSizeLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is refused before it is parsed.

    The per-field limits above act on parsed values; this bounds what a caller can make the
    server read at all (JSON escaping can triple a field's size, hence the allowance). A JSON
    body that names more than ``max_files`` files is refused too, before it is parsed: a list
    of 100,000 FileData would cost the parser and the files check far more than its bytes.

    An event (``queue/join`` by its fn_index, ``/call/<name>`` by its name) may send more than
    ``helper_bytes`` only when ``large(fn_index, name)`` says it takes documents (/brag and
    /calibrate): a page helper that any caller can name takes small inputs.
    """

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        upload_bytes: int | None = None,
        max_files: int | None = None,
        helper_bytes: int | None = None,
        large: Callable[[int | None, str | None], bool] = lambda fn_index, name: True,
    ) -> None:
        self.app, self.max_bytes, self.max_files = app, max_bytes, max_files
        self.upload_bytes = max_bytes if upload_bytes is None else upload_bytes
        self.helper_bytes, self.large = helper_bytes, large

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, counting its body; refuse it with 413 once it is too large."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # An upload's body holds files; every other body is JSON, bounded by its own fields.
        path = scope.get("path", "").rstrip("/")
        upload = path.endswith("/upload")
        limit, variable = (self.upload_bytes if upload else self.max_bytes), "BRAG_MAX_REQUEST_BYTES"
        api = called_api(path) if scope.get("method") == "POST" else None
        if api is not None and self.helper_bytes is not None and not self.large(None, api):
            limit, variable = min(limit, self.helper_bytes), "BRAG_MAX_HELPER_BYTES"
        declared = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            await self._refuse(send, self._too_large(limit, variable))
            return
        if self.helper_bytes is not None and path.endswith("/queue/join"):
            receive = await self._event_body(receive, send, scope)
            if receive is None:
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
                refusal = _TooLarge(self._too_large(limit, variable))
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

    def _too_large(self, limit: int | None = None, variable: str = "BRAG_MAX_REQUEST_BYTES") -> str:
        return f"request body over {limit or self.max_bytes:,} bytes ({variable})"

    async def _event_body(self, receive: Any, send: Any, scope: dict[str, Any]) -> Any:
        """An event's body read whole (within ``max_bytes``), then handed on; None once refused.

        It is parsed here to learn which event it names (with the parser Gradio uses, so a
        repeated or escaped key means the same to both), which ``scope[FN_INDEX]`` then holds
        for the guards behind this one.
        """
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunk, more = message.get("body", b""), bool(message.get("more_body"))
            size += len(chunk)
            if size > self.max_bytes:
                while more:
                    more = bool((await receive()).get("more_body"))
                await self._refuse(send, self._too_large())
                return None
            chunks.append(chunk)
        body = b"".join(chunks)
        if self.max_files is not None and len(_PATH_KEY.findall(body)) > self.max_files:
            await self._refuse(send, f"a request names at most {self.max_files:,} files (BRAG_MAX_FILES)")
            return None
        scope[FN_INDEX] = _fn_index(body)
        if size > (self.helper_bytes or 0) and not self.large(scope[FN_INDEX], None):
            await self._refuse(send, self._too_large(self.helper_bytes, "BRAG_MAX_HELPER_BYTES"))
            return None
        return _replayed(body, receive)

    async def _refuse(self, send: Any, why: str) -> None:
        await uploads.json_response(send, 413, {"error": why})


_CALL = re.compile(r"/call/(?:v2/)?([^/]+)$")
_CALL_RESULT = re.compile(r"/call/(?:v2/)?[^/]+/([^/]+)$")
# The scope key under which RequestSizeLimit leaves the fn_index a queue/join body names.
FN_INDEX = "brag.fn_index"


def _replayed(body: bytes, receive: Any) -> Any:
    """A receive that hands on ``body``, already read whole, then whatever the client sends next."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()  # after the body: the client's disconnect, when it comes
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def called_api(path: str) -> str | None:
    """The endpoint a ``POST /call/<name>`` (or ``/call/v2/<name>``) starts; None for another path."""
    found = _CALL.search(path)
    return found.group(1) if found else None


def _fn_index(body: bytes) -> int | None:
    """The event a ``queue/join`` body names, as Gradio will read it; None when it names none."""
    try:
        index = json.loads(body).get("fn_index")
    except (ValueError, AttributeError, RecursionError):
        return None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


class _TooLarge(Exception):
    """A body past a bound: its message says which."""


class _TooMany(_TooLarge):
    """A body naming more files than a request may hold (its size is within bounds)."""


class PublicRoutes:
    """ASGI middleware for the routes a public server serves as Gradio would not.

    - A full queue's answer (Gradio's 503) is reworded as "busy, retry".
    - A ``/cancel`` is recorded (``cancelled(event_id)``) before Gradio handles it: Gradio's
      cancel waits for the running call to return, and the record lets that call end at its
      next check instead (``serving.server.caller_gone``).
    - ``/deep_link`` is refused: it would write a session's inputs, a caller's token among
      them, to a file under the upload folder for anyone holding the session's hash.
    - An opened result stream is recorded (``watched(session or event id, is_event)``): an event
      nobody watches has no caller waiting for it (``serving.server.caller_gone``).

    Uploads and served files are bounded by :class:`uploads.UploadRoutes`.
    """

    def __init__(
        self,
        app: Any,
        queue_size: int,
        cancelled: Callable[[str], None] = lambda event: None,
        watched: Callable[[str, bool], None] = lambda key, is_event: None,
    ) -> None:
        self.app, self.queue_size, self.cancelled, self.watched = app, queue_size, cancelled, watched

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Reword a full queue's answer, record a cancel or a watched stream, refuse a deep link."""
        path = scope.get("path", "").rstrip("/") if scope["type"] == "http" else ""
        if scope.get("method") == "GET":
            self._record_stream(path, scope.get("query_string", b""))
        if path.endswith("/deep_link"):
            await uploads.json_response(send, 404, {"detail": "Not Found"})
            return
        if path.endswith("/cancel") and scope.get("method") == "POST":
            receive = await self._recorded_cancel(receive, send)
            if receive is not None:
                await self.app(scope, receive, send)
            return
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

    def _record_stream(self, path: str, query: bytes) -> None:
        """A result stream being opened: ``queue/data`` names its session, ``/call/<name>/<id>`` its event."""
        if path.endswith("/queue/data"):
            found = urllib.parse.parse_qs(query.decode("latin-1")[:2_000]).get("session_hash", [])
            if found and len(found[0]) <= 200:
                self.watched(found[0], False)
        elif (result := _CALL_RESULT.search(path)) is not None and len(result.group(1)) <= 200:
            self.watched(result.group(1), True)

    async def _recorded_cancel(self, receive: Any, send: Any) -> Any:
        """A cancel's body (a few names), read and recorded, then handed on; None once refused."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunk, more = message.get("body", b""), bool(message.get("more_body"))
            size += len(chunk)
            if size > CANCEL_BYTES:
                await uploads.json_response(
                    send, 413, {"error": f"a cancel holds at most {CANCEL_BYTES:,} bytes"}
                )
                return None
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            event = json.loads(body).get("event_id")
        except (ValueError, AttributeError, RecursionError):
            event = None
        if isinstance(event, str):
            self.cancelled(event)
        return _replayed(body, receive)


CANCEL_BYTES = 10_000  # a cancel names a session, an event and an fn_index


class EventShare:
    """ASGI middleware: one address holds at most ``limit`` events, queued or running.

    Gradio's queue is shared by everyone and bounded as a whole (``BRAG_MAX_QUEUE``), and the
    per-address check of :class:`~serving.callers.CallerLimits` runs only once an event reaches
    a worker; so one address posting events without waiting for them could fill the queue for
    everyone. Counted here before an event is queued: the events of the address in the queue
    and among the running jobs, and those of its requests still on their way in.

    An event of a concurrency group with slots of its own (``groups``: /calibrate and the
    self-test, whose events wait long) is also bounded by that group's own numbers: per address
    and in all, events waiting or running. ``group_of(fn_index, api_name)`` names an event's
    group; a queue/join's fn_index is the one :class:`RequestSizeLimit` left in the scope.
    """

    def __init__(
        self,
        app: Any,
        blocks: gr.Blocks,
        proxies: uploads.Proxies,
        limit: int,
        groups: Mapping[str, tuple[int, int]] | None = None,
        group_of: Callable[[int | None, str | None], str | None] = lambda fn_index, name: None,
        settle: float = 1.0,
    ) -> None:
        self.app, self.blocks, self.proxies, self.limit = app, blocks, proxies, limit
        self.groups, self.group_of = dict(groups or {}), group_of
        self.settle = settle  # seconds an event past its group's bound waits before its 429
        self._joining: Counter[tuple[str, str]] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Refuse a new event past the address's share; pass everything else on."""
        path = scope.get("path", "").rstrip("/") if scope["type"] == "http" else ""
        starts_event = path.endswith("/queue/join") or called_api(path) is not None
        if scope.get("method") != "POST" or not starts_event:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        address = self.proxies.client((scope.get("client") or ("", 0))[0], headers.get("x-forwarded-for", ""))
        group = self.group_of(scope.get(FN_INDEX), called_api(path))
        group = group if group in self.groups else ""
        detail = self._refusal(address, group)
        waited = 0.0
        while detail is not None and group and waited < self.settle:
            # The caller's last event may be finishing: Gradio sends its result a moment before
            # it leaves the running jobs, and a caller may ask again at once.
            await asyncio.sleep(0.05)
            waited += 0.05
            detail = self._refusal(address, group)
        if detail is not None:
            while (await receive()).get("more_body"):  # read the body, so the caller sees the answer
                pass
            await uploads.json_response(send, 429, {"detail": detail}, {"retry-after": "10"})
            return
        self._joining[address, group] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._joining[address, group] -= 1
            if self._joining[address, group] <= 0:
                del self._joining[address, group]

    def _refusal(self, address: str, group: str) -> str | None:
        """Why a new event of ``address`` in ``group`` is refused, or None."""
        events = self._events()
        joining = sum(n for (who, _), n in self._joining.items() if who == address)
        if joining + sum(1 for who, _ in events if who == address) >= self.limit:
            return (
                f"Busy: your address already has {self.limit} requests waiting or running "
                "(BRAG_MAX_QUEUED_PER_ADDRESS); retry when one has finished."
            )
        if not group:
            return None
        per_address, in_all = self.groups[group]
        mine = self._joining[address, group] + sum(1 for who, g in events if who == address and g == group)
        if mine >= per_address:
            return (
                f"Busy: your address already has {mine} /{group} request(s) waiting or running, its "
                "share of them; retry when it has finished."
            )
        everyone = sum(n for (_, g), n in self._joining.items() if g == group)
        if everyone + sum(1 for _, g in events if g == group) >= in_all:
            return (
                f"Busy: {in_all} /{group} requests are waiting or running (BRAG_MAX_CALIBRATE_QUEUE); "
                "retry in a few minutes."
            )
        return None

    def _events(self) -> list[tuple[str, str]]:
        """The address and concurrency group of each event in Gradio's queue and among its running jobs."""
        queue = getattr(self.blocks, "_queue", None)
        if queue is None:
            return []
        waiting = queue.event_queue_per_concurrency_id.values()
        events = [event for line in waiting for event in line.queue]
        events += [event for job in queue.active_jobs if job for event in job]
        return [(self._address_of(event), getattr(event, "concurrency_id", "") or "") for event in events]

    def _address_of(self, event: Any) -> str:
        """An event's address, worked out once: a flood asks for every queued event's, each time."""
        known = getattr(event, "_brag_address", None)
        if known is not None:
            return known
        request = getattr(event, "request", None)
        peer = getattr(getattr(request, "client", None), "host", "") or ""
        address = self.proxies.client(peer, request.headers.get("x-forwarded-for", "")) if request else ""
        try:
            event._brag_address = address
        except AttributeError:  # an event that takes no attributes: worked out each time
            pass
        return address


def optional_inputs(block_fn: Any) -> int:
    """How many of an event's inputs, at the end of its list, it may be called without.

    Its function's parameters that take them and have a default (filled with None, which means
    the default): /brag's cost unit, prices and files came after its first eight inputs.
    """
    try:
        parameters = list(inspect.signature(block_fn.fn).parameters.values())[: len(block_fn.inputs)]
    except (TypeError, ValueError):  # no signature to read: every input is required
        return 0
    return sum(1 for p in parameters if p.default is not inspect.Parameter.empty)


class Blocks(gr.Blocks):
    """Gradio Blocks that check a call's inputs before Gradio touches them.

    - A wrong input count is refused naming only the counts: Gradio's own message lists every
      value received, a token among them, and prints it to the server log with a traceback.
    - A files input is checked (:func:`uploads.check_file_data`) before Gradio moves a file to
      its cache or downloads a URL: ``check_files`` is set by ``app.build``.
    - A session keeps none of an event's values (:meth:`process_api`).
    """

    check_files: Callable[[Any], None] | None = None
    ledger: uploads.UploadLedger | None = None  # the uploads in the store, set by app.build
    downloads: tuple[gr.File, ...] = ()  # output components whose files may be served
    document_events: frozenset[int] = frozenset()  # /brag and /calibrate's fn indices, by app.build
    cancels: Any = None  # serving.server.RecentIds of cancelled events, set by app.build
    streams: Any = None  # serving.server.WatchedStreams, set by app.build

    def takes_documents(self, fn_index: int | None, name: str | None) -> bool:
        """True for an event that may be sent documents, named by its fn_index or its API name."""
        if name is not None:
            return any(fn.api_name == name for i, fn in self.fns.items() if i in self.document_events)
        return fn_index in self.document_events

    def watch(self, key: str, is_event: bool) -> None:
        """A result stream opened for a session (``queue/data``) or a REST event: its session is watched."""
        queue = getattr(self, "_queue", None)
        if queue is None or self.streams is None:
            return
        if is_event:
            event = queue.event_ids_to_events.get(key)
            key = getattr(event, "session_hash", None) if event is not None else None
        if key:
            self.streams.add(key)

    def holds_session(self, session: str) -> bool:
        """Whether Gradio's queue holds an event of ``session`` (waiting, running or undelivered)."""
        queue = getattr(self, "_queue", None)
        return queue is not None and session in queue.pending_event_ids_session

    def group_of(self, fn_index: int | None, name: str | None) -> str | None:
        """The concurrency group of the event named by its fn_index or its API name, if any."""
        for i, fn in self.fns.items():
            if (name is not None and fn.api_name == name) or (name is None and i == fn_index):
                return fn.concurrency_id
        return None

    def serves(self, path: str) -> bool:
        """True for a file Gradio made for one of ``downloads``, and never for an upload."""
        if self.ledger is not None and self.ledger.holds(path):
            return False
        return any(path in {str(Path(p).resolve()) for p in block.temp_files} for block in self.downloads)

    async def process_api(
        self, block_fn: Any, inputs: list[Any], state: Any = None, *args: Any, **kwargs: Any
    ):
        """Gradio's run of one event (or one step of a generator), after which its session forgets the values.

        Gradio copies each input and output of an event into the session's state, for deep
        links (refused here, :class:`PublicRoutes`), and keeps thousands of sessions; a REST
        caller makes a new session with every call. So each session would keep a request's
        documents, its token and its report. Cleared, a session holds only the components an
        event updated, which the page's next event may need.
        """
        try:
            return await super().process_api(block_fn, inputs, state, *args, **kwargs)
        finally:
            if state is not None:
                state.config_values.clear()

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        """Refuse a call with too few inputs or files Gradio should not touch; pad the optional ones."""
        total = len(block_fn.inputs)
        required = total - optional_inputs(block_fn)
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


# What str.splitlines() breaks a line at: in a logged value (a file name, a model's words) any
# of them would start a line the log's reader takes for the server's own.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text: str) -> str:
    r"""``text`` with each line break written as its escape (``\n``, ``\u2028``): one log line."""
    return _LINE_BREAKS.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


class RedactSecrets(logging.Filter):
    """Scrub every log record: URL credentials, bearer tokens, HF tokens, the server's own secrets.

    A record is one line (line breaks inside it are escaped); a traceback folded in keeps its
    own lines, each escaped the same way.
    """

    def __init__(self, secrets: Secrets) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message without secrets and forged lines; never drop it."""
        original = record.getMessage()
        message = one_line(original)
        if record.exc_info and record.exc_info[1] is not None:  # a traceback names values too
            trace = logging.Formatter().formatException(record.exc_info)
            message += "\n" + "\n".join(one_line(line) for line in trace.split("\n"))
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
