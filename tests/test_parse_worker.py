"""Files read in a capped worker process: the same passages, the caps, cancelling, the bound on workers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from document_files import docx_bytes, pdf_bytes, raw_pdf

from bragkit import documents
from bragkit.documents import DocumentError, FileLimits, TooLarge
from bragkit.serving import parse_worker
from bragkit.serving.parse_worker import Caps, FileReaders, ReadingAbandoned

FILES = [
    ("report.pdf", pdf_bytes(["The fjord is long.", "Lina Berg was born in Bergen."])),
    ("notes.docx", docx_bytes([(1, "Intro"), (0, "First words."), (2, "Details"), (0, "Deep words.")])),
    ("page.html", b"<h1>Top</h1><p>One.</p><ul><li>item</li></ul>"),
    ("guide.md", b"# Guide\n\nIntro.\n"),
    ("p.json", b'[{"title": "T", "text": "one", "salience": 0.5}, "two"]'),
]
# 900,000 cheap operations: within every bound, and seconds of CPU for pypdf.
SLOW_PDF = raw_pdf(1, b"q Q " * 450_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET")


def workers_of(pid: int) -> list[int]:
    """The file-reading workers ``pid`` is running."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            try:
                if b"parse_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
            except OSError:
                continue
    return found


def test_a_worker_reads_every_type_as_the_server_would():
    rows = FileReaders().read(FILES, FileLimits())
    assert documents.as_passages(rows) == documents.read_files(FILES)
    assert ("T", "one", "", 0.5) in rows
    assert workers_of(os.getpid()) == []  # one worker per request, gone once it is read


def test_a_bad_file_is_named_and_the_first_one_stops_the_request():
    with pytest.raises(DocumentError, match=r"broken\.pdf: not a readable PDF"):
        FileReaders().read([("broken.pdf", b"%PDF-1.4 junk"), *FILES], FileLimits())
    with pytest.raises(TooLarge, match="2 files: at most 1"):
        FileReaders().read(FILES[:2], FileLimits(files=1))
    with pytest.raises(TooLarge, match="more than 20 characters"):
        FileReaders().read(FILES, FileLimits(text_chars=20))


