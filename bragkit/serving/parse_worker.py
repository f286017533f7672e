"""Uploaded files read in a worker process whose memory and CPU time are capped.

A file can be crafted to make a parser allocate gigabytes or loop for minutes. ``documents.py``
bounds what it can before and while it parses; this module bounds the rest, out of the
server's process: :meth:`FileReaders.read_each` starts one worker per request, sends it the files
one at a time and takes back each file's passages as JSON (never a pickle: the worker's output
is as untrusted as its input). A ``.zip`` is sent whole and unpacked only in the worker: it lists
the members (``documents.Archive``), and each is then asked for as a file of its own, so every
bound per file holds per member. The worker

- caps its own address space (``RLIMIT_AS``) and its CPU time per file (``RLIMIT_CPU``), may
  write no file (``RLIMIT_FSIZE``), and runs at a lower priority than the server (``nice``);
- imports only the standard library and ``documents.py`` (pypdf, selectolax), and gets none of
  the server's environment, so no secret is there to leak;
- is killed when a file takes longer than twice its CPU cap in wall time, when the request's
  deadline passes, or when ``cancelled()`` says the caller has gone.

At most ``Caps.workers`` workers run at once, server-wide, and one caller may hold half of them;
a request waits for one within its deadline. A file that breaks a cap is a
:class:`documents.TooLarge` naming the file and the setting: ``read_each`` lists it among the
files not read and reads the rest in a new worker (``read`` raises it); the server and other
callers are unaffected. Like the embedded model's worker (``llms/worker.py``), it is a process of its own
that talks over two pipes, and a crash costs the request in flight, not the server.

    DocumentError (ValueError)      documents.py: a file that cannot be read
    ├── TooLarge                    past a limit or a cap: the file, and which
    └── RequestStopped              documents.py: reading stops for every file
        └── ReadingAbandoned        the caller went away or the deadline passed
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bragkit import documents
from bragkit.documents import Cut, DocumentError, FileLimits, RequestTooLarge, Row, TooLarge

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent  # bragkit/serving/ -> the folder bragkit is in
_POLL_SECONDS = 0.1  # how often a waiting request checks its caller and its deadline


class ReadingAbandoned(documents.RequestStopped):
    """Reading stopped: the caller went away, or the request's deadline passed."""


@dataclass(frozen=True)
class Caps:
    """What one worker may use; the app reads them from the environment (docs/deploying.md)."""

    memory_mb: int = 1024  # BRAG_PARSE_MEMORY_MB: the worker's address space
    cpu_seconds: int = 30  # BRAG_PARSE_CPU_SECONDS: CPU time per file; wall time per file is twice it
    workers: int = 2  # BRAG_PARSE_WORKERS: workers at once, server-wide


