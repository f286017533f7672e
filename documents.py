"""Documents as people have them: files in, passages a reader needs out.

``read_files`` turns ``.txt``, ``.md``, ``.pdf``, ``.docx``, ``.html`` and passage ``.json`` /
``.jsonl`` files into :class:`brag.Passage` objects, each titled with its file and its page or
heading path, cut at headings and paragraphs into passages of at most ``max_words`` words (a
paragraph longer than that is cut into windows that overlap by ``overlap`` words). Every file is
bounded (:class:`FileLimits`) and an unreadable one raises :class:`DocumentError` naming it.

Libraries: pypdf (pure Python) for PDF, python-docx for Word, markdown-it-py (installed with
Gradio) for Markdown, selectolax for HTML (one small compiled wheel; trafilatura pulls in a
dozen packages to find the main text of web pages, which uploaded documents do not need). The
cut is a few lines here: semchunk splits text well but knows nothing of pages and headings,
which are what a passage's title and source need.

    DocumentError (ValueError)      a file that cannot be read: its name and why
    └── TooLarge                    a file, or all of them, past a limit
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import brag

SUFFIXES = (".txt", ".md", ".markdown", ".pdf", ".docx", ".html", ".htm", ".json", ".jsonl")


class DocumentError(ValueError):
    """A file that cannot be read, named, with the reason."""


class TooLarge(DocumentError):
    """A file, or all the files of a request, past one of :class:`FileLimits`."""


@dataclass(frozen=True)
class FileLimits:
    """What the files of one request may hold."""

    files: int = 20
    file_bytes: int = 10_000_000
    total_bytes: int = 25_000_000
    pdf_pages: int = 500
    text_chars: int = 5_000_000  # extracted text, all files together


@dataclass(frozen=True)
class Cut:
    """How documents are cut into passages (``bench/results/documents.md`` measures it)."""

    max_words: int = 150
    overlap: int = 30


@dataclass(frozen=True)
class Section:
    """A run of paragraphs under one heading path, or on one PDF page."""

    heading: str
    page: int | None
    paragraphs: list[str]


# ------------------------------------------------------------------------------------------
# Files to passages
# ------------------------------------------------------------------------------------------


def read_files(
    files: Iterable[tuple[str, bytes]], limits: FileLimits = FileLimits(), cut: Cut = Cut()
) -> list[brag.Passage]:
    """Passages from ``(file name, content)`` pairs; :class:`DocumentError` for the first bad one."""
    files = list(files)
    if len(files) > limits.files:
        raise TooLarge(f"{len(files)} files: at most {limits.files} at once")
    total = sum(len(data) for _, data in files)
    if total > limits.total_bytes:
        raise TooLarge(f"{total:,} bytes of files: at most {limits.total_bytes:,} at once")
    passages: list[brag.Passage] = []
    chars = 0
    for name, data in files:
        for passage in read_file(name, data, limits, cut):
            chars += len(passage.text)
            if chars > limits.text_chars:
                raise TooLarge(f"{name}: the files hold more than {limits.text_chars:,} characters of text")
            passages.append(passage)
    return passages


def read_file(
    name: str, data: bytes, limits: FileLimits = FileLimits(), cut: Cut = Cut()
) -> list[brag.Passage]:
    """One file's passages, titled with the file and its page or heading path."""
    name = Path(name).name  # only the name: a path from a caller never means a place here
    if len(data) > limits.file_bytes:
        raise TooLarge(f"{name}: {len(data):,} bytes, at most {limits.file_bytes:,} per file")
    suffix = Path(name).suffix.lower()
    if suffix not in SUFFIXES:
        raise DocumentError(f"{name}: unknown type {suffix or '(none)'}; BRAG reads {', '.join(SUFFIXES)}")
    if suffix in (".json", ".jsonl"):
        return _passage_file(name, data)
    readers = {
        ".pdf": _pdf_sections,
        ".docx": _docx_sections,
        ".html": _html_sections,
        ".htm": _html_sections,
    }
    if suffix in readers:
        sections = readers[suffix](name, data, limits)
    else:
        text = _text(name, data)
        sections = _markdown_sections(text) if suffix in (".md", ".markdown") else _plain_sections(text)
    passages = list(passages_of(name, sections, cut))
    if not passages:
        raise DocumentError(f"{name}: no text found (a scanned PDF holds images, not text)")
    return passages


def passages_of(name: str, sections: Iterable[Section], cut: Cut = Cut()) -> Iterator[brag.Passage]:
    """Each section's paragraphs packed into passages of at most ``cut.max_words`` words."""
    for section in sections:
        title = (
            name
            + (f", p. {section.page}" if section.page else "")
            + (f" › {section.heading}" if section.heading else "")
        )
        for text in _pack(section.paragraphs, cut):
            yield brag.Passage(title, text, doc_id=name)


