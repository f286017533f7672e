"""Files in, passages out: each type, the cut, unreadable files, limits and the index command."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from document_files import docx_bytes, docx_with_body, pdf_bytes, raw_pdf, with_declared_size, zip_bytes

import brag
from bragkit import documents
from bragkit.documents import Cut, DocumentError, FileLimits, TooLarge, read_file, read_files

WORDS = " ".join(f"w{i}" for i in range(400))  # 400 distinct words: overlaps are countable


def test_a_pdf_gives_one_titled_passage_set_per_page():
    data = pdf_bytes(["The fjord is long.", "Nothing here.", "Lina Berg was born in Bergen."])
    passages = read_file("report.pdf", data)
    assert [p.title for p in passages] == ["report.pdf, p. 1", "report.pdf, p. 2", "report.pdf, p. 3"]
    assert "born in Bergen" in passages[2].text and all(p.doc_id == "report.pdf" for p in passages)


def test_word_markdown_and_html_keep_their_heading_path():
    word = docx_bytes(
        [(1, "Intro"), (0, "First words."), (2, "Details"), (0, "Deep words."), (1, "End"), (0, "Last.")]
    )
    assert [(p.title, p.text) for p in read_file("notes.docx", word)] == [
        ("notes.docx › Intro", "First words."),
        ("notes.docx › Intro › Details", "Deep words."),
        ("notes.docx › End", "Last."),
    ]
    markdown = b"Lead.\n\n# Guide\n\nIntro.\n\n## Install\n\n- step one\n- step two\n\n```\nrun it\n```\n"
    assert [(p.title, p.text) for p in read_file("guide.md", markdown)] == [
        ("guide.md", "Lead."),
        ("guide.md › Guide", "Intro."),
        ("guide.md › Guide › Install", "step one\nstep two\nrun it"),
    ]
    page = (
        b"<html><head><script>var x = 1;</script><style>p {}</style></head><body><h1>Top</h1><p>One.</p>"
        b"<ul><li>item</li><li><p>in a p</p></li></ul><h2>Sub</h2><p>Two.</p></body></html>"
    )
    assert [(p.title, p.text) for p in read_file("page.html", page)] == [
        ("page.html › Top", "One.\nitem\nin a p"),
        ("page.html › Top › Sub", "Two."),
    ]


def test_text_and_passage_files_are_read_as_today():
    text = b"First paragraph.\n\nSecond paragraph."
    assert [p.text for p in read_file("a.txt", text)] == ["First paragraph.\nSecond paragraph."]
    listed = json.dumps([{"title": "T", "text": "one"}, "two"]).encode()
    assert [(p.title, p.text) for p in read_file("p.json", listed)] == [("T", "one"), ("", "two")]
    lines = b'{"title": "A", "text": "x"}\n\n"y"\n'
    assert [p.text for p in read_file("p.jsonl", lines)] == ["x", "y"]


def test_the_cut_packs_paragraphs_and_cuts_a_long_one_with_an_overlap():
    cut = Cut(max_words=100, overlap=20)
    short = ["a b c", "d e f"]  # two short paragraphs share a passage
    assert list(documents._pack(short, cut)) == ["a b c\nd e f"]
    windows = list(documents._pack([WORDS], cut))
    sizes = [len(w.split()) for w in windows]
    assert max(sizes) == 100 and sum(sizes) - 20 * (len(windows) - 1) == 400  # every word, overlaps once
    for left, right in itertools.pairwise(windows):
        assert left.split()[-20:] == right.split()[:20]
    assert windows[0].split()[0] == "w0" and windows[-1].split()[-1] == "w399"
    # A paragraph never straddles two passages unless it is itself too long.
    mixed = list(documents._pack(["x " * 60, "y " * 60, "z " * 30], cut))
    assert [len(p.split()) for p in mixed] == [60, 90]


def test_text_without_spaces_is_cut_by_characters_two_to_a_word():
    cut = Cut(max_words=10, overlap=2)
    # 40 characters of Japanese: 20 "words", so windows of 20 characters overlapping by 4.
    sentence = "東京タワーは電波塔です。設計者は内藤多仲です。" * 2
    sentence = sentence[:40]
    windows = list(documents._pack([sentence], cut))
    assert windows == [sentence[0:20], sentence[16:36], sentence[32:40]]
    # Latin words and digits inside such text count one each, and keep their spaces.
    assert list(documents._pack(["Tokyo Tower 東京タワー 1958年", "次"], cut)) == [
        "Tokyo Tower 東京タワー 1958年\n次"
    ]
    # A whole Japanese page is no longer one passage: it used to count as a handful of "words".
    page = ["。".join(["東京タワーは1958年に完成した電波塔で、設計者は内藤多仲です"] * 20)]
    assert len(list(documents._pack(page, Cut()))) > 1


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("secret.pdf", pdf_bytes(["hidden"], password="pw"), "secret.pdf: an encrypted PDF"),
        ("broken.pdf", b"%PDF-1.4 not really", "broken.pdf: not a readable PDF"),
        ("broken.docx", b"PK\x03\x04 not a zip", "broken.docx: not a readable Word"),
        ("image.txt", b"\x89PNG\x00\x00\x00", "image.txt: a binary file"),
        ("archive.zip", b"PK", "archive.zip: unknown type .zip"),
        ("empty.md", b"   \n\n", "empty.md: no text found"),
        ("bad.json", b"[{", "bad.json: not a passage list"),
    ],
)
def test_an_unreadable_file_is_named_with_the_reason(name, data, message):
    with pytest.raises(DocumentError, match=message):
        read_file(name, data)


@pytest.mark.parametrize(
    ("limits", "files", "message"),
    [
        (FileLimits(files=2), [("a.txt", b"a")] * 3, "3 files: at most 2"),
        (FileLimits(file_bytes=10), [("a.txt", b"x" * 11)], "a.txt: 11 bytes, at most 10 per file"),
        (
            FileLimits(total_bytes=15),
            [("a.txt", b"x" * 10), ("b.txt", b"y" * 10)],
            "20 bytes of files: at most 15",
        ),
        (FileLimits(pdf_pages=2), [("long.pdf", pdf_bytes(["1", "2", "3"]))], "long.pdf: 3 pages, at most 2"),
        (FileLimits(text_chars=50), [("a.txt", WORDS.encode())], "more than 50 characters"),
    ],
)
def test_each_limit_has_its_message(limits, files, message):
    with pytest.raises(TooLarge, match=message):
        read_files(files, limits)


def test_a_name_is_only_a_name():
    (passage,) = read_file("../../etc/notes.txt", b"Some words.")
    assert passage.title == "notes.txt" and passage.doc_id == "notes.txt"


def test_the_index_command_reads_a_folder_reports_a_bad_file_and_writes_only_when_whole(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "report.pdf").write_bytes(pdf_bytes(["The fjord is long.", "Lina Berg was born in Bergen."]))
    (docs / "sub" / "notes.md").write_text("# Notes\n\nOslo is the capital of Norway.\n", encoding="utf-8")
    (docs / "sub" / "broken.docx").write_bytes(b"PK\x03\x04 junk")
    (docs / "ignored.bin").write_bytes(b"\x00")  # not a document type: a folder's other files are skipped
    out = tmp_path / "index"
    result = subprocess.run(
        [sys.executable, "-m", "brag", "index", str(docs), str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "broken.docx: not a readable Word (.docx) file" in result.stderr and "[3/3]" in result.stderr
    assert "report.pdf: 2 passages" in result.stderr and "ignored.bin" not in result.stderr
    corpus = brag.Corpus.load(out)
    titles = sorted(corpus[i].title for i in range(len(corpus)))
    assert titles == ["notes.md › Notes", "report.pdf, p. 1", "report.pdf, p. 2"]
    assert corpus.retrieve("Where was Lina Berg born?", 1).hits[0][0] in range(len(corpus))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "index"]  # no partial folder left
    # An existing folder is never overwritten, and a failed run leaves nothing behind.
    again = subprocess.run(
        [sys.executable, "-m", "brag", "index", str(docs), str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.pdf").write_bytes(b"%PDF junk")
    failed = subprocess.run(
        [sys.executable, "-m", "brag", "index", str(bad), str(tmp_path / "never")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert failed.returncode == 2 and "no readable document" in failed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "docs", "index"]


# ------------------------------------------------------------------ bounds inside each format


def test_word_tables_are_read_in_place_and_styles_map_headings():
    from docx import Document

    document = Document()
    document.add_heading("Staff", 1)
    table = document.add_table(rows=2, cols=2)
    for r, row in enumerate([("Name", "City"), ("Lina Berg", "Bergen")]):
        for c, text in enumerate(row):
            table.cell(r, c).text = text
    document.add_heading("After", 1)
    document.add_paragraph("Later words.")
    out = io.BytesIO()
    document.save(out)
    assert [(p.title, p.text) for p in read_file("staff.docx", out.getvalue())] == [
        ("staff.docx › Staff", "Name | City\nLina Berg | Bergen"),
        ("staff.docx › After", "Later words."),
    ]


@pytest.mark.parametrize(
    ("data", "limits", "message"),
    [
        # 2,000,000 empty elements pack about 1,000 times: refused before anything inflates.
        (
            lambda: docx_with_body(b"<w:x/>" * 2_000_000),
            FileLimits(),
            r"inflates \d[\d,]* times .* at most 100",
        ),
        (lambda: docx_with_body(b"<w:p/>" * 200), FileLimits(zip_entries=5), r"parts in its zip, at most 5"),
        (
            lambda: docx_with_body(b"<w:p/>" * 200),
            FileLimits(unzipped_bytes=5_000),
            "unpack to more than 5,000",
        ),
        (lambda: docx_with_body(b"<w:p/>" * 200), FileLimits(xml_elements=100), "more than 100 XML elements"),
    ],
    ids=["ratio", "entries", "unzipped", "elements"],
)
def test_a_word_file_past_a_bound_is_refused_before_it_is_parsed(data, limits, message):
    with pytest.raises(TooLarge, match=message):
        read_file("crafted.docx", data(), limits)


@pytest.mark.parametrize(
    "prolog",
    [
        b'<?xml version="1.0"?><!DOCTYPE w:document [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;">]>',
        b'<?xml version="1.0"?><!DOCTYPE w:document [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>',
        b'<?xml version="1.0"?><!DOCTYPE w:document SYSTEM "http://127.0.0.1:9/evil.dtd">',
    ],
    ids=["laughs", "external-entity", "external-dtd"],
)
def test_xml_with_a_dtd_is_refused_and_no_entity_is_expanded(prolog):
    body = b"<w:p><w:r><w:t>&lol2;&xxe;</w:t></w:r></w:p>"
    with pytest.raises(DocumentError, match="declares a DTD") as err:
        read_file("entities.docx", docx_with_body(body, prolog))
    assert "root:" not in str(err.value)


def test_empty_word_paragraphs_cost_linear_time_and_give_no_text():
    # python-docx looked up every paragraph's style: a minute for 50,000. Here the body is streamed.
    with pytest.raises(DocumentError, match=r"empty\.docx: no text found$"):
        read_file("empty.docx", docx_with_body(b"<w:p/>" * 50_000))


def test_pdf_pages_sharing_one_stream_spend_one_budget_for_the_document():
    # Twenty pages draw the same stream of 20,000 operations: each page alone is cheap, the
    # document is twenty times that, and the document's budget is what holds.
    content = b"q Q " * 10_000 + b"BT /F1 12 Tf (Lina Berg was born in Bergen.) Tj ET"
    shared = raw_pdf(20, content)
    assert len(read_file("one.pdf", raw_pdf(1, content), FileLimits(pdf_operations=50_000))) == 1
    with pytest.raises(TooLarge, match=r"more than 50,000 drawing operations in the document"):
        read_file("shared.pdf", shared, FileLimits(pdf_operations=50_000))
    with pytest.raises(TooLarge, match=r"more than 100,000 bytes of page content"):
        read_file("shared.pdf", shared, FileLimits(pdf_content_bytes=100_000))
    assert len(read_file("shared.pdf", shared)) == 20  # within the default budget


def test_pdf_objects_and_inflated_streams_are_bounded():
    content = b"BT /F1 12 Tf (Bergen) Tj ET"
    with pytest.raises(TooLarge, match=r"objects, at most 3 per PDF"):
        read_file("many.pdf", raw_pdf(3, content, shared=False), FileLimits(pdf_objects=3))
    spaces = raw_pdf(1, b" " * 3_000_000 + content)
    with pytest.raises(TooLarge, match=r"spaces\.pdf: page 1 holds more than a page may"):
        read_file("spaces.pdf", spaces, FileLimits(stream_bytes=1_000_000))
    assert read_file("spaces.pdf", spaces)[0].text == "Bergen"


def test_html_nesting_is_refused_before_the_parser_and_text_is_taken_once():
    deep = ("<blockquote>w " * 600 + "</blockquote>" * 600).encode()
    with pytest.raises(TooLarge, match="nested more than 512 elements deep"):
        read_file("deep.html", deep)
    # Within the bound, every word comes out once, whatever encloses it (the old reader took
    # each element's whole text, so words repeated once per enclosing element).
    nested = "".join(f"<div>d{i} " for i in range(300)) + "</div>" * 300
    words = " ".join(p.text for p in read_file("nested.html", nested.encode())).split()
    assert sorted(words) == sorted(f"d{i}" for i in range(300))
    # Implied ends, empty elements and raw text do not count as nesting.
    flat = b"<p>x" * 2_000 + b"<br>" * 2_000 + b"<script>" + b"<div>" * 2_000 + b"</script><li>y"
    assert "x" in read_file("flat.html", flat)[0].text


def test_markdown_is_scanned_line_by_line_in_linear_time():
    text = b"Title\n=====\n\nIntro.\n\n> quoted *words*\n\n1. first\n2) second\n\n---\n\n~~~\ncode\n~~~\n"
    assert [(p.title, p.text) for p in read_file("a.md", text)] == [
        ("a.md › Title", "Intro.\nquoted *words*\nfirst\nsecond\ncode"),
    ]
    # Inputs that cost markdown-it seconds (headings without text, unclosed image brackets).
    with pytest.raises(DocumentError, match="no text found"):
        read_file("heads.md", b"# h\n" * 200_000)
    assert read_file("images.md", b"![" * 200_000)[0].text.startswith("![![")


def test_titles_count_toward_the_text_limit_and_are_cut():
    long_heading = b"# " + b"H" * 5_000 + b"\n\nA few words.\n"
    (passage,) = read_file("long.md", long_heading)
    assert len(passage.title) <= FileLimits().title_chars and passage.title.endswith("…")
    titled = json.dumps([{"title": "T" * 5_000, "text": "one"}]).encode()
    assert len(read_file("t.json", titled)[0].title) <= FileLimits().title_chars
    with pytest.raises(TooLarge, match="more than 200 characters"):
        read_files(
            [("t.json", json.dumps([{"title": "T" * 250, "text": "one"}]).encode())],
            FileLimits(text_chars=200),
        )


def test_a_passage_file_nested_too_deeply_is_an_error_not_a_crash():
    with pytest.raises(DocumentError, match=r"deep\.json: not a passage list .*nested too deeply"):
        read_file("deep.json", b"[" * 100_000 + b"]" * 100_000)


def test_the_index_command_never_opens_a_fifo_a_device_or_an_oversized_file(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    with open(tmp_path / "huge.txt", "wb") as huge:
        huge.truncate(50_000_000)  # sparse: no disk used, past the 10 MB a file may hold
    (tmp_path / "ok.txt").write_text("Oslo is the capital of Norway.")
    names = ["pipe.txt", "zero.txt", "huge.txt", "ok.txt"]
    result = subprocess.run(
        [sys.executable, "-m", "brag", "index", *names, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "pipe.txt: not a regular file" in result.stderr and "zero.txt: not a regular file" in result.stderr
    assert "huge.txt: 50,000,000 bytes, at most 10,000,000 per file" in result.stderr
    assert brag.Corpus.load(tmp_path / "out")[0].text == "Oslo is the capital of Norway."


def test_the_guides_that_list_the_files_brag_reads_list_every_one():
    import re

    from bragkit import documents

    for path, line in ((ROOT / "docs" / "scaling.md", "Documents ("), (ROOT / "README.md", "# files:")):
        text = next(ln for ln in path.read_text(encoding="utf-8").splitlines() if line in ln)
        listed = re.findall(r"\.[a-z]+\b", text.split(line, 1)[1])
        missing = sorted(set(documents.SUFFIXES) - set(listed))
        assert missing == [], path.name


# ------------------------------------------------------------------ trees of files and archives

MANUAL = [
    ("manual/", b""),
    ("manual/html/", b""),
    ("manual/html/intro.html", b"<h1>Intro</h1><p>The tool starts with <b>run</b>.</p>"),
    ("manual/report.pdf", pdf_bytes(["The fjord is long.", "Lina Berg was born in Bergen."])),
    ("manual/notes.docx", docx_bytes([(1, "Staff"), (0, "Lina Berg designed the tower.")])),
    ("manual/guide.md", b"# Guide\n\nInstall it.\n"),
    ("manual/_sources/usage.rst.txt", b"Usage\n=====\n\nCall it twice.\n"),
    ("manual/passages.json", json.dumps([{"title": "T", "text": "one"}]).encode()),
    ("manual/logo.png", b"\x89PNG\r\n\x1a\n"),
    ("manual/style.css", b"p {}"),
    ("manual/old.zip", b"PK\x05\x06" + b"\0" * 18),
    ("__MACOSX/manual/._guide.md", b"\0\x05\x16\x07"),  # a Mac's fork of guide.md: not a file
]


def test_a_zip_is_read_as_its_files_each_titled_by_its_path_inside():
    reading = documents.read_tree([("manual.zip", zip_bytes(MANUAL))])
    titles = [title for title, *_ in reading.rows]
    assert titles == [
        "manual.zip/manual/html/intro.html › Intro",
        "manual.zip/manual/report.pdf, p. 1",
        "manual.zip/manual/report.pdf, p. 2",
        "manual.zip/manual/notes.docx › Staff",
        "manual.zip/manual/guide.md › Guide",
        "manual.zip/manual/_sources/usage.rst.txt › Usage",
        "T",
    ]
    assert reading.rows[2][1:3] == ("Lina Berg was born in Bergen.", "manual.zip/manual/report.pdf")
    # The same passages as the files uploaded one by one, but for their names.
    documents_in = [(name.rsplit("/", 1)[1], data) for name, data in MANUAL[2:8]]
    assert [r[1] for r in reading.rows] == [p.text for p in read_files(documents_in)]
    assert len(reading.read) == 6 and reading.read[0] == "manual.zip/manual/html/intro.html"
    summary = reading.summary()
    nested = "an archive (or compressed file) inside the archive: not expanded"
    assert summary["not_read"] == [{"file": "manual.zip/manual/old.zip", "reason": nested}]
    assert summary["skipped_types"] == {".css": 1, ".png": 1} and summary["skipped_count"] == 2
    # The strict reader takes archives too, and passes over the types it does not read.
    assert [p.title for p in read_files([("manual.zip", zip_bytes(MANUAL))])] == titles


def test_restructuredtext_is_cut_at_its_titles_by_their_adornment():
    text = (
        b"=====\nGuide\n=====\n\nLead.\n\nInstall\n-------\n\nRun it::\n\n    pip install x\n\n"
        b".. note::\n\n   Be careful.\n\nLinux\n~~~~~\n\nOn Linux.\n\n----\n\nUsage\n-----\n\nUse it.\n"
    )
    assert [(p.title, p.text) for p in read_file("guide.rst", text)] == [
        ("guide.rst › Guide", "Lead."),
        ("guide.rst › Guide › Install", "Run it::\npip install x\nBe careful."),
        ("guide.rst › Guide › Install › Linux", "On Linux."),
        ("guide.rst › Guide › Usage", "Use it."),
    ]


def test_one_file_that_cannot_be_read_is_named_and_the_others_are_read():
    files = [
        ("broken.pdf", b"%PDF-1.4 not really"),
        ("notes.md", b"# Notes\n\nOslo is the capital of Norway.\n"),
        ("big.txt", b"x " * 5_000),
        (
            "manual.zip",
            zip_bytes([("a/secret.pdf", pdf_bytes(["hidden"], password="pw")), ("a/b.txt", b"Words.")]),
        ),
    ]
    seen: list[tuple[int, int, str]] = []
    reading = documents.read_tree(files, FileLimits(file_bytes=5_000), on_file=lambda *a: seen.append(a))
    assert seen == [
        (1, 5, "broken.pdf"),
        (2, 5, "notes.md"),
        (3, 5, "big.txt"),
        (4, 5, "manual.zip/a/secret.pdf"),
        (5, 5, "manual.zip/a/b.txt"),
    ]
    assert reading.read == ["notes.md", "manual.zip/a/b.txt"]
    assert [str(f) for f in reading.failed] == [
        "broken.pdf: not a readable PDF (PdfStreamError)",
        "big.txt: 10,000 bytes, at most 5,000 per file",
        "manual.zip/a/secret.pdf: an encrypted PDF; save it without a password first",
    ]
    assert [f.too_large for f in reading.failed] == [False, True, False]
    with pytest.raises(DocumentError, match=r"broken\.pdf: not a readable PDF"):
        read_files(files, FileLimits(file_bytes=5_000))  # the strict reader stops at the first


def hostile(kind: str) -> bytes:
    """A zip crafted to hurt a reader, or to read what it should not."""
    import zipfile

    if kind == "encrypted":
        # Says encrypted (bit 0 of its flags, in both headers): never tried, whatever follows.
        locked = bytearray(zip_bytes([("locked.txt", b"Words.")]))
        for signature, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            locked[locked.find(signature) + offset] |= 0x1
        return bytes(locked)
    if kind == "bzip2":
        return zip_bytes([("packed.txt", b"Words. " * 100)], method=zipfile.ZIP_BZIP2)
    names = {
        "absolute": "/etc/cron.d/job.txt",
        "climbs": "docs/../../../etc/passwd.txt",
        "windows": "C:\\Windows\\evil.txt",
        "control": "a\nforged line\u202e.txt",
    }
    return zip_bytes([(names[kind], b"Words."), ("fine.txt", b"Fine words.")])


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("encrypted", "locked.txt: encrypted: zip it again without a password"),
        ("bzip2", "packed.txt: packed by a method BRAG does not unpack (only stored or deflated)"),
        ("absolute", "etc/cron.d/job.txt: its name is an absolute path or climbs out of the archive"),
        ("climbs", "docs/../../../etc/passwd.txt: its name is an absolute path or climbs out of the archive"),
        ("windows", "C:/Windows/evil.txt: its name is an absolute path or climbs out of the archive"),
    ],
)
def test_a_member_that_should_not_be_read_is_named_and_never_inflated(kind, reason):
    reading = documents.read_tree([("x.zip", hostile(kind))])
    (failure,) = reading.failed
    assert str(failure).startswith(f"x.zip/{reason}") and not failure.skipped
    assert reading.read == ([] if kind in ("encrypted", "bzip2") else ["x.zip/fine.txt"])


def test_a_members_name_is_a_printable_label_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reading = documents.read_tree([("odd\u202ename\n.zip", hostile("control"))])
    assert reading.read == ["odd?name?.zip/a?forged line?.txt", "odd?name?.zip/fine.txt"]
    assert reading.rows[0][0] == "odd?name?.zip/a?forged line?.txt"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("data", "limits", "message"),
    [
        # 20 members to read, the request may read 12 more after its 3 plain files.
        (
            lambda: zip_bytes([(f"p{i}.txt", b"w") for i in range(20)]),
            FileLimits(files=15),
            r"x\.zip: 20 files to read in it, and the request may read at most 12 more",
        ),
        # Declared unpacked sizes past the request's bytes, before anything inflates.
        (
            lambda: zip_bytes([(f"p{i}.txt", b"w " * 50_000) for i in range(5)]),
            FileLimits(total_bytes=400_000),
            r"x\.zip: its files unpack to 500,000 bytes, and the request's files may hold at most [\d,]+",
        ),
        (lambda: zip_bytes([(f"p{i}.txt", b"w") for i in range(9)]), FileLimits(zip_entries=8), r"9 entries"),
        (lambda: b"PK\x03\x04 not a zip at all", FileLimits(), r"x\.zip: not a readable \.zip archive"),
    ],
    ids=["members", "unpacked", "entries", "malformed"],
)
def test_a_zip_past_a_bound_or_malformed_is_refused_with_its_reason(data, limits, message):
    plain = [(f"f{i}.txt", b"Words.") for i in range(3)]
    reading = documents.read_tree([*plain, ("x.zip", data())], limits)
    assert reading.read == ["f0.txt", "f1.txt", "f2.txt"]  # the other files are read
    (failure,) = reading.failed
    assert re.search(message, str(failure)), str(failure)


def test_a_zip_bomb_is_refused_before_it_inflates_and_a_lying_size_while_it_does():
    bomb = zip_bytes([("zeros.txt", b"\0" * 20_000_000), ("fine.txt", b"Fine words.")])
    assert len(bomb) < 100_000
    reading = documents.read_tree(
        [("bomb.zip", bomb)], FileLimits(file_bytes=50_000_000, total_bytes=60_000_000)
    )
    assert reading.read == ["bomb.zip/fine.txt"]
    assert re.fullmatch(
        r"bomb\.zip/zeros\.txt: inflates [\d,]+ times its packed size, at most 100 \(a zip bomb\?\)",
        str(reading.failed[0]),
    )
    # Headers that say 1,000 bytes for 2 MB of text: never more than 1,000 come out.
    liar = with_declared_size(zip_bytes([("small.txt", b"words " * 350_000)]), 1_000)
    reading = documents.read_tree([("liar.zip", liar)])
    (failure,) = reading.failed
    assert str(failure) == "liar.zip/small.txt: could not be unpacked (BadZipFile)"
