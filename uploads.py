"""Uploads on a public server: who holds what in the upload store, for how long, and what is served.

Gradio stores every file posted to ``/gradio_api/upload`` in its upload folder, would serve it
back to anyone at ``/gradio_api/file=<path>``, and fetches a ``FileData`` whose path is a URL.
On a public app that makes it file hosting, a downloader, and a store one caller can fill for
everyone. Here:

- :class:`UploadLedger` records each stored upload's caller, size and time. A caller (its
  address, through trusted proxies: an upload carries no session) may hold at most its share of
  the store; the store as a whole at most its budget; an upload is deleted once a request reads
  it or after ``ttl`` seconds, whichever comes first.
- :class:`UploadRoutes` (ASGI) admits ``/upload`` by the ledger and records what it stored, and
  lets ``/file=`` serve only the files the app itself made for download: never an upload,
  never a URL.
- :func:`check_file_data` checks a request's files input before Gradio touches the disk: at
  most ``files`` of them, each a path in the upload folder, never a URL.

Nothing here imports Gradio; ``app.py`` wires it in.
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1_000_000


def client_address(peer: str, forwarded: str, trusted: frozenset[str]) -> str:
    """The client's address: the peer, or behind trusted proxies the last hop none of them wrote.

    ``forwarded`` is the ``X-Forwarded-For`` header; ``trusted`` holds proxy addresses, or
    ``*`` for any (a Space, whose proxy sets the header).
    """
    trust_all = "*" in trusted
    if not (trust_all or peer in trusted):
        return peer
    hops = [a.strip() for a in forwarded.split(",") if a.strip()]
    for hop in reversed(hops):
        if not (trust_all or hop in trusted):
            return hop
    return hops[0] if hops else peer


def trusted_addresses(setting: str) -> frozenset[str]:
    """``BRAG_TRUSTED_PROXIES``-style text as a set; ValueError names a bad address."""
    raw = [p.strip() for p in setting.split(",") if p.strip()]
    for address in raw:
        if address != "*":
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise ValueError(f"{address!r} is not an IP address") from None
    return frozenset(raw)


@dataclass
class _Upload:
    caller: str
    size: int
    stored: float  # clock reading


class UploadLedger:
    """Every upload in the store: its caller, size and age; shares, budget and expiry.

    ``admit`` reserves room for an upload before its body is read; ``settle`` records the files
    it stored (or frees the room when it failed); ``release`` forgets a file a request read and
    deleted. Expired uploads are deleted at each admission and every ``ttl / 4`` seconds.
    """

    def __init__(
        self,
        store_bytes: int,
        per_caller_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store_bytes, self.per_caller_bytes, self.ttl, self.clock = (
            store_bytes,
            per_caller_bytes,
            ttl,
            clock,
        )
        self._uploads: OrderedDict[str, _Upload] = OrderedDict()  # oldest first
        self._reserved: dict[str, int] = {}
        self._expired: deque[str] = deque(maxlen=10_000)  # so a late request can be told why
        self._lock = threading.Lock()
        self._sweeper: threading.Timer | None = None

    def admit(self, caller: str, incoming: int) -> tuple[int, str | None]:
        """Reserve ``incoming`` bytes for ``caller``: ``(status, None)`` or ``(status, why not)``."""
        self.sweep()
        with self._lock:
            held = self._held(caller) + self._reserved.get(caller, 0)
            if held + incoming > self.per_caller_bytes:
                minutes = max(1, round(self.ttl / 60))
                return 429, (
                    f"Your uploads waiting on the server hold {held / MB:.1f} MB and may hold at most "
                    f"{self.per_caller_bytes / MB:.1f} MB (BRAG_MAX_UPLOAD_BYTES_PER_CALLER): ask a question "
                    f"over them, or wait: unused uploads are deleted after {minutes} minute(s)."
                )
            if self._total() + sum(self._reserved.values()) + incoming > self.store_bytes:
                return 503, "Busy: too many uploaded files are waiting; retry in a minute."
            self._reserved[caller] = self._reserved.get(caller, 0) + incoming
        return 200, None

    def settle(self, caller: str, reserved: int, paths: list[str]) -> None:
        """The upload that reserved ``reserved`` bytes stored ``paths`` (none when it failed)."""
        now = self.clock()
        sizes = {}
        for path in paths:
            try:
                sizes[_key(path)] = os.stat(path).st_size
            except OSError:
                continue
        with self._lock:
            left = self._reserved.get(caller, 0) - reserved
            if left > 0:
                self._reserved[caller] = left
            else:
                self._reserved.pop(caller, None)
            for key, size in sizes.items():
                self._uploads[key] = _Upload(caller, size, now)
                self._uploads.move_to_end(key)
        self._start_sweeping()

    def release(self, path: str) -> None:
        """A request read ``path`` and deleted it."""
        with self._lock:
            self._uploads.pop(_key(path), None)

    def holds(self, path: str) -> bool:
        """True when ``path`` is an upload still in the store."""
        with self._lock:
            return _key(path) in self._uploads

    def expired(self, path: str) -> bool:
        """True when ``path`` was an upload deleted for its age."""
        with self._lock:
            return _key(path) in self._expired

    def held(self, caller: str) -> int:
        """Bytes of ``caller``'s uploads in the store."""
        with self._lock:
            return self._held(caller)

    def total(self) -> int:
        """Bytes of every upload in the store."""
        with self._lock:
            return self._total()

    def sweep(self) -> int:
        """Delete the uploads older than ``ttl`` (and forget those already gone); how many went."""
        cutoff = self.clock() - self.ttl
        with self._lock:
            old = []
            for key, upload in self._uploads.items():
                if upload.stored > cutoff:
                    break  # oldest first: the rest are younger
                old.append(key)
            for key in old:
                del self._uploads[key]
                self._expired.append(key)
        for key in old:
            Path(key).unlink(missing_ok=True)
        return len(old)

    def _held(self, caller: str) -> int:
        return sum(u.size for u in self._uploads.values() if u.caller == caller)

    def _total(self) -> int:
        return sum(u.size for u in self._uploads.values())

    def _start_sweeping(self) -> None:
        """Sweep every ``ttl / 4`` seconds while uploads wait, so none outlives its time unasked."""
        with self._lock:
            if self._sweeper is not None or not self._uploads:
                return
            self._sweeper = threading.Timer(max(self.ttl / 4, 1.0), self._sweep_and_rearm)
            self._sweeper.daemon = True
            self._sweeper.start()

    def _sweep_and_rearm(self) -> None:
        self.sweep()
        with self._lock:
            self._sweeper = None
        self._start_sweeping()