def test_past_its_cpu_time_the_worker_is_stopped_and_the_file_named():
    # Several seconds of parsing however fast the machine: SLOW_PDF alone can fit in a second's cap.
    slower = raw_pdf(1, b"q Q " * 1_500_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET")
    limits = FileLimits(pdf_operations=4_000_000)
    with pytest.raises(TooLarge, match=r"slow\.pdf: reading it took more than \d+ s.*BRAG_PARSE_CPU_SECONDS"):
        FileReaders(Caps(cpu_seconds=1)).read([("slow.pdf", slower)], limits)
    assert workers_of(os.getpid()) == []


def test_past_its_memory_the_worker_fails_alone_and_the_file_is_named():
    # About 8 MB of markup makes a parse tree of several hundred MB.
    spans = b"<span>x</span>" * 600_000
    limits = FileLimits(file_bytes=20_000_000)
    with pytest.raises(TooLarge, match=r"spans\.html: .*memory.*BRAG_PARSE_MEMORY_MB"):
        FileReaders(Caps(memory_mb=200)).read([("spans.html", spans)], limits)
    assert FileReaders(Caps(memory_mb=200)).read(FILES[:1], limits)  # the next request is read


def test_a_cancelled_or_late_request_stops_its_worker():
    readers = FileReaders()
    gone = threading.Event()
    threading.Timer(0.5, gone.set).start()
    with pytest.raises(ReadingAbandoned, match="cancelled"):
        readers.read([("slow.pdf", SLOW_PDF)] * 3, FileLimits(), cancelled=gone.is_set)
    assert workers_of(os.getpid()) == []
    with pytest.raises(ReadingAbandoned, match="time limit"):
        readers.read([("slow.pdf", SLOW_PDF)] * 3, FileLimits(), deadline=time.monotonic() + 0.5)
    assert workers_of(os.getpid()) == []


def test_no_more_workers_run_at_once_than_the_server_allows():
    readers = FileReaders(Caps(workers=1))
    seen: list[int] = []
    threads = [
        threading.Thread(target=readers.read, args=([("slow.pdf", SLOW_PDF)], FileLimits())) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        seen.append(len(workers_of(os.getpid())))
        time.sleep(0.02)
    assert readers.started == 3 and max(seen) == 1


def test_one_caller_holds_at_most_half_of_the_workers():
    readers = FileReaders(Caps(workers=2))
    seen: list[tuple[int, int]] = []
    callers = ["a", "a", "a", "b"]
    threads = [
        threading.Thread(
            target=readers.read, args=([("slow.pdf", SLOW_PDF)], FileLimits()), kwargs={"caller": c}
        )
        for c in callers
    ]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        seen.append((readers._running["a"], readers._running.total()))
        time.sleep(0.02)
    assert readers.started == 4
    assert max(a for a, _ in seen) == 1 and max(total for _, total in seen) == 2  # b ran beside a


def limit_of(limits: str, name: str) -> tuple[str, str]:
    """A process's soft and hard limit, from its /proc/<pid>/limits text."""
    line = next(line for line in limits.splitlines() if line.startswith(name))
    return tuple(re.split(r"\s{2,}", line.strip())[1:3])  # type: ignore[return-value]


def test_the_worker_runs_capped_with_no_secret_and_may_write_no_file(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_server_secret_for_the_worker_test")
    caps = Caps(memory_mb=300, cpu_seconds=7)
    with parse_worker._Worker(caps, FileLimits(), documents.Cut(), files=2) as worker:
        pid = worker.proc.pid
        environment = Path(f"/proc/{pid}/environ").read_bytes()
        deadline = time.monotonic() + 30
        while limit_of(Path(f"/proc/{pid}/limits").read_text(), "Max file size") != ("0", "0"):
            assert time.monotonic() < deadline, "the worker never capped itself"
            time.sleep(0.02)
        limits = Path(f"/proc/{pid}/limits").read_text()
    assert b"hf_server_secret" not in environment and b"HF_TOKEN" not in environment
    assert limit_of(limits, "Max address space") == (str(300 * 1024 * 1024),) * 2
    assert limit_of(limits, "Max cpu time") == ("8", "19")  # a file's 7 s (and one), all files' 2 x 7 + 5
    assert limit_of(limits, "Max core file size") == ("0", "0")


def test_passages_are_counted_in_the_worker_before_the_server_parses_any():
    many = json.dumps([f"p{i}" for i in range(5_000)]).encode()
    with pytest.raises(TooLarge, match=r"many\.json: 5,000 passages, and the files may hold at most 1,000"):
        FileReaders().read([("many.json", many)], FileLimits(passages=1_000))
    # The cap is the request's: two files of 600 passages are over it together.
    half = json.dumps([f"q{i}" for i in range(600)]).encode()
    with pytest.raises(TooLarge, match=r"b\.json: 600 passages, and the files may hold at most 400 more"):
        FileReaders().read([("a.json", half), ("b.json", half)], FileLimits(passages=1_000))
    assert len(FileReaders().read([("a.json", half)], FileLimits(passages=1_000))) == 600


def test_the_text_budget_counts_the_form_brag_reads():
    expanding = "\ufdfa" * 1_000  # 1,000 characters as written, 18,000 once normalised
    with pytest.raises(TooLarge, match="more than 10,000 characters of text once normalised"):
        list(documents.TextBudget(10_000).spend("a.txt", [("a.txt", expanding, "a.txt", 1.0)]))
    assert (
        len(list(documents.TextBudget(10_000).spend("b.txt", [("b.txt", "ＡＢＣ" * 3_000, "b", 1.0)]))) == 1
    )
    assert documents.normalized_length(expanding * 100, 50_000) <= 50_000 + 18 * 65_536  # stops early


def test_the_worker_reads_a_passage_file_without_brag_or_numpy():
    # What the worker runs for a .json: with brag and numpy unimportable it still reads the items;
    # the server then makes them passages.
    code = (
        "import sys; sys.modules.update(brag=None, numpy=None, scipy=None, bm25s=None)\n"
        "import json\nfrom bragkit import documents\n"
        "data = json.dumps(['one', {'title': 'T', 'text': 'two'}]).encode()\n"
        "content = documents.file_content('p.json', data)\n"
        "print(json.dumps([content.rows, content.items]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], ["one", {"title": "T", "text": "two"}]]
    rows = FileReaders().read(
        [("p.json", json.dumps(["one", {"title": "T", "text": "two"}]).encode())], FileLimits()
    )
    assert [(r[0], r[1]) for r in rows] == [("", "one"), ("T", "two")]
    with pytest.raises(DocumentError, match=r"bad\.json: not a passage list \(passages\[0\]"):
        FileReaders().read([("bad.json", b"[[1, 2]]")], FileLimits())


def test_a_zip_is_unpacked_in_the_worker_and_each_member_read_in_its_turn():
    from document_files import zip_bytes

    manual = zip_bytes([(f"manual/{name}", data) for name, data in FILES] + [("manual/logo.png", b"\x89PNG")])
    files = [("manual.zip", manual), ("broken.pdf", b"%PDF-1.4 junk"), ("notes.md", b"# Notes\n\nOslo.\n")]
    seen: list[tuple[int, int, str]] = []
    readers = FileReaders()
    reading = readers.read_each(files, FileLimits(), on_file=lambda *a: seen.append(a))
    assert [label for _, _, label in seen] == [
        *(f"manual.zip/manual/{name}" for name, _ in FILES),
        "broken.pdf",
        "notes.md",
    ]
    assert {total for _, total, _ in seen} == {7} and [n for n, _, _ in seen] == list(range(1, 8))
    assert reading.rows == documents.read_tree(files).rows  # as this process reads them
    assert [str(f) for f in reading.failed] == [
        "manual.zip/manual/logo.png: not a type BRAG reads (.png)",
        "broken.pdf: not a readable PDF (PdfStreamError)",
    ]
    assert readers.started == 1 and workers_of(os.getpid()) == []


CAPS = r"BRAG_PARSE_(MEMORY_MB|CPU_SECONDS)"


def test_a_member_past_a_cap_is_named_a_killed_worker_is_replaced_and_the_rest_are_read():
    from document_files import zip_bytes

    spans = b"<span>x</span>" * 600_000  # about 8 MB of markup: a parse tree of several hundred MB
    slower = raw_pdf(1, b"q Q " * 1_500_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET")
    members = [
        ("a/one.md", b"# One\n\nFirst.\n"),
        ("a/spans.html", spans),  # past the worker's memory: the reader fails, the worker lives
        ("a/two.md", b"# Two\n\nSecond.\n"),
        ("a/slow.pdf", slower),  # past its CPU time: the worker is killed
        ("a/three.md", b"# Three\n\nThird.\n"),
    ]
    manual = zip_bytes(members, method=zipfile.ZIP_STORED)  # stored: no ratio to refuse it by
    limits = FileLimits(file_bytes=20_000_000, total_bytes=40_000_000, pdf_operations=4_000_000)
    readers = FileReaders(Caps(memory_mb=200, cpu_seconds=1))
    reading = readers.read_each([("manual.zip", manual), ("last.md", b"Last.")], limits)
    assert reading.read == ["manual.zip/a/one.md", "manual.zip/a/two.md", "manual.zip/a/three.md", "last.md"]
    memory, cpu = reading.failed
    # The markup is past both caps: which one stops it first depends on the machine's speed.
    assert memory.name == "manual.zip/a/spans.html" and re.search(CAPS, memory.reason)
    assert cpu.name == "manual.zip/a/slow.pdf" and "BRAG_PARSE_CPU_SECONDS" in cpu.reason
    assert memory.too_large and cpu.too_large
    killed = sum("BRAG_PARSE_CPU_SECONDS" in f.reason for f in reading.failed)
    assert readers.started == 1 + killed and workers_of(os.getpid()) == []  # each kill: a new worker
    with pytest.raises(TooLarge, match=r"manual\.zip/a/spans\.html: .*" + CAPS):
        readers.read([("manual.zip", manual)], limits)  # the strict reader raises it
