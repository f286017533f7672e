"""Deadlines, retries, the SSRF guard, and the transport that caps each response's size and time.

The outbound side of the remote backends: nothing here knows what a chat completion is.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import httpcore2
import httpx2
from httpcore2._backends.sync import SyncStream  # the stock socket stream, wrapped below

from brag import Completion

from .errors import Cancelled, LLMTimeout, MalformedResponse, ResponseTooLarge, Retryable


@dataclass
class RetryPolicy:
    """Exponential backoff with jitter on 429 / 5xx / connection errors; nothing else retries.

    One policy serves every request of a backend, from any number of threads. A ``Retry-After``
    pauses all of them, not just the request that got it, and each resumes at its own random
    moment within ``jitter`` of the pause's end, so many callers told to wait do not all come
    back at once.
    """

    max_retries: int = 3
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25  # up to this fraction added at random
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    _paused_until: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        base = retry_after if retry_after is not None else self.base_delay * 2**attempt
        return min(base, self.max_delay) * (1 + self.jitter * random.random())

    def run(self, send: Callable[[], Completion]) -> Completion:
        """Call ``send`` until it succeeds, fails for good, or the retries run out."""
        for attempt in range(self.max_retries + 1):
            self._wait_out_pause()
            try:
                return send()
            except Retryable as err:
                wait = self.delay(attempt, err.retry_after)
                left = time_left()
                if attempt == self.max_retries or (left is not None and wait >= left):
                    raise err.final from None  # no retry left, or none that could end in time
                if err.retry_after is None:
                    self._pause(wait)
                    continue
                with self._lock:  # the wait itself happens, for every caller, at the loop's top
                    pause = self.clock() + min(err.retry_after, self.max_delay)
                    self._paused_until = max(self._paused_until, pause)
        raise AssertionError("unreachable")

    def paused_for(self) -> float:
        """Seconds left of the pause a Retry-After put on every caller (0 when none)."""
        with self._lock:
            return max(0.0, self._paused_until - self.clock())

    def _wait_out_pause(self) -> None:
        left = self.paused_for()
        if left > 0:
            wait = left * (1 + self.jitter * random.random())
            budget = time_left()
            if budget is not None and wait >= budget:
                raise LLMTimeout("the endpoint asked to wait (Retry-After) past this request's time limit")
            self._pause(wait)

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, in slices while the caller may cancel (then :class:`Cancelled` ends it)."""
        remaining = seconds
        while remaining > 0:
            step = poll_seconds(remaining) or remaining
            self.sleep(step)
            remaining -= step
            check_cancelled()


# ------------------------------------------------------------------------------------------

