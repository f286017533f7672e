"""Uploads on a public server: who holds what in the upload store, for how long, and what is served.

Gradio stores every file posted to ``/gradio_api/upload`` in its upload folder, would serve it
back to anyone at ``/gradio_api/file=<path>``, and fetches a ``FileData`` whose path is a URL.
On a public app that makes it file hosting, a downloader, and a store one caller can fill for
everyone. Here:

- :class:`UploadLedger` records each stored upload's caller, size and time. A caller (its
  address, through trusted proxies: an upload carries no session) may hold at most its share of
  the store, in bytes and in files; the store as a whole at most its budget. A file is charged
  what it holds on disk (at least a block, and a block for its folder), so many tiny files
  cost what they take. An upload is deleted, with its folder and Gradio's record of its path,
  once a request reads it or after ``ttl`` seconds, whichever comes first.
- :class:`UploadRoutes` (ASGI) admits ``/upload`` by the ledger and records what it stored (an
  upload past the caller's share is deleted whole and refused), and lets ``/file=`` serve only
  the files the app itself made for download: never an upload, never a URL.
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


@dataclass(frozen=True)
class Proxies:
    """The proxies in front of the app (``BRAG_TRUSTED_PROXIES``, ``BRAG_PROXY_HOPS``).

    ``trusted`` holds their addresses, or ``*``: every peer is a proxy (a Space, whose proxy is
    the only way in). Each proxy appends the address it was reached from to
    ``X-Forwarded-For``, and a caller can write anything before that. So with addresses, the
    client is the last hop none of them wrote; with ``*``, the ``hops``-th from the right (the one
    the platform's proxy appended when ``hops`` is 1).
    """

    trusted: frozenset[str] = frozenset()
    hops: int = 1

    def client(self, peer: str, forwarded: str) -> str:
        """The client's address: the peer itself unless the peer is a trusted proxy."""
        trust_all = "*" in self.trusted
        if not (trust_all or peer in self.trusted):
            return peer
        hops = [a.strip() for a in forwarded.split(",") if a.strip()]
        if trust_all:
            return hops[-self.hops] if len(hops) >= self.hops else (hops[0] if hops else peer)
        for hop in reversed(hops):
            if hop not in self.trusted:
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
    size: int  # what it is charged: its bytes on disk, and its folder's
    stored: float  # clock reading


BLOCK = 4096  # a file or a folder takes at least one block of disk


def disk_charge(size: int) -> int:
    """What an upload of ``size`` bytes takes on disk: its blocks, and a block for its folder."""
    return -(-max(size, 1) // BLOCK) * BLOCK + BLOCK


class UploadLedger:
    """Every upload in the store: its caller, charge and age; shares, budget and expiry.

    ``admit`` reserves room for an upload before its body is read; ``settle`` records the files
    it stored (or frees the room when it failed), and deletes them all when they take the
    caller or the store past a bound; ``release`` deletes a file a request read. Expired
    uploads are deleted at each admission and every ``ttl / 4`` seconds. Deleting a file removes
    its folder when that is left empty (never ``root`` itself) and calls ``forget(path)``, which
    drops the server's own record of it (Gradio's set of uploaded paths).
    """

    def __init__(
        self,
        store_bytes: int,
        per_caller_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        per_caller_files: int = 50,
        store_files: int = 5_000,
        root: Path | None = None,
        forget: Callable[[str], None] = lambda path: None,
    ) -> None:
        self.store_bytes, self.per_caller_bytes, self.ttl, self.clock = (
            store_bytes,
            per_caller_bytes,
            ttl,
            clock,
        )
        self.per_caller_files, self.store_files = per_caller_files, store_files
        self.root = None if root is None else Path(root).resolve()
        self.forget = forget
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
            if held + incoming > self.per_caller_bytes or self._files(caller) >= self.per_caller_files:
                return 429, self._over_share(held)
            if (
                self._total() + sum(self._reserved.values()) + incoming > self.store_bytes
                or len(self._uploads) >= self.store_files
            ):
                return 503, "Busy: too many uploaded files are waiting; retry in a minute."
            self._reserved[caller] = self._reserved.get(caller, 0) + incoming
        return 200, None

    def settle(self, caller: str, reserved: int, paths: list[str]) -> tuple[int, str] | None:
        """The upload that reserved ``reserved`` bytes stored ``paths`` (none when it failed).

        None when they are recorded; ``(status, why not)`` when they would take the caller or
        the store past a bound (many tiny files do, charged by the disk they take): then every
        one of them is deleted, so an upload is kept whole or not at all.
        """
        now = self.clock()
        charges = {}
        for path in paths:
            try:
                charges[_key(path)] = disk_charge(os.stat(path).st_size)
            except OSError:
                continue
        with self._lock:
            left = self._reserved.get(caller, 0) - reserved
            if left > 0:
                self._reserved[caller] = left
            else:
                self._reserved.pop(caller, None)
            # The same content uploaded again lands on the same path: it replaces its record.
            again = [key for key in charges if key in self._uploads]
            new = len(charges) - len(again)
            incoming = sum(charges.values()) - sum(self._uploads[key].size for key in again)
            refusal: tuple[int, str] | None = None
            held = self._held(caller)
            if held + incoming > self.per_caller_bytes or self._files(caller) + new > self.per_caller_files:
                refusal = 429, self._over_share(held)
            elif self._total() + incoming > self.store_bytes or len(self._uploads) + new > self.store_files:
                refusal = 503, "Busy: too many uploaded files are waiting; retry in a minute."
            else:
                for key, charge in charges.items():
                    self._uploads[key] = _Upload(caller, charge, now)
                    self._uploads.move_to_end(key)
        if refusal is not None:
            for key in charges:
                if key not in again:  # an earlier upload's file stays for the request that uses it
                    self._delete(key)
            return refusal
        self._start_sweeping()
        return None

    def release(self, path: str) -> None:
        """A request read ``path``: it goes from the store, with its folder and its record."""
        with self._lock:
            self._uploads.pop(_key(path), None)
        self._delete(_key(path))

    def holds(self, path: str) -> bool:
        """True when ``path`` is an upload still in the store."""
        with self._lock:
            return _key(path) in self._uploads

    def expired(self, path: str) -> bool:
        """True when ``path`` was an upload deleted for its age."""
        with self._lock:
            return _key(path) in self._expired

    def held(self, caller: str) -> int:
        """Bytes of disk ``caller``'s uploads take in the store."""
        with self._lock:
            return self._held(caller)

    def total(self) -> int:
        """Bytes of disk every upload takes in the store."""
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
            self._delete(key)
        return len(old)

    def _delete(self, key: str) -> None:
        """The file, its folder once empty (inside ``root``, never ``root``), and its record elsewhere."""
        path = Path(key)
        path.unlink(missing_ok=True)
        folder = path.parent
        if self.root is not None and folder != self.root and folder.is_relative_to(self.root):
            try:
                folder.rmdir()
            except OSError:
                pass  # another file is still in it, or it is gone already
        self.forget(key)

    def _over_share(self, held: int) -> str:
        minutes = max(1, round(self.ttl / 60))
        return (
            f"Your uploads waiting on the server take {held / MB:.1f} MB of disk, and may take at most "
            f"{self.per_caller_bytes / MB:.1f} MB in at most {self.per_caller_files} files "
            "(BRAG_MAX_UPLOAD_BYTES_PER_CALLER, BRAG_MAX_UPLOAD_FILES_PER_CALLER): ask a question over "
            f"them, or wait: unused uploads are deleted after {minutes} minute(s)."
        )

    def _held(self, caller: str) -> int:
        return sum(u.size for u in self._uploads.values() if u.caller == caller)

    def _files(self, caller: str) -> int:
        return sum(1 for u in self._uploads.values() if u.caller == caller)

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
    gets 403. An upload's answer waits until the ledger has settled it, so a caller told its
    paths can use them, and one refused has none left on disk.
    """

    def __init__(
        self, app: Any, ledger: UploadLedger, served: Callable[[str], bool], proxies: Proxies
    ) -> None:
        self.app, self.ledger, self.served, self.proxies = app, ledger, served, proxies

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
        caller = self.proxies.client(peer, headers.get("x-forwarded-for", ""))
        declared = headers.get("content-length", "0")
        incoming = int(declared) if declared.isdigit() else 0
        status, refusal = self.ledger.admit(caller, incoming)
        if refusal is not None:
            while (await receive()).get("more_body"):  # read the body, so the caller sees the answer
                pass
            await json_response(send, status, {"detail": refusal}, {"retry-after": "60"})
            return
        held: list[dict[str, Any]] = []  # the app's answer: a list of paths, a few kB

        async def recorded(message: dict[str, Any]) -> None:
            held.append(message)

        paths: list[str] = []
        try:
            await self.app(scope, receive, recorded)
            start = next((m for m in held if m["type"] == "http.response.start"), {})
            if start.get("status") == 200:
                stored = json.loads(b"".join(m.get("body", b"") for m in held if m["type"] != start["type"]))
                paths = [p for p in stored if isinstance(p, str)] if isinstance(stored, list) else []
        except ValueError:
            pass
        finally:
            over = self.ledger.settle(caller, incoming, paths)
        if over is not None:
            await json_response(send, over[0], {"detail": over[1]}, {"retry-after": "60"})
            return
        for message in held:
            await send(message)


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


class FileRefused(ValueError):
    """A files input :func:`check_file_data` refuses, with the rule it breaks."""


def check_file_data(value: Any, folder: Path, files: int, kept: Callable[[str], bool]) -> None:
    """A files input as the caller sent it, checked before Gradio moves or fetches anything.

    At most ``files`` items, each a path (never a URL) to a file in the upload ``folder``, or
    one that ``kept`` says a session uploaded before. :class:`FileRefused` says which rule failed.
    """
    if value is None or value == []:
        return
    items = value if isinstance(value, list) else [value]
    if len(items) > files:
        raise FileRefused(f"The upload: {len(items):,} files, over the limit of {files:,} (BRAG_MAX_FILES).")
    for item in items:
        path = item.get("path") if isinstance(item, dict) else item
        if not isinstance(path, str) or not path or "\0" in path or _is_url(path):
            raise FileRefused(
                "Files must be uploaded with the request (a file input, or handle_file); "
                "a URL or a path on the server is never read."
            )
        resolved = Path(path).resolve()
        if not (resolved.is_relative_to(folder) and (resolved.is_file() or kept(str(resolved)))):
            raise FileRefused(
                "Files must be uploaded with the request (a file input, or handle_file); "
                "a URL or a path on the server is never read."
            )