def _key(path: str) -> str:
    return str(Path(path).resolve())


# ------------------------------------------------------------------------------------------
# The routes
# ------------------------------------------------------------------------------------------


class UploadRoutes:
    """ASGI middleware for ``/upload`` and ``/file=``.

    ``served(path)`` says whether ``path`` is a file the app made for a download (Gradio keeps
    those per output component); every other ``/file=`` request, an upload or a URL among them,
    gets 403.
    """

    def __init__(
        self, app: Any, ledger: UploadLedger, served: Callable[[str], bool], trusted: frozenset[str]
    ) -> None:
        self.app, self.ledger, self.served, self.trusted = app, ledger, served, trusted

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Admit and record uploads; serve only the app's own downloads."""
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.rstrip("/").endswith("/upload"):
            await self._upload(scope, receive, send)
            return
        wanted = _served_path(path)
        if wanted is not None and (not wanted or _is_url(wanted) or not self.served(_key(wanted))):
            await json_response(
                send, 403, {"detail": "Not served: this server serves only the files it makes."}
            )
            return
        await self.app(scope, receive, send)

    async def _upload(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        peer = (scope.get("client") or ("", 0))[0]
        caller = client_address(peer, headers.get("x-forwarded-for", ""), self.trusted)
        declared = headers.get("content-length", "0")
        incoming = int(declared) if declared.isdigit() else 0
        status, refusal = self.ledger.admit(caller, incoming)
        if refusal is not None:
            while (await receive()).get("more_body"):  # read the body, so the caller sees the answer
                pass
            await json_response(send, status, {"detail": refusal}, {"retry-after": "60"})
            return
        response: dict[str, Any] = {"status": 0, "body": b""}

        async def recorded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
            elif message["type"] == "http.response.body" and len(response["body"]) < MB:
                response["body"] += message.get("body", b"")
            await send(message)

        paths: list[str] = []
        try:
            await self.app(scope, receive, recorded)
            if response["status"] == 200:
                stored = json.loads(response["body"] or b"[]")
                paths = [p for p in stored if isinstance(p, str)] if isinstance(stored, list) else []
        except ValueError:
            pass
        finally:
            self.ledger.settle(caller, incoming, paths)


def _served_path(path: str) -> str | None:
    """The file a ``/file=`` (or ``/file/``) request asks for; None for any other route."""
    for route in ("/gradio_api/file=", "/gradio_api/file/", "/file=", "/file/"):
        if path.startswith(route):
            return path[len(route) :]
    return None


def _is_url(path: str) -> bool:
    return "://" in path or path.lower().startswith(("http:", "https:", "data:", "//", "\\\\"))


async def json_response(
    send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Answer an ASGI request with a JSON body."""
    raw = [(b"content-type", b"application/json")] + [
        (k.encode(), v.encode()) for k, v in (headers or {}).items()
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


# ------------------------------------------------------------------------------------------
# A request's files input
# ------------------------------------------------------------------------------------------


def check_file_data(value: Any, folder: Path, files: int, kept: Callable[[str], bool]) -> None:
    """A files input as the caller sent it, checked before Gradio moves or fetches anything.

    At most ``files`` items, each a path (never a URL) to a file in the upload ``folder``, or
    one that ``kept`` says a session uploaded before. ValueError says which rule failed.
    """
    if value is None or value == []:
        return
    items = value if isinstance(value, list) else [value]
    if len(items) > files:
        raise ValueError(f"The upload: {len(items):,} files, over the limit of {files:,} (BRAG_MAX_FILES).")
    for item in items:
        path = item.get("path") if isinstance(item, dict) else item
        if not isinstance(path, str) or not path or "\0" in path or _is_url(path):
            raise ValueError(
                "Files must be uploaded with the request (a file input, or handle_file); "
                "a URL or a path on the server is never read."
            )
        resolved = Path(path).resolve()
        if not (resolved.is_relative_to(folder) and (resolved.is_file() or kept(str(resolved)))):
            raise ValueError(
                "Files must be uploaded with the request (a file input, or handle_file); "
                "a URL or a path on the server is never read."
            )