DEADLINE: ContextVar[float | None] = ContextVar("brag_llm_deadline", default=None)


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Every LLM call inside the block must end within ``seconds`` from now.

    Nested deadlines keep the earlier one. Remote backends clamp every socket operation to it
    (an endpoint that trickles one byte at a time cannot stretch a call past it), the local
    model stops its worker at it, and a call that starts after it raises :class:`LLMTimeout`.
    """
    if seconds is None:
        yield
        return
    end = time.monotonic() + seconds
    outer = DEADLINE.get()
    token = DEADLINE.set(end if outer is None else min(end, outer))
    try:
        yield
    finally:
        DEADLINE.reset(token)


@contextmanager
def deadline_at(end: float) -> Iterator[None]:
    """:func:`deadline` with the end given as a ``time.monotonic()`` reading."""
    with deadline(end - time.monotonic()):
        yield


def time_left(limit: float | None = None, error: type[Exception] = LLMTimeout) -> float | None:
    """Seconds until the current deadline (capped at ``limit``); ``error`` once it has passed.

    :class:`Cancelled` once the request's caller has gone (:func:`cancellable`).
    """
    check_cancelled()
    end = DEADLINE.get()
    if end is None:
        return limit
    left = end - time.monotonic()
    if left <= 0:
        raise error("the time limit for this request ran out")
    return left if limit is None else min(limit, left)


CANCELLED: ContextVar[Callable[[], bool] | None] = ContextVar("brag_llm_cancelled", default=None)

# How often a call waiting on its backend asks whether its caller has gone: so a cancel (or a
# caller hanging up) ends the call within this, not when the backend answers.
CANCEL_POLL_SECONDS = 0.5


@contextmanager
def cancellable(gone: Callable[[], bool]) -> Iterator[None]:
    """Every LLM call inside the block stops with :class:`Cancelled` once ``gone()`` is true.

    Asked before each call, at every socket operation, and every ``CANCEL_POLL_SECONDS``
    while a call waits on its backend (a remote answer or the local model's worker).
    """
    token = CANCELLED.set(gone)
    try:
        yield
    finally:
        CANCELLED.reset(token)


def check_cancelled() -> None:
    """:class:`Cancelled` when the current request's caller has gone; nothing otherwise."""
    gone = CANCELLED.get()
    if gone is not None and gone():
        raise Cancelled("the request was cancelled, or its caller went away: the call was stopped")


def poll_seconds(left: float | None) -> float | None:
    """How long one wait may block: ``left``, or less while a caller may cancel."""
    if CANCELLED.get() is None:
        return left
    return CANCEL_POLL_SECONDS if left is None else min(left, CANCEL_POLL_SECONDS)


class Refused(OSError):
    """Raised inside the connection pool; surfaces as EndpointRefused."""


# IPv6 prefixes that carry an IPv4 address in their last 32 bits (RFC 6052 NAT64, RFC 4291's
# deprecated IPv4-compatible form); 6to4, Teredo and IPv4-mapped have ipaddress properties.
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _carried_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 transition address reaches (none for a plain IPv6 address)."""
    carried = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if any(ip in net for net in _NAT64) or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        carried.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [v4 for v4 in carried if v4 is not None]


def is_public_address(address: str) -> bool:
    """A globally routable unicast address: not loopback, private, link-local, multicast or reserved.

    An IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4, Teredo, IPv4-compatible) is
    judged by the IPv4 address it leads to as well.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        carried = _carried_ipv4(ip)
        if carried:
            return all(v4.is_global and not v4.is_multicast for v4 in carried)
    return ip.is_global and not ip.is_multicast


def redact_url(url: str) -> str:
    """The URL without its user:password part and its query string (where keys often go)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = ("***@" if "@" in parts.netloc else "") + host + (f":{port}" if port else "")
    query = "?***" if parts.query else ""
    return (
        urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        + query
        + (f"#{parts.fragment}" if parts.fragment else "")
    )


class _DeadlineStream(httpcore2.NetworkStream):
    """A connection whose every read and write ends by the current deadline."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self.inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        # Waits in slices while the caller may cancel, so a silent backend cannot hold the call.
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = time_left(None if end is None else max(end - time.monotonic(), 0.0), httpcore2.ReadTimeout)
            wait = poll_seconds(left)
            try:
                return self.inner.read(max_bytes, wait)
            except httpcore2.ReadTimeout:
                if wait == left:
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, time_left(timeout, httpcore2.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None):
        inner = self.inner.start_tls(
            ssl_context, server_hostname, time_left(timeout, httpcore2.ConnectTimeout)
        )
        return _DeadlineStream(inner)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _GuardedBackend(httpcore2.NetworkBackend):
    """Connects to the address it checked, so a name that re-resolves elsewhere cannot slip by."""

    def __init__(self, public_only: bool) -> None:
        self.public_only = public_only

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        timeout = time_left(timeout, httpcore2.ConnectTimeout)
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise httpcore2.ConnectError(f"cannot resolve {host}: {err}") from None
        if self.public_only:
            found = [info for info in found if is_public_address(info[4][0])]
            if not found:
                raise Refused(f"{host} is a loopback, private, link-local or multicast address")
        last: Exception | None = None
        for family, kind, proto, _, address in found:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                if local_address:
                    sock.bind((local_address, 0))
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for option in socket_options or ():
                    sock.setsockopt(*option)
            except TimeoutError:
                sock.close()
                raise httpcore2.ConnectTimeout(f"connecting to {host} timed out") from None
            except OSError as err:
                sock.close()
                last = err
                continue
            return _DeadlineStream(SyncStream(sock))
        raise httpcore2.ConnectError(f"cannot connect to {host}:{port}: {last}")


DEFAULT_MAX_RESPONSE_BYTES = 1_000_000


def positive_setting(name: str, default: float, kind: type = int) -> Any:
    """The environment variable ``name`` as a positive ``kind``; ValueError names it when it is not."""
    raw = os.environ.get(name, "").strip()
    try:
        value = kind(raw) if raw else default
    except ValueError:
        value = 0
    if not value > 0:  # NaN fails too
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