class FileReaders:
    """The server's file readers: at most ``caps.workers`` worker processes at a time.

    One caller may hold half of them (at least one), so a caller whose files take long cannot
    keep every other caller's files waiting.
    """

    def __init__(self, caps: Caps = Caps()) -> None:
        self.caps = caps
        self.share = max(1, caps.workers // 2)
        self._free = threading.Condition()
        self._running: Counter[str] = Counter()
        self.started = 0  # workers started so far (a test can count them)

    def read(
        self,
        files: Sequence[tuple[str, bytes]],
        limits: FileLimits,
        cut: Cut | None = None,
        *,
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
    ) -> list[Row]:
        """Every file's passages as rows, read in a capped worker; the first bad file raises.

        ``deadline`` is a ``time.monotonic()`` reading; ``cancelled`` is asked every
        ``_POLL_SECONDS`` while the request waits; ``caller`` names who asks (its address).
        """
        reading = self.read_each(
            files, limits, cut, deadline=deadline, cancelled=cancelled, caller=caller, strict=True
        )
        return reading.rows

    def read_each(
        self,
        files: Sequence[tuple[str, bytes]],
        limits: FileLimits,
        cut: Cut | None = None,
        *,
        on_file: Callable[[int, int, str], None] | None = None,
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
        strict: bool = False,
    ) -> documents.Reading:
        """Every file read in a capped worker, a ``.zip``'s members as files of their own.

        A file that cannot be read (or that breaks a cap, which costs the worker: another is
        started for the rest) is named in the reading's ``failed``, and the others are read
        (:func:`documents.read_all`); ``on_file(number, total, label)`` before each one.
        """
        documents.check_request(files, limits)
        if not files:
            return documents.Reading([], [], [])
        watch = _Watch(deadline, cancelled)
        self._take_a_slot(caller, watch, files[0][0])
        # The worker's CPU cap over all it reads: one file's each, an archive's members included.
        units = len(files) + (limits.files if any(documents.is_archive(n) for n, _ in files) else 0)
        source = _WorkerSource(self, limits, cut or Cut(), units, watch)
        try:
            return documents.read_all(files, limits, source, strict=strict, on_file=on_file)
        finally:
            source.close()
            with self._free:
                self._running[caller] -= 1
                self._free.notify_all()

    def _take_a_slot(self, caller: str, watch: _Watch, name: str) -> None:
        """Wait, within the request's deadline, until a worker and the caller's share are free."""
        with self._free:
            while self._running.total() >= self.caps.workers or self._running[caller] >= self.share:
                self._free.wait(_POLL_SECONDS)
                watch.check(name)
            self._running[caller] += 1


class _WorkerSource(documents.Source):
    """What :func:`documents.read_all` reads with in the app: the request's capped worker.

    A file that breaks a cap (time, memory, a crash, a damaged reply) leaves the worker unfit:
    it is killed, and the next file gets a new one, which opens again the archive it is in.
    """

    def __init__(self, readers: FileReaders, limits: FileLimits, cut: Cut, units: int, watch: _Watch) -> None:
        super().__init__(cut)
        self.readers, self.limits, self.units, self.watch = readers, limits, units, watch
        self.worker: _Worker | None = None
        self.opened: set[int] = set()  # the archives the running worker holds
        self.given: dict[int, tuple[str, bytes, documents.Room]] = {}  # every archive, to open again

    def file(self, name: str, data: bytes, limits: FileLimits) -> list[Row]:
        header = {"name": documents.display_name(name), "passages_left": limits.passages}
        return self._rows(self._ask(header, data), header["name"], limits)

    def archive(
        self, key: int, name: str, data: bytes, limits: FileLimits, room: documents.Room
    ) -> tuple[list[documents.Member], list[documents.Unreadable]]:
        self.given[key] = (name, data, room)
        return _listing(self._open(key), documents.display_name(name))

    def member(self, key: int, member: documents.Member, limits: FileLimits) -> list[Row]:
        if key not in self.opened or self.worker is None:
            self._open(key)
        header = {"op": "member", "key": key, "index": member.index, "name": member.label}
        return self._rows(self._ask({**header, "passages_left": limits.passages}, b""), member.label, limits)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.__exit__()
            self.worker = None

    def _open(self, key: int) -> dict[str, Any]:
        name, data, room = self.given[key]
        header = {"op": "open", "key": key, "name": documents.display_name(name)}
        reply = self._ask({**header, "files_left": room.files, "bytes_left": room.bytes}, data)
        self.opened.add(key)
        return reply

    def _ask(self, header: dict[str, Any], data: bytes) -> dict[str, Any]:
        if self.worker is None:
            self.worker = _Worker(self.readers.caps, self.limits, self.cut, self.units).__enter__()
            self.readers.started += 1
            self.opened = set()
        try:
            return self.worker.ask(header, data, self.watch)
        finally:
            if self.worker.broken:
                self.close()

    def _rows(self, reply: dict[str, Any], name: str, limits: FileLimits) -> list[Row]:
        """A file's reply as rows: a passage file's items become passages here, where brag is loaded."""
        rows = [(str(t), str(x), str(d), float(s)) for t, x, d, s in reply["rows"]]
        return documents.content_rows(documents.FileContent(name, rows, reply.get("items") or []), limits)


def _listing(reply: dict[str, Any], name: str) -> tuple[list[documents.Member], list[documents.Unreadable]]:
    """An archive's members and its skipped files, from the worker's reply (as untrusted as its input)."""
    try:
        members = [documents.Member(str(a), int(b), int(c), str(d)) for a, b, c, d in reply["members"]]
        skipped = [documents.Unreadable(str(a), str(b), bool(c), str(d)) for a, b, c, d in reply["skipped"]]
    except (KeyError, TypeError, ValueError):
        raise DocumentError(f"{name}: could not be read (the reader's reply was damaged)") from None
    return members, skipped


class _Watch:
    """The request's deadline and its caller, asked while a request waits."""

    def __init__(self, deadline: float | None, cancelled: Callable[[], bool]) -> None:
        self.deadline, self.cancelled = deadline, cancelled

    def check(self, name: str) -> None:
        if self.cancelled():
            raise ReadingAbandoned(f"{name}: reading stopped, the request was cancelled")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise ReadingAbandoned(f"{name}: reading the files ran past the request's time limit")

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


class _Worker:
    """One worker process for one request's files: started on entry, killed on exit."""

    def __init__(self, caps: Caps, limits: FileLimits, cut: Cut, files: int) -> None:
        self.caps, self.limits = caps, limits
        self.config = {
            "memory_bytes": caps.memory_mb * 1024 * 1024,
            "cpu_seconds": caps.cpu_seconds,
            "files": files,
            "limits": asdict(limits),
            "cut": asdict(cut),
        }
        # A reply holds one file's text and titles as UTF-8 JSON: at most 4 bytes a character.
        self.max_reply = 4 * limits.text_chars + 1_000_000
        self.proc: subprocess.Popen[bytes] | None = None
        self.broken = False  # a file broke a cap or the pipe: no other file is sent to it

    def __enter__(self) -> _Worker:
        worker_reads, parent_writes = os.pipe()
        parent_reads, worker_writes = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",  # no PYTHON* variables, no user site
                    "-B",  # no .pyc written: the worker may write no file at all
                    "-c",
                    "import sys; sys.path.insert(0, sys.argv[1]); "
                    "from bragkit.serving import parse_worker; parse_worker.main(sys.argv[2:])",
                    str(CHECKOUT),
                    str(worker_reads),
                    str(worker_writes),
                    json.dumps(self.config),
                ],
                pass_fds=(worker_reads, worker_writes),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={"PATH": os.defpath, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1"},
                cwd=HERE,
            )
        finally:
            os.close(worker_reads)
            os.close(worker_writes)
        self.requests = Connection(parent_writes, readable=False)
        self.replies = Connection(parent_reads, writable=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.requests.close()
        self.replies.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def read(self, name: str, data: bytes, watch: _Watch) -> list[Row]:
        """One file's rows, from what the worker read, or the error that names the file and the cap.

        The worker sends a document's rows, or a passage file's items as its JSON holds them;
        those become passages here (``documents.content_rows``), where brag is loaded anyway.
        """
        reply = self.ask({"name": name}, data, watch)
        rows = [(str(t), str(x), str(d), float(s)) for t, x, d, s in reply["rows"]]
        return documents.content_rows(
            documents.FileContent(name, rows, reply.get("items") or []), self.limits
        )

    def ask(self, header: dict[str, Any], data: bytes, watch: _Watch) -> dict[str, Any]:
        """Send one request (a file, an archive to open, a member of one to read); its reply.

        An error reply raises the error it names; one that stops the request (its files past a
        bound together) raises :class:`documents.RequestTooLarge`.
        """
        name = str(header.get("name", ""))
        try:
            self.requests.send_bytes(json.dumps(header).encode())
            self.requests.send_bytes(data)
        except OSError:
            raise self._died(name) from None
        reply = self._reply(name, watch)
        if "error" in reply:
            kind = (
                RequestTooLarge
                if reply.get("stops")
                else TooLarge
                if reply.get("too_large")
                else DocumentError
            )
            raise kind(str(reply["error"]))
        return reply

    def _reply(self, name: str, watch: _Watch) -> dict[str, Any]:
        wall = 2 * self.caps.cpu_seconds + 1  # CPU time is capped in whole seconds, rounded up
        started = time.monotonic()
        while not self.replies.poll(min(_POLL_SECONDS, max(watch.seconds_left(), 0))):
            watch.check(name)
            if time.monotonic() - started > wall:
                self.broken = True
                raise TooLarge(
                    f"{name}: reading it took more than {wall:g} s (BRAG_PARSE_CPU_SECONDS is "
                    f"{self.caps.cpu_seconds:g} s of CPU per file)"
                )
        try:
            raw = self.replies.recv_bytes(self.max_reply)
        except EOFError:
            raise self._died(name) from None
        except OSError:  # a reply longer than any file's text may be
            self.broken = True
            raise RequestTooLarge(
                f"{name}: the files hold more than {self.limits.text_chars:,} characters of text"
            ) from None
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: items nested as deep as the worker reads
            self.broken = True
            raise DocumentError(f"{name}: could not be read (the reader's reply was damaged)") from None
        if not isinstance(reply, dict) or not (
            "error" in reply
            or "members" in reply
            or (isinstance(reply.get("rows"), list) and isinstance(reply.get("items"), list))
        ):
            self.broken = True
            raise DocumentError(f"{name}: could not be read (the reader's reply was damaged)")
        return reply

    def _died(self, name: str) -> DocumentError:
        """Why the worker died while it read ``name``: a cap, or a crash."""
        assert self.proc is not None
        self.broken = True
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code in (-signal.SIGXCPU, -signal.SIGKILL):
            seconds = self.caps.cpu_seconds
            return TooLarge(
                f"{name}: reading it took more than {seconds:g} s of CPU (BRAG_PARSE_CPU_SECONDS)"
            )
        return TooLarge(
            f"{name}: the reader ran out of memory or crashed on it (it may use "
            f"{self.caps.memory_mb:,} MB, BRAG_PARSE_MEMORY_MB)"
        )


# ------------------------------------------------------------------------------------------
# The worker process
# ------------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    """The worker: cap itself, then read files from the pipe until the parent closes it."""
    requests = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)
    config = json.loads(argv[2])
    _confine(config)
    limits, cut = FileLimits(**config["limits"]), Cut(**config["cut"])
    archives: dict[int, documents.Archive] = {}  # the request's archives, opened once each
    while True:
        try:
            header, data = json.loads(requests.recv_bytes()), requests.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is done, or gone
        _allow_cpu(config["cpu_seconds"])
        # The request's passages so far are the parent's to count: a file may hold what is left.
        left = replace(limits, passages=int(header.get("passages_left", limits.passages)))
        name = str(header.get("name", ""))
        reply = _guarded(name, config, functools.partial(_answer, header, data, archives, left, cut))
        replies.send_bytes(json.dumps(reply, ensure_ascii=False).encode())