def _pack(paragraphs: Sequence[str], cut: Cut) -> Iterator[str]:
    """Whole paragraphs while they fit; a longer one cut into overlapping windows of words."""
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        words = paragraph.split()
        if not words:
            continue
        if size and size + len(words) > cut.max_words:
            yield "\n".join(current)
            current, size = [], 0
        if len(words) <= cut.max_words:
            current.append(" ".join(words))
            size += len(words)
            continue
        step = max(1, cut.max_words - cut.overlap)
        for start in range(0, len(words), step):
            yield " ".join(words[start : start + cut.max_words])
            if start + cut.max_words >= len(words):
                break
    if current:
        yield "\n".join(current)


# ------------------------------------------------------------------------------------------
# One reader per type
# ------------------------------------------------------------------------------------------


def _text(name: str, data: bytes) -> str:
    if b"\x00" in data[:8192]:
        raise DocumentError(f"{name}: a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _plain_sections(text: str) -> list[Section]:
    return [Section("", None, _paragraphs(text))]


def _markdown_sections(text: str) -> list[Section]:
    """Paragraphs, list items and code under their heading path (``A › B``)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    path: list[tuple[int, str]] = []
    sections = [Section("", None, [])]
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            level = int(token.tag[1])
            path = [(lv, h) for lv, h in path if lv < level] + [(level, tokens[i + 1].content.strip())]
            sections.append(Section(" › ".join(h for _, h in path), None, []))
        elif token.type == "inline" and tokens[i - 1].type != "heading_open":
            sections[-1].paragraphs.append(token.content)
        elif token.type in ("fence", "code_block"):
            sections[-1].paragraphs.append(token.content)
    return sections


def _html_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Headings, paragraphs, list items, cells and preformatted text, in document order."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(_text(name, data))
    for node in tree.css("script, style, noscript, template"):
        node.decompose()
    path: list[tuple[int, str]] = []
    sections = [Section("", None, [])]
    for node in tree.css("h1, h2, h3, h4, h5, h6, p, li, td, th, pre, blockquote"):
        text = node.text(separator=" ").strip()
        if not text or (node.tag in ("li", "td", "th", "blockquote") and node.css_first("p")):
            continue  # a container whose paragraphs come on their own
        if node.tag[0] == "h" and node.tag[1:].isdigit():
            level = int(node.tag[1])
            path = [(lv, h) for lv, h in path if lv < level] + [(level, " ".join(text.split()))]
            sections.append(Section(" › ".join(h for _, h in path), None, []))
        else:
            sections[-1].paragraphs.append(text)
    return sections


def _docx_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Paragraphs under their heading path (Word's "Heading N" styles), then the tables' rows."""
    import docx

    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as err:  # a damaged zip or XML inside: python-docx raises many kinds
        raise DocumentError(f"{name}: not a readable Word (.docx) file ({type(err).__name__})") from None
    path: list[tuple[int, str]] = []
    sections = [Section("", None, [])]
    for paragraph in document.paragraphs:
        style = paragraph.style.name if paragraph.style is not None else ""
        text = paragraph.text.strip()
        match = re.fullmatch(r"Heading (\d)", style or "")
        if match and text:
            level = int(match.group(1))
            path = [(lv, h) for lv, h in path if lv < level] + [(level, text)]
            sections.append(Section(" › ".join(h for _, h in path), None, []))
        elif text:
            sections[-1].paragraphs.append(text)
    rows = [" | ".join(c.text.strip() for c in row.cells) for table in document.tables for row in table.rows]
    if rows:
        sections.append(Section("tables", None, [r for r in rows if r.strip(" |")]))
    return sections


def _pdf_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """One section per page, its paragraphs split at blank lines."""
    from pypdf import PdfReader

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a damaged file is our error, not a log line
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{name}: an encrypted PDF; save it without a password first")
        pages = len(reader.pages)
    except DocumentError:
        raise
    except Exception as err:  # pypdf raises many kinds on a damaged file (PdfReadError and others)
        raise DocumentError(f"{name}: not a readable PDF ({type(err).__name__})") from None
    if pages > limits.pdf_pages:
        raise TooLarge(f"{name}: {pages:,} pages, at most {limits.pdf_pages:,} per PDF")
    sections = []
    for number, page in enumerate(reader.pages, 1):
        try:
            text = page.extract_text() or ""
        except Exception as err:  # one damaged page: say which
            raise DocumentError(f"{name}: page {number} cannot be read ({type(err).__name__})") from None
        sections.append(Section("", number, _paragraphs(text)))
    return sections


def _passage_file(name: str, data: bytes) -> list[brag.Passage]:
    """A JSON list or JSON Lines of passages, as the app and ``brag index`` take them: not re-cut."""
    text = _text(name, data)
    if name.lower().endswith(".jsonl"):
        text = "[" + ",".join(line for line in text.splitlines() if line.strip()) + "]"
    try:
        items = json.loads(text)
        passages = [p for p in brag._parse_passages(items) if p is not None]
    except (json.JSONDecodeError, ValueError) as err:
        raise DocumentError(f"{name}: not a passage list ({str(err)[:200]})") from None
    return passages