def max_response_bytes() -> int:
    """``BRAG_MAX_RESPONSE_BYTES`` (default 1 MB): the most an LLM response may hold, decompressed."""
    return positive_setting("BRAG_MAX_RESPONSE_BYTES", DEFAULT_MAX_RESPONSE_BYTES)


def _too_large(where: str, limit: int) -> ResponseTooLarge:
    return ResponseTooLarge(f"{where} sent a response over {limit:,} bytes (BRAG_MAX_RESPONSE_BYTES)")


class _CappedStream(httpx2.SyncByteStream):
    """A response body decoded here (identity, gzip or deflate) and cut off past ``limit`` bytes.

    Counting after decompression is what bounds memory: a small gzip can expand a thousandfold.
    """

    def __init__(self, inner: httpx2.SyncByteStream, encoding: str, limit: int, where: str) -> None:
        self.inner, self.limit, self.where = inner, limit, where
        # wbits 47: zlib or gzip framing, detected from the header.
        self.decoder = zlib.decompressobj(47 if encoding in ("gzip", "x-gzip") else 15) if encoding else None
        self.raw_deflate = encoding == "deflate"

    def __iter__(self) -> Iterator[bytes]:
        total = 0
        for chunk in self.inner:
            for part in self._decode(chunk):
                total += len(part)
                if total > self.limit:
                    raise _too_large(self.where, self.limit)
                yield part

    def _decode(self, chunk: bytes) -> Iterator[bytes]:
        if self.decoder is None:
            yield chunk
            return
        try:
            while chunk:
                # max_length bounds each step's output, so one chunk cannot expand without limit.
                yield self.decoder.decompress(chunk, self.limit + 1)
                chunk = self.decoder.unconsumed_tail
        except zlib.error:
            if not self.raw_deflate:
                raise MalformedResponse(f"{self.where} sent a corrupt compressed body") from None
            # Some servers send raw deflate without the zlib header.
            self.decoder, self.raw_deflate = zlib.decompressobj(-15), False
            yield from self._decode(chunk)

    def close(self) -> None:
        self.inner.close()


class GuardedTransport(httpx2.HTTPTransport):
    """httpx2's transport: deadline-bound sockets, public addresses only (optionally), capped bodies.

    A capped response holds at most ``max_bytes`` after decompression. ``capped_methods`` names
    the requests whose responses are capped (all by default): the Hub's shared client caps its
    inference POSTs but not the owner's corpus downloads.
    """

    def __init__(
        self,
        public_only: bool = False,
        max_bytes: int | None = None,
        capped_methods: frozenset[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # httpx2 builds the pool from its arguments (TLS, limits) but takes no network backend,
        # so the pool's is swapped before it has opened any connection.
        self._pool._network_backend = _GuardedBackend(public_only)
        self.max_bytes, self.capped_methods = max_bytes, capped_methods

    def _caps(self, request: httpx2.Request) -> bool:
        return self.max_bytes is not None and (
            self.capped_methods is None or request.method in self.capped_methods
        )

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send the request; a capped response is decoded here and bounded as it is read."""
        if not self._caps(request):
            return super().handle_request(request)
        request.headers["Accept-Encoding"] = "gzip, deflate"
        response = super().handle_request(request)
        encoding = response.headers.get("content-encoding", "").strip().lower()
        where = redact_url(str(request.url.copy_with(query=None)))
        if encoding in ("", "identity"):
            encoding = ""
        elif encoding not in ("gzip", "x-gzip", "deflate"):
            response.close()
            raise MalformedResponse(f"{where} sent a body in an encoding it was not offered ({encoding})")
        declared = response.headers.get("content-length", "")
        if not encoding and declared.isdigit() and int(declared) > self.max_bytes:
            response.close()
            raise _too_large(where, self.max_bytes)
        assert self.max_bytes is not None
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _DECODED_HEADERS]
        return httpx2.Response(
            status_code=response.status_code,
            headers=headers,
            stream=_CappedStream(response.stream, encoding, self.max_bytes, where),  # type: ignore[arg-type]
            extensions=response.extensions,
        )


# Headers that describe the encoded body; the capped stream hands on the decoded one.
_DECODED_HEADERS = frozenset({"content-encoding", "content-length"})


def in_chain(err: BaseException | None, kind: type[BaseException]) -> Any:
    """The first exception of ``kind`` in an exception's chain of causes, if any."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, kind):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None
