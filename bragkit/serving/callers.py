"""Who is asking, and what one caller may hold: its slots, its session's uploads and fits.

A caller is its Gradio session and its client address (through trusted proxies). It runs at most
so many requests at once (:class:`CallerLimits`); what its session uploaded and the self-test fit
it made are kept for it alone (:class:`SessionUploads`, :class:`SessionFits`). No Gradio here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from bragkit.fits import fair_evictions
from bragkit.serving import uploads

from .limits import RequestRefused, env_number, refused


class CallerRequest(Protocol):
    """What the policy reads of an HTTP request (a ``gr.Request`` has it)."""

    client: Any
    headers: Mapping[str, str]
    session_hash: str | None


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


class SessionFits:
    """The self-test fit each browser session (or API session) made, by model and corpus.

    A caller's self-test applies to that caller's session unasked, from the address that made
    it, and to requests that name it; never to anyone else's, whatever session hash they send
    (a fit is kept under its session *and* its address, so a hash sent from elsewhere neither
    reads nor replaces it). Held in memory, with the shares of :func:`fair_evictions`.
    """

    def __init__(self, limit: int = 10_000, per_address: int = 20) -> None:
        self.limit, self.per_address = limit, per_address
        self._fits: dict[tuple[str, str, str, str], tuple[str, float]] = {}
        self._lock = threading.Lock()

    def remember(self, session: str, address: str, model: str, corpus: str, name: str) -> None:
        """``session`` (from ``address``) made the kept fit ``name`` for ``model`` over ``corpus``."""
        if not session:
            return  # called from Python: there is no session to apply it to
        with self._lock:
            self._fits[session, address, model, corpus] = (name, time.monotonic())
            entries = [(key[1], used, key) for key, (_, used) in self._fits.items()]
            for key in fair_evictions(entries, address, self.per_address, self.limit):
                del self._fits[key]

    def recall(self, session: str, address: str, model: str, corpus: str) -> str | None:
        """The name of the fit this session made from ``address`` for ``model`` over ``corpus``, if any."""
        with self._lock:
            key = (session, address, model, corpus)
            found = self._fits.get(key) if session else None
            if found is None:
                return None
            self._fits[key] = (found[0], time.monotonic())
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
