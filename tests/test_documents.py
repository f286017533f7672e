"""Files in, passages out: each type, the cut, unreadable files, limits and the index command."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from conftest import ROOT
from document_files import docx_bytes, pdf_bytes

import brag
import documents
from documents import Cut, DocumentError, FileLimits, TooLarge, read_file, read_files

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