def _answer(
    header: dict[str, Any], data: bytes, archives: dict[int, documents.Archive], limits: FileLimits, cut: Cut
) -> dict[str, Any]:
    """One request: open an archive (its listing), read one of its members, or read a file."""
    op, name = header.get("op", "file"), str(header.get("name", ""))
    if op == "open":
        room = documents.Room(int(header["files_left"]), int(header["bytes_left"]))
        archive = archives[int(header["key"])] = documents.Archive(name, data, limits, room)
        return {
            "members": [[m.label, m.index, m.size, m.suffix] for m in archive.members],
            "skipped": [[f.name, f.reason, f.too_large, f.skipped] for f in archive.skipped],
        }
    if op == "member":
        archive = archives.get(int(header["key"]))
        if archive is None:
            raise DocumentError(f"{name}: its archive is not open")
        content = archive.content(int(header["index"]), limits, cut)
    else:
        content = documents.file_content(name, data, limits, cut)
    return {"rows": content.rows, "items": content.items}


def _confine(config: dict[str, Any]) -> None:
    """Caps that hold from now on: address space, CPU time, no files written, no core, lower priority."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"], config["memory_bytes"]))
    total = config["cpu_seconds"] * config["files"] + 5  # the hard cap, for every file together
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"] + 1, total))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(10)


def _allow_cpu(seconds: int) -> None:
    """The next file may use ``seconds`` more of CPU: SIGXCPU ends the worker past that."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (min(spent + seconds, hard), hard))


def _guarded(name: str, config: dict[str, Any], work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()``'s reply, or the error a reader's failure is, named; never a crash of the worker."""
    try:
        return work()
    except RequestTooLarge as err:
        return {"error": str(err), "too_large": True, "stops": True}
    except TooLarge as err:
        return {"error": str(err), "too_large": True}
    except DocumentError as err:
        return {"error": str(err)}
    except MemoryError:
        return _out_of_memory(name, config)
    except RecursionError:
        return {"error": f"{name}: nested too deeply to read"}
    except Exception as err:  # any parser's own fault on a damaged file, or a native one's failed malloc
        if _peak_memory() > 0.9 * config["memory_bytes"]:
            return _out_of_memory(name, config)
        return {"error": f"{name}: could not be read ({type(err).__name__})"}


def _out_of_memory(name: str, config: dict[str, Any]) -> dict[str, Any]:
    megabytes = config["memory_bytes"] // (1024 * 1024)
    message = f"{name}: reading it needed more than {megabytes:,} MB of memory (BRAG_PARSE_MEMORY_MB)"
    return {"error": message, "too_large": True}


def _peak_memory() -> int:
    """The most address space this process has held (VmPeak), in bytes; 0 when unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
