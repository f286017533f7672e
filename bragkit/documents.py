"""Documents as people have them: files in, passages a reader needs out.

``read_files`` turns ``.txt``, ``.md``, ``.rst``, ``.pdf``, ``.docx``, ``.html`` and passage
``.json`` / ``.jsonl`` files into :class:`brag.Passage` objects, each titled with its file and its
page or heading path, cut at headings and paragraphs into passages of at most ``max_words`` words
(a paragraph longer than that is cut into windows that overlap by ``overlap`` words). An
unreadable file raises :class:`DocumentError` naming it. A ``.zip`` is a tree of such files: its
members are read as if uploaded one by one, each titled with its path inside the archive
(``manual.zip/html/intro.html › Install``). ``read_all`` (``read_tree`` here, the parse worker
in the app) reads a request's files one at a time and names each one it cannot read, with the
reason, instead of stopping at it.

Libraries: pypdf (pure Python) for PDF, selectolax for HTML (one small compiled wheel;
trafilatura pulls in a dozen packages to find the main text of web pages, which uploaded
documents do not need). Word files are read here, straight from their zip: a streaming XML
parser (expat) that keeps no tree, so a paragraph costs the same whatever the file holds.
Markdown and reStructuredText are cut by line scanners: a passage needs the heading path and the
paragraphs, not rendered inline markup, and a scanner takes linear time on any input.

Every file is bounded, and the bound that guards each format is checked before the part of the
work it guards (each is a :class:`FileLimits` field):

    every file     bytes (file_bytes, total_bytes); text and titles together (text_chars);
                   a title is cut at title_chars
    .docx          before inflating: zip entries (zip_entries), the declared size of the parts
                   read (unzipped_bytes), each part's compression ratio (zip_ratio); each part
                   read with a byte cap; XML with no DTD (so no entity is ever expanded and no
                   file or URL resolved), at most xml_elements elements
    .pdf           objects (pdf_objects) and pages (pdf_pages) before any page is read; drawing
                   operations and bytes of page content over the whole document (pdf_operations,
                   pdf_content_bytes), each stream's parse budgeted by what the document has
                   left, a page drawn again counted again; inflated streams (stream_bytes)
    .html          nesting (html_depth), scanned before the parser sees the file (its cost grows
                   with depth times tags); text taken once per text node
    .md .rst .txt  linear scanners; no parser with backtracking
    .zip           before listing: the entries its end record declares (zip_entries); before
                   inflating: members to read (against the request's files), their declared
                   unpacked bytes (against the request's total_bytes, each against file_bytes),
                   each one's compression ratio (zip_ratio), encryption, the packing method
                   (stored or deflated: each chunk inflates within a bound); while inflating,
                   the bytes that come out, never more than declared; archives inside are not
                   expanded, names are labels only (nothing is written; absolute or ``..``
                   names are not read)
    .json .jsonl   a nesting too deep for the parser is an error, not a crash

The app also reads every uploaded file in a worker process whose memory and CPU time are
capped (``bragkit/serving/parse_worker.py``), so a bound that does not hold still cannot hurt the server.

    DocumentError (ValueError)      a file that cannot be read: its name and why
    ├── TooLarge                    a file past a limit
    │   └── RequestTooLarge         all the files of a request past a limit: reading stops
    └── RequestStopped              reading stops for every file (RequestTooLarge is one)
"""

from __future__ import annotations

import contextvars
import functools
import io
import itertools
import json
import logging
import re
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import brag

# Files of passages, read as they are (a JSON list, or JSON Lines), not cut from a document.
PASSAGE_SUFFIXES = (".json", ".jsonl")


def described_suffixes() -> str:
    """The files BRAG reads, as a label or a help says it: ``.txt .md …, or passages as .json / .jsonl``."""
    documents = " ".join(s for s in SUFFIXES if s not in PASSAGE_SUFFIXES)
    return f"{documents}, or passages as {' / '.join(PASSAGE_SUFFIXES)}"


class DocumentError(ValueError):
    """A file that cannot be read, named, with the reason."""


class TooLarge(DocumentError):
    """A file, or all the files of a request, past one of :class:`FileLimits`."""


class RequestStopped(DocumentError):
    """Reading stops for every file of the request, not only for the one being read.

    The parse worker's ``ReadingAbandoned`` is one: the caller went, or the deadline passed.
    """


class RequestTooLarge(TooLarge, RequestStopped):
    """All the files of a request together past a limit (files, bytes, text, passages): no more is read."""


@dataclass(frozen=True)
class FileLimits:
    """What the files of one request may hold, and the bounds inside each format."""

    files: int = 20
    file_bytes: int = 10_000_000
    total_bytes: int = 25_000_000
    pdf_pages: int = 500
    text_chars: int = 5_000_000  # extracted text and titles, all files together
    passages: int = 100_000  # passages, all files together (a passage file's are counted unparsed)
    title_chars: int = 300  # a passage's title (file name and heading path) is cut here
    zip_entries: int = 10_000
    unzipped_bytes: int = 50_000_000  # the declared size of the parts of a .docx that are read
    zip_ratio: int = 100  # a part over 1 MB may inflate at most this many times its packed size
    xml_elements: int = 2_000_000
    pdf_objects: int = 1_000_000
    pdf_operations: int = 1_000_000  # drawing operations parsed, the whole document's
    pdf_content_bytes: int = 25_000_000  # page content parsed, the whole document's
    stream_bytes: int = 20_000_000  # one PDF stream, inflated
    html_depth: int = 512  # elements open at once (a browser's parser stops nesting there too)


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


# A passage as plain data, ``(title, text, doc_id, salience)``: what the parse worker sends
# back, and what becomes a brag.Passage in the process that indexes it.
Row = tuple[str, str, str, float]


@dataclass(frozen=True)
class FileContent:
    """What one file holds, as plain data: passages cut from a document, or a passage file's items.

    The parse worker sends it back without making passages of the items (that needs brag, and
    with it numpy); :func:`content_rows` does, in the process that indexes them.
    """

    name: str
    rows: list[Row]
    items: list[Any]  # a passage file's JSON list, unvalidated


# ------------------------------------------------------------------------------------------
# Files to passages
# ------------------------------------------------------------------------------------------


def read_files(
    files: Iterable[tuple[str, bytes]], limits: FileLimits = FileLimits(), cut: Cut = Cut()
) -> list[brag.Passage]:
    """Passages from ``(file name, content)`` pairs; :class:`DocumentError` for the first bad one.

    An archive's members are read as files of their own (:func:`read_all`).
    """
    return as_passages(read_all(list(files), limits, Source(cut), strict=True).rows)


def read_file(
    name: str, data: bytes, limits: FileLimits = FileLimits(), cut: Cut = Cut()
) -> list[brag.Passage]:
    """One file's passages, titled with the file and its page or heading path."""
    return as_passages(file_rows(name, data, limits, cut))


def check_request(files: Sequence[tuple[str, bytes]], limits: FileLimits) -> None:
    """The number of files and their bytes, before any is read."""
    if len(files) > limits.files:
        raise RequestTooLarge(f"{len(files)} files: at most {limits.files} at once")
    total = sum(len(data) for _, data in files)
    if total > limits.total_bytes:
        raise RequestTooLarge(f"{total:,} bytes of files: at most {limits.total_bytes:,} at once")


_NORMALIZED_CHUNK = 1 << 16  # characters normalised at a time when counting


def normalized_length(text: str, limit: int) -> int:
    """The length of ``text``'s NFKC form, counted no further than just past ``limit``.

    BRAG analyses, matches and checks text in that form, where one character can become
    eighteen (U+FDFA), so a limit holds for the work only when it counts that form. Text
    already in it (nearly all) costs one scan; other text is normalised a chunk at a time, and
    the count stops once it is over ``limit``.
    """
    if unicodedata.is_normalized("NFKC", text):
        return len(text)
    total = 0
    for start in range(0, len(text), _NORMALIZED_CHUNK):
        total += len(unicodedata.normalize("NFKC", text[start : start + _NORMALIZED_CHUNK]))
        if total > limit:
            break
    return total


class TextBudget:
    """The characters of text and titles a request's files may hold, spent file by file.

    Counted in NFKC form (:func:`normalized_length`), the form every later step reads.
    """

    def __init__(self, chars: int) -> None:
        self.limit, self.left, self.written = chars, chars, 0

    def spend(self, name: str, rows: Iterable[Row]) -> Iterator[Row]:
        """The rows, each counted; TooLarge once they hold more than the budget."""
        for row in rows:
            for text in row[:2]:
                self.left -= normalized_length(text, max(self.left, 0))
                self.written += len(text)
            if self.left < 0:
                # Say why when the text as written is within the limit and only its form is not.
                written = self.written <= self.limit
                form = " once normalised (Unicode NFKC, as BRAG reads text)" if written else ""
                raise RequestTooLarge(
                    f"{name}: the files hold more than {self.limit:,} characters of text{form}"
                )
            yield row


def as_passages(rows: Iterable[Row]) -> list[brag.Passage]:
    """Rows as brag.Passage objects.

    brag is imported here, not at the top: the parse worker imports this module to read files
    and never needs numpy, scipy or bm25s, so it starts fast in a small address space.
    """
    import brag

    return [brag.Passage(*row) for row in rows]


def file_rows(name: str, data: bytes, limits: FileLimits = FileLimits(), cut: Cut = Cut()) -> list[Row]:
    """One file's passages as rows (:func:`file_content`, then :func:`content_rows`)."""
    return content_rows(file_content(name, data, limits, cut), limits)


def content_rows(content: FileContent, limits: FileLimits = FileLimits()) -> list[Row]:
    """A file's rows: its document's, or its passage items made passages by ``brag.parse_passages``.

    Here, not in the parse worker: brag (and numpy) load in the process that indexes them.
    """
    if not content.items:
        return content.rows
    import brag

    try:
        passages = [p for p in brag.parse_passages(content.items) if p is not None]
    except ValueError as err:
        raise DocumentError(f"{content.name}: not a passage list ({str(err)[:200]})") from None
    return [(_shorten(p.title, limits.title_chars), p.text, p.doc_id, p.salience) for p in passages]


def file_content(name: str, data: bytes, limits: FileLimits = FileLimits(), cut: Cut = Cut()) -> FileContent:
    """One file read: what the parse worker reads and sends back (the standard library only)."""
    name = display_name(name)  # only the name: a path from a caller never means a place here
    return _content(name, suffix_of(name), data, limits, cut)


def _content(name: str, suffix: str, data: bytes, limits: FileLimits, cut: Cut) -> FileContent:
    """A document's passages (or a passage file's items), ``name`` being what they are titled with."""
    if len(data) > limits.file_bytes:
        raise TooLarge(f"{name}: {len(data):,} bytes, at most {limits.file_bytes:,} per file")
    if suffix not in SUFFIXES:
        raise DocumentError(f"{name}: unknown type {suffix or '(none)'}; BRAG reads {', '.join(SUFFIXES)}")
    if suffix in PASSAGE_SUFFIXES:
        return FileContent(name, [], _passage_items(name, data, limits))
    sections = READERS[suffix](name, data, limits)
    rows = list(rows_of(name, sections, cut, limits.title_chars))
    if not rows:
        hint = " (a scanned PDF holds images, not text)" if suffix == ".pdf" else ""
        raise DocumentError(f"{name}: no text found{hint}")
    if len(rows) > limits.passages:
        raise _too_many_passages(name, len(rows), limits)
    return FileContent(name, rows, [])


# Sources a documentation tool ships beside its pages (Sphinx's _sources/*.rst.txt): read as
# what they are, not as plain text.
COMPOUND_SUFFIXES = {".rst.txt": ".rst", ".md.txt": ".md"}


def suffix_of(name: str) -> str:
    """The type a file name says, lower case: ``.pdf``; ``.rst`` for ``.rst.txt``, ``.md`` for ``.md.txt``."""
    lower = name.lower()
    for compound, suffix in COMPOUND_SUFFIXES.items():
        if lower.endswith(compound):
            return suffix
    return PurePosixPath(lower).suffix


def display_name(name: str, chars: int = 200) -> str:
    """A file name as shown and used as a label: its last part, every unprintable character as ``?``.

    Line breaks, controls and bidirectional overrides cannot forge a line or reorder what is
    shown; past ``chars`` the middle is cut.
    """
    last = re.split(r"[/\\]", name)[-1] if name else ""
    return _printable(last, chars) or "(no name)"


def _printable(text: str, chars: int) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) <= chars:
        return text
    half = (chars - 1) // 2
    return text[:half] + "…" + text[-half:]


def _too_many_passages(name: str, count: int, limits: FileLimits) -> TooLarge:
    return RequestTooLarge(
        f"{name}: {count:,} passages, and the files may hold at most {limits.passages:,} more"
    )


def rows_of(
    name: str, sections: Iterable[Section], cut: Cut = Cut(), title_chars: int = FileLimits.title_chars
) -> Iterator[Row]:
    """Each section's paragraphs packed into passages of at most ``cut.max_words`` words."""
    for section in sections:
        title = (
            name
            + (f", p. {section.page}" if section.page else "")
            + (f" › {section.heading}" if section.heading else "")
        )
        title = _shorten(title, title_chars)
        for text in _pack(section.paragraphs, cut):
            yield title, text, name, 1.0


def _shorten(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1].rstrip() + "…"


@functools.cache
def _cut_word() -> re.Pattern[str]:
    """A word, for cutting: a run without spaces, or two wide characters (Han, kana, hangul).

    Japanese or Chinese text has no spaces to count, and about two characters to a word. Wide is
    Unicode's East Asian width, computed once (this module stays free of brag for the worker).
    """
    wide = [c for c in range(0x3000, 0x10000) if unicodedata.east_asian_width(chr(c)) in "WF"]
    ranges, start = [], wide[0]
    for previous, current in itertools.pairwise([*wide, -1]):
        if current != previous + 1:
            ranges.append(re.escape(chr(start)) + "-" + re.escape(chr(previous)))
            start = current
    chars = "".join(ranges) + "\U00020000-\U0003fffd"
    return re.compile(f"[{chars}]{{1,2}}|[^\\s{chars}]+")


def _pack(paragraphs: Sequence[str], cut: Cut) -> Iterator[str]:
    """Whole paragraphs while they fit; a longer one cut into overlapping windows of words."""
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        words = [m.span() for m in _cut_word().finditer(paragraph)]
        if not words:
            continue
        if size and size + len(words) > cut.max_words:
            yield "\n".join(current)
            current, size = [], 0
        if len(words) <= cut.max_words:
            current.append(" ".join(paragraph.split()))
            size += len(words)
            continue
        step = max(1, cut.max_words - cut.overlap)
        for start in range(0, len(words), step):
            window = words[start : start + cut.max_words]
            yield " ".join(paragraph[window[0][0] : window[-1][1]].split())
            if start + cut.max_words >= len(words):
                break
    if current:
        yield "\n".join(current)


class _Headings:
    """The heading path above the text read so far, and the sections it opens."""

    MAX_CHARS = 120  # one heading's words in a title; a whole line could be a heading

    def __init__(self) -> None:
        self.path: list[tuple[int, str]] = []
        self.sections = [Section("", None, [])]

    def open(self, level: int, text: str) -> None:
        heading = _shorten(" ".join(text.split()), self.MAX_CHARS)
        self.path = [(lv, h) for lv, h in self.path if lv < level] + [(level, heading)]
        if len(self.sections) > 1 and not self.sections[-1].paragraphs:
            self.sections.pop()  # a heading with no text under it: no section to keep
        self.sections.append(Section(" › ".join(h for _, h in self.path), None, []))

    def add(self, paragraph: str) -> None:
        if paragraph.strip():
            self.sections[-1].paragraphs.append(paragraph)


# ------------------------------------------------------------------------------------------
# Text and Markdown: linear scanners
# ------------------------------------------------------------------------------------------


def _text(name: str, data: bytes) -> str:
    if b"\x00" in data[:8192]:
        raise DocumentError(f"{name}: a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n[ \t\r\f\v]*\n", text) if p.strip()]


def _plain_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    return [Section("", None, _paragraphs(_text(name, data)))]


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_LIST_MARK = re.compile(r" {0,3}(?:[-+*]|\d{1,9}[.)])(?:[ \t]+|$)")
_QUOTE_MARK = re.compile(r"(?: {0,3}> ?)+")
_SETEXT = re.compile(r" {0,3}(?:=+|-+)[ \t]*")
_THEMATIC_BREAK = re.compile(r" {0,3}(?:(?:-[ \t]*){3,}|(?:\*[ \t]*){3,}|(?:_[ \t]*){3,})")


def _markdown_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Paragraphs, list items and code under their heading path (``A › B``), line by line.

    ATX (``## x``) and setext (underlined) headings, fenced code kept as one paragraph, list
    and quote markers dropped; inline markup stays as written, as a reader sees it in the file.
    """
    headings = _Headings()
    paragraph: list[str] = []
    fence: str | None = None

    def flush() -> None:
        headings.add("\n".join(paragraph))
        paragraph.clear()

    for line in _text(name, data).splitlines():
        if fence is not None:  # inside fenced code: until a closing fence of the same kind
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
                flush()
            else:
                paragraph.append(line)
            continue
        if opening := _FENCE.match(line):
            flush()
            fence = opening.group(1)
            continue
        if not line.strip() or (not paragraph and _THEMATIC_BREAK.fullmatch(line)):
            flush()
            continue
        level, text = _atx_heading(line)
        if level:
            flush()
            headings.open(level, text)
        elif paragraph and _SETEXT.fullmatch(line):
            text = " ".join(paragraph)
            paragraph.clear()
            headings.open(1 if line.strip()[0] == "=" else 2, text)
        else:
            line = _QUOTE_MARK.sub("", line, count=1) if line.lstrip().startswith(">") else line
            if marker := _LIST_MARK.match(line):
                flush()
                line = line[marker.end() :]
            paragraph.append(line)
    flush()
    return headings.sections


def _atx_heading(line: str) -> tuple[int, str]:
    """``(level, text)`` of a ``#`` heading line, else ``(0, "")``; no regex, so no backtracking."""
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) > 3 or not stripped.startswith("#"):
        return 0, ""
    level = len(stripped) - len(stripped.lstrip("#"))
    rest = stripped[level:]
    if level > 6 or (rest and rest[0] not in " \t"):
        return 0, ""
    text = rest.strip()
    closed = text.rstrip("#")
    if not closed or closed[-1] in " \t":  # a closing run of #s, after a space, is not text
        text = closed.rstrip()
    return level, text


# A reStructuredText adornment: one punctuation character repeated, the line under (and maybe
# over) a title. Matched on a stripped line with fullmatch: no backtracking past the first.
_RST_ADORNMENT = re.compile(r"([!-/:-@\[-`{-~])\1+")


def _rst_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Paragraphs under their section path, titles found by their adornment, line by line.

    A title is a line underlined (and perhaps overlined) by one punctuation character at least
    as long as it; each style (character, and whether it has an overline) is the next level as
    it first appears, as in docutils. Explicit markup lines (``.. directive::``, comments,
    targets) are dropped, the text indented under them kept; inline markup stays as written.
    """
    headings = _Headings()
    styles: dict[tuple[str, bool], int] = {}
    paragraph: list[str] = []
    overline = ""  # the character of an adornment line read just before a title

    def flush(lines: list[str]) -> None:
        headings.add("\n".join(line.strip() for line in lines))
        lines.clear()

    for line in _text(name, data).splitlines():
        stripped = line.strip()
        if len(stripped) >= 2 and _RST_ADORNMENT.fullmatch(stripped):
            title = paragraph[-1].strip() if paragraph else ""
            if title and not paragraph[-1][:1].isspace() and len(stripped) >= min(len(title), 3):
                paragraph.pop()
                flush(paragraph)
                level = styles.setdefault((stripped[0], overline == stripped[0]), len(styles) + 1)
                headings.open(level, title)
                overline = ""
                continue
            if not paragraph:
                overline = stripped[0]  # an overline, or a transition
                continue
        if not stripped or stripped.startswith(".. ") or stripped == "..":
            flush(paragraph)
            overline = ""
            continue
        paragraph.append(line)
    flush(paragraph)
    return headings.sections


# ------------------------------------------------------------------------------------------
# HTML: nesting bounded before the parser, one walk over the tree
# ------------------------------------------------------------------------------------------

# Elements whose end a parser infers or that hold nothing: they never stay open deep.
_HTML_IMPLIED = frozenset(
    b"p li dt dd option optgroup tr td th thead tbody tfoot colgroup caption rb rt rp rtc "
    b"area base br col embed hr img input link meta source track wbr param keygen".split()
)
_HTML_RAW = frozenset(b"script style textarea title xmp iframe noembed noframes plaintext".split())
_HTML_TAG = re.compile(rb"<(/?)([A-Za-z][^\s/>]*)|<!--")
_HTML_SKIPPED = frozenset(("script", "style", "noscript", "template", "head"))
# Inline elements: their text belongs to the block around them. Every other element ends one.
_HTML_INLINE = frozenset(
    "a abbr b bdi bdo cite code data dfn em font i kbd mark q s samp small span strong sub sup "
    "time u var del ins label big tt nobr br wbr img".split()
)


def _html_depth(data: bytes, limit: int) -> int:
    """How deep elements nest, from the tags alone: a linear scan, before the parser sees the file.

    The parser's own cost grows with the depth of open elements times the tags (5 MB nested
    20,000 deep took it minutes), so a file nested past ``limit`` is refused here. Tags whose
    end is implied, empty ones, comments and raw text (script, style) are skipped, as a parser
    treats them; the scan stops once ``limit`` is passed.
    """
    stack: list[bytes] = []
    open_count: dict[bytes, int] = {}
    deepest = position = 0
    while found := _HTML_TAG.search(data, position):
        position = found.end()
        if found.group(0) == b"<!--":
            end = data.find(b"-->", position)
            position = len(data) if end < 0 else end + 3
            continue
        closing, tag = found.group(1), found.group(2).lower()
        if tag in _HTML_IMPLIED:
            continue
        if closing:
            if open_count.get(tag):
                while stack:  # each element is popped once: linear over the file
                    top = stack.pop()
                    open_count[top] -= 1
                    if top == tag:
                        break
        elif tag in _HTML_RAW:  # its text is not markup: skip to its end tag
            end = re.compile(rb"</" + re.escape(tag), re.IGNORECASE).search(data, position)
            position = len(data) if end is None else end.start()
        else:
            stack.append(tag)
            open_count[tag] = open_count.get(tag, 0) + 1
            deepest = max(deepest, len(stack))
            if deepest > limit:
                break
    return deepest


def _heading_level(tag: str) -> int:
    return int(tag[1]) if len(tag) == 2 and tag[0] == "h" and tag[1] in "123456" else 0


def _html_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Headings and the text of each block, in document order, in one walk over the tree."""
    from selectolax.lexbor import LexborHTMLParser

    if _html_depth(data, limits.html_depth) > limits.html_depth:
        raise TooLarge(f"{name}: HTML nested more than {limits.html_depth:,} elements deep")
    tree = LexborHTMLParser(_text(name, data))
    headings = _Headings()
    root = tree.body or tree.root
    if root is None:
        return headings.sections
    _walk_html(root, headings)
    return headings.sections


def _walk_html(root: Any, headings: _Headings) -> None:
    """Each text node joins the block it is in; a block's text is one paragraph, a heading opens a section.

    The walk keeps its own stack, so depth costs no recursion, and reads every text node once.
    """
    text: list[str] = []  # the current block's text so far
    heading: list[int] = []  # the level of the heading being read, if any

    def end_block() -> None:
        words = " ".join(" ".join(text).split())
        text.clear()
        if not words:
            return
        if heading:
            headings.open(heading[-1], words)
        else:
            headings.add(words)

    stack: list[tuple[Any, bool]] = [(root, False)]  # (node, its children are done)
    while stack:
        node, leaving = stack.pop()
        tag = node.tag or ""
        if leaving:
            end_block()
            if _heading_level(tag):
                heading.pop()
            continue
        if node.is_text_node:
            text.append(node.text_content or "")
            continue
        if not node.is_element_node or tag in _HTML_SKIPPED:
            continue
        block = tag not in _HTML_INLINE
        if block:
            end_block()
            if _heading_level(tag):
                heading.append(_heading_level(tag))
            stack.append((node, True))
        children = []
        child = node.child
        while child is not None:
            children.append(child)
            child = child.next
        stack.extend((c, False) for c in reversed(children))
    end_block()


# ------------------------------------------------------------------------------------------
# Word: the zip checked before anything inflates, the XML streamed with no DTD
# ------------------------------------------------------------------------------------------

_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_RELATIONSHIPS = "http://schemas.openxmlformats.org/package/2006/relationships"
_OFFICE_DOCUMENT = "/officeDocument"
_STYLES = "/styles"
_HEADING_STYLE = re.compile(r"heading\s*(\d)", re.IGNORECASE)
_SMALL_PART = 1_000_000  # a part this small cannot be a bomb, however well it packs


def _docx_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """Paragraphs under their heading path (Word's "Heading N" styles); a table row as one paragraph."""
    archive = _open_docx(name, data, limits)
    spent = [0]  # bytes inflated so far, against limits.unzipped_bytes
    document = _docx_target(
        name, archive, "_rels/.rels", _OFFICE_DOCUMENT, "word/document.xml", limits, spent
    )
    folder = str(PurePosixPath(document).parent)
    rels = f"{folder}/_rels/{PurePosixPath(document).name}.rels"
    styles_part = _docx_target(name, archive, rels, _STYLES, f"{folder}/styles.xml", limits, spent)
    styles = _docx_heading_styles(name, archive, styles_part, limits, spent)
    reader = _WordBody(styles)
    _stream_xml(name, archive, document, reader.handlers(), limits, spent, required=True)
    return reader.headings.sections


def _open_docx(name: str, data: bytes, limits: FileLimits) -> zipfile.ZipFile:
    """The zip, its entries counted and every part's ratio checked before anything is inflated."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as err:
        raise _unreadable_word(name, err) from None
    if len(entries) > limits.zip_entries:
        raise TooLarge(f"{name}: {len(entries):,} parts in its zip, at most {limits.zip_entries:,}")
    for entry in entries:
        packed = max(entry.compress_size, 1)
        if entry.file_size > _SMALL_PART and entry.file_size > limits.zip_ratio * packed:
            raise TooLarge(
                f"{name}: the part {entry.filename[:80]} inflates {entry.file_size / packed:,.0f} times "
                f"its packed size, at most {limits.zip_ratio} (a zip bomb?)"
            )
    return archive


def _read_part(
    name: str, archive: zipfile.ZipFile, part: str, limits: FileLimits, spent: list[int]
) -> Iterator[bytes]:
    """A part's bytes in chunks, its declared size checked first and its actual size counted."""
    try:
        entry = archive.getinfo(part)
    except KeyError:
        return
    too_large = TooLarge(f"{name}: its text parts unpack to more than {limits.unzipped_bytes:,} bytes")
    if spent[0] + entry.file_size > limits.unzipped_bytes:
        raise too_large
    try:
        stream = archive.open(entry)
    except (zipfile.BadZipFile, OSError, NotImplementedError, ValueError) as err:
        raise _unreadable_word(name, err) from None
    with stream:
        while True:
            try:
                chunk = stream.read(1 << 16)
            except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, ValueError) as err:
                raise _unreadable_word(name, err) from None
            if not chunk:
                return
            spent[0] += len(chunk)
            if spent[0] > limits.unzipped_bytes:  # zipfile stops at the declared size; counted anyway
                raise too_large
            yield chunk


def _unreadable_word(name: str, err: Exception) -> DocumentError:
    return DocumentError(f"{name}: not a readable Word (.docx) file ({type(err).__name__})")


def _stream_xml(
    name: str,
    archive: zipfile.ZipFile,
    part: str,
    handlers: dict[str, Callable[..., None]],
    limits: FileLimits,
    spent: list[int],
    required: bool = False,
) -> None:
    """Feed a part to expat with ``handlers``: no DTD, no entities, at most ``xml_elements`` elements."""
    from xml.parsers import expat

    parser = expat.ParserCreate(namespace_separator=" ")
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    elements = [0]
    start = handlers.get("start")

    def no_dtd(*_: Any) -> None:
        raise DocumentError(f"{name}: a Word part declares a DTD, which Word files never do")

    def counted_start(tag: str, attributes: dict[str, str]) -> None:
        elements[0] += 1
        if elements[0] > limits.xml_elements:
            raise TooLarge(f"{name}: more than {limits.xml_elements:,} XML elements")
        if start is not None:
            start(tag, attributes)

    parser.StartDoctypeDeclHandler = no_dtd
    parser.EntityDeclHandler = no_dtd
    parser.ExternalEntityRefHandler = no_dtd
    parser.StartElementHandler = counted_start
    if "end" in handlers:
        parser.EndElementHandler = handlers["end"]
    if "text" in handlers:
        parser.CharacterDataHandler = handlers["text"]
    parser.buffer_text = True
    seen = False
    try:
        for chunk in _read_part(name, archive, part, limits, spent):
            seen = True
            parser.Parse(chunk, False)
        if seen:
            parser.Parse(b"", True)
    except expat.ExpatError as err:
        raise DocumentError(f"{name}: not a readable Word (.docx) file (damaged XML: {err})") from None
    if required and not seen:
        raise DocumentError(f"{name}: not a readable Word (.docx) file (no {part} in it)")


def _docx_target(
    name: str,
    archive: zipfile.ZipFile,
    rels: str,
    kind: str,
    default: str,
    limits: FileLimits,
    spent: list[int],
) -> str:
    """The part a relationship of ``kind`` points to (the main document, its styles), else ``default``."""
    found: list[str] = []

    def start(tag: str, attributes: dict[str, str]) -> None:
        if tag == f"{_RELATIONSHIPS} Relationship" and attributes.get("Type", "").endswith(kind):
            found.append(attributes.get("Target", ""))

    _stream_xml(name, archive, rels, {"start": start}, limits, spent)
    if not found:
        return default
    # A target is relative to the folder the .rels folder describes, or absolute in the zip.
    base = PurePosixPath(rels).parent.parent
    target = found[0].lstrip("/") if found[0].startswith("/") else str(base / found[0])
    parts = [p for p in PurePosixPath(target).parts if p not in (".", "")]
    while ".." in parts:  # resolve within the zip; a path never leaves it (nothing is on disk anyway)
        i = parts.index("..")
        parts[max(0, i - 1) : i + 1] = []
    return "/".join(parts) or default


def _docx_heading_styles(
    name: str, archive: zipfile.ZipFile, part: str, limits: FileLimits, spent: list[int]
) -> dict[str, int]:
    """Paragraph style id -> heading level, for the styles named "heading N"."""
    levels: dict[str, int] = {}
    current: list[str] = []

    def start(tag: str, attributes: dict[str, str]) -> None:
        if tag == f"{_W} style":
            current[:] = [attributes.get(f"{_W} styleId", "")]
        elif tag == f"{_W} name" and current:
            match = _HEADING_STYLE.fullmatch(attributes.get(f"{_W} val", "").strip())
            if match and current[0]:
                levels[current[0]] = int(match.group(1))

    _stream_xml(name, archive, part, {"start": start}, limits, spent)
    return levels


class _WordBody:
    """The main document's paragraphs, read as expat streams them: a stack of open paragraphs.

    A paragraph is its runs' text (tabs and breaks as spaces); a heading style opens a section;
    a table row becomes one paragraph, its cells joined by `` | ``. Nothing is kept per element.
    """

    def __init__(self, styles: dict[str, int]) -> None:
        self.styles, self.headings = styles, _Headings()
        self.paragraphs: list[list[Any]] = []  # open paragraphs: [text parts, heading level]
        self.rows: list[list[str]] = []  # open table rows' cells
        self.cells: list[list[str]] = []  # open cells' paragraphs
        self.in_text = False

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"start": self.start, "end": self.end, "text": self.text}

    def start(self, tag: str, attributes: dict[str, str]) -> None:
        if not tag.startswith(_W):
            return
        local = tag[len(_W) + 1 :]
        if local == "p":
            self.paragraphs.append([[], 0])
        elif local == "pStyle" and self.paragraphs:
            self.paragraphs[-1][1] = self.styles.get(attributes.get(f"{_W} val", ""), 0)
        elif local == "t":
            self.in_text = True
        elif local in ("tab", "br", "cr") and self.paragraphs:
            self.paragraphs[-1][0].append(" ")
        elif local == "tr":
            self.rows.append([])
        elif local == "tc":
            self.cells.append([])

    def end(self, tag: str) -> None:
        if not tag.startswith(_W):
            return
        local = tag[len(_W) + 1 :]
        if local == "t":
            self.in_text = False
        elif local == "p" and self.paragraphs:
            parts, level = self.paragraphs.pop()
            text = " ".join("".join(parts).split())
            if self.cells:
                self.cells[-1].append(text)
            elif level and text:
                self.headings.open(level, text)
            else:
                self.headings.add(text)
        elif local == "tc" and self.cells:
            cell = " ".join(p for p in self.cells.pop() if p)
            if self.rows:
                self.rows[-1].append(cell)
        elif local == "tr" and self.rows:
            row = " | ".join(self.rows.pop())
            if self.cells:  # a table inside a cell: its rows belong to that cell
                self.cells[-1].append(row)
            elif row.strip(" |"):
                self.headings.add(row)

    def text(self, data: str) -> None:
        if self.in_text and self.paragraphs:
            self.paragraphs[-1][0].append(data)


# ------------------------------------------------------------------------------------------
# PDF: objects and pages first, then every page within the document's budget of parsing
# ------------------------------------------------------------------------------------------


@dataclass
class _PdfWork:
    """What the document being read may still parse: drawing operations and bytes of content."""

    operations: int
    content_bytes: int

    def spent(self) -> bool:
        return self.operations <= 0 or self.content_bytes <= 0


# The budget of the document being read in this context (None outside a read).
_PDF_WORK: contextvars.ContextVar[_PdfWork | None] = contextvars.ContextVar(
    "documents_pdf_work", default=None
)


def _pdf_sections(name: str, data: bytes, limits: FileLimits) -> list[Section]:
    """One section per page, its paragraphs split at blank lines."""
    from pypdf._configuration import CURRENT_CONFIGURATION, get_configuration

    _budget_pdf_parsing()
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a damaged file is our error, not a log line
    stream = min(limits.stream_bytes, 75_000_000)
    configuration = get_configuration().with_overwrites(
        maximum_declared_stream_length=len(data),
        zlib_maximum_output_length=stream,
        lzw_maximum_output_length=stream,
        run_length_maximum_output_length=stream,
        jbig2_maximum_output_length=stream,
        brotli_maximum_output_length=stream,
        array_based_stream_maximum_output_length=stream,
        image_maximum_buffer_size=stream,
    )
    configured = CURRENT_CONFIGURATION.set(configuration)
    work = _PdfWork(limits.pdf_operations, limits.pdf_content_bytes)
    budget = _PDF_WORK.set(work)
    try:
        return _pdf_pages(name, data, limits, work)
    finally:
        _PDF_WORK.reset(budget)
        CURRENT_CONFIGURATION.reset(configured)


def _pdf_pages(name: str, data: bytes, limits: FileLimits, work: _PdfWork) -> list[Section]:
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{name}: an encrypted PDF; save it without a password first")
        objects = sum(len(table) for table in reader.xref.values()) + len(reader.xref_objStm)
        if objects > limits.pdf_objects:
            raise TooLarge(f"{name}: {objects:,} objects, at most {limits.pdf_objects:,} per PDF")
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
            if work.spent():
                raise _too_much_work(name, limits, work) from None
            if type(err).__name__ == "LimitReachedError":  # one of pypdf's bounds, which we set
                raise TooLarge(
                    f"{name}: page {number} holds more than a page may ({str(err)[:120]})"
                ) from None
            raise DocumentError(f"{name}: page {number} cannot be read ({type(err).__name__})") from None
        if work.spent():  # pypdf may have caught the parser's error and carried on
            raise _too_much_work(name, limits, work)
        sections.append(Section("", number, _paragraphs(text)))
    return sections


def _too_much_work(name: str, limits: FileLimits, work: _PdfWork) -> TooLarge:
    what = (
        f"{limits.pdf_operations:,} drawing operations"
        if work.operations <= 0
        else f"{limits.pdf_content_bytes:,} bytes of page content"
    )
    return TooLarge(f"{name}: more than {what} in the document (a page drawn again counts again)")


_BUDGETED = False


def _budget_pdf_parsing() -> None:
    """Make pypdf's content-stream parser spend the document's budget (once per process).

    pypdf bounds the work of each content stream, and pages can share one: twenty pages that
    point at one stream of 600,000 operations cost twenty parses. While a document is read
    (``_PDF_WORK`` set), each parse may use only what the document has left, and what it read
    is taken off; outside a read the parser is unchanged.
    """
    global _BUDGETED
    if _BUDGETED:
        return
    from pypdf._configuration import CURRENT_CONFIGURATION, get_configuration
    from pypdf.generic import ContentStream

    parse = ContentStream._parse_content_stream

    def budgeted(self: Any, stream: Any) -> None:
        work = _PDF_WORK.get()
        if work is None:
            parse(self, stream)
            return
        work.content_bytes -= len(stream.getbuffer()) if isinstance(stream, io.BytesIO) else 0
        if work.spent():
            raise _PdfBudgetSpent
        default = get_configuration().stream_parsing_work_maximum_count
        # pypdf counts operands and operators as work; an operation is at least one of them.
        allowed = min(default, 2 * work.operations)
        token = CURRENT_CONFIGURATION.set(
            get_configuration().with_overwrites(stream_parsing_work_maximum_count=allowed)
        )
        try:
            parse(self, stream)
        except Exception:
            if allowed < default:  # the document's budget, not pypdf's own, ran out in this stream
                work.operations = 0
            raise
        finally:
            CURRENT_CONFIGURATION.reset(token)
            work.operations -= len(self._operations)

    ContentStream._parse_content_stream = budgeted
    _BUDGETED = True


class _PdfBudgetSpent(Exception):
    """The document's budget is spent; the page loop turns it into TooLarge."""


# ------------------------------------------------------------------------------------------
# Passage files
# ------------------------------------------------------------------------------------------


def _passage_items(name: str, data: bytes, limits: FileLimits) -> list[Any]:
    """A JSON list or JSON Lines of passages, as the app and ``brag index`` take them: not re-cut.

    Only parsed as JSON and counted here; :func:`content_rows` makes passages of the items.
    """
    text = _text(name, data)
    if name.lower().endswith(".jsonl"):
        text = "[" + ",".join(line for line in text.splitlines() if line.strip()) + "]"
    try:
        items = json.loads(text)
    except RecursionError:
        raise DocumentError(f"{name}: not a passage list (the JSON is nested too deeply)") from None
    except ValueError as err:
        raise DocumentError(f"{name}: not a passage list ({str(err)[:200]})") from None
    if not isinstance(items, list):
        raise DocumentError(
            f"{name}: not a passage list (expected a list of strings or of {{title, text}} objects, "
            f"got {type(items).__name__})"
        )
    if len(items) > limits.passages:
        raise _too_many_passages(name, len(items), limits)
    return items


# ------------------------------------------------------------------------------------------
# Archives, and a request's many files read one by one
# ------------------------------------------------------------------------------------------

# Archives whose members are read as if uploaded one by one.
ARCHIVE_SUFFIXES = (".zip",)
# Archives inside an archive: named, never expanded.
_NESTED_ARCHIVES = frozenset(
    ".zip .tar .gz .tgz .bz2 .xz .zst .7z .rar .jar .war .lz .lzma .z .cab .iso .tbz2 .txz".split()
)
# Zips made on a Mac carry these beside every file (resource forks, folder settings): not files.
_ZIP_NOISE = ("__MACOSX/", ".DS_Store", "Thumbs.db")


@dataclass(frozen=True)
class Unreadable:
    """A file (or an archive's member) that was not read, and why, as the caller is told."""

    name: str  # the file, or ``archive.zip/path/inside``, as shown
    reason: str  # why, in words (never a server path)
    too_large: bool = False  # past a limit (TooLarge)
    skipped: str = ""  # not tried: the type it is (``.png``, ``archive``), which BRAG does not read

    @classmethod
    def of(cls, name: str, err: DocumentError) -> Unreadable:
        """The failure ``err`` (whose message starts with the file's name) for the file ``name``."""
        message = str(err)
        reason = message[len(name) + 2 :] if message.startswith(f"{name}: ") else message
        return cls(name, reason[:500], isinstance(err, TooLarge))

    def error(self) -> DocumentError:
        """As the error it was."""
        return (TooLarge if self.too_large else DocumentError)(str(self))

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass(frozen=True)
class Member:
    """A file inside an archive that is to be read: its label, its entry and its declared size."""

    label: str  # archive.zip/path/inside, printable: what its passages are titled with
    index: int  # its entry in the archive's list
    size: int  # its unpacked size, as the archive declares it (checked again while inflating)
    suffix: str


@dataclass(frozen=True)
class Room:
    """What is left of a request's files once its plain files are counted: files, and bytes unpacked."""

    files: int
    bytes: int


def is_archive(name: str) -> bool:
    """Whether ``name`` is an archive whose members BRAG reads (a ``.zip``)."""
    return suffix_of(name) in ARCHIVE_SUFFIXES


class Archive:
    """A ``.zip`` whose members are read as files, listed and checked before any is inflated.

    Nothing is ever written: a member's name is only a label (printable, its path inside the
    archive). Bounded first by what the archive declares (entries, members to read against
    ``room.files``, their unpacked sizes against ``room.bytes``, each against ``file_bytes``,
    each one's compression ratio), then while inflating, by the bytes that come out.
    Directories and a Mac's ``__MACOSX`` forks are ignored; members of a type BRAG does not
    read, archives inside it, encrypted members, members packed by another method than deflate
    and names that are absolute or climb with ``..`` are listed in ``skipped`` with the reason.
    """

    def __init__(self, name: str, data: bytes, limits: FileLimits, room: Room) -> None:
        self.name, self.limits = display_name(name), limits
        self.zip = _open_zip(self.name, data, limits)
        self.entries = self.zip.infolist()
        self.members: list[Member] = []
        self.skipped: list[Unreadable] = []
        for index, entry in enumerate(self.entries):
            if entry.is_dir() or _is_zip_noise(entry.filename):
                continue
            label = f"{self.name}/{_member_path(entry.filename)}"
            problem = _member_problem(label, entry, limits)
            if problem is not None:
                self.skipped.append(problem)
            else:
                self.members.append(Member(label, index, entry.file_size, suffix_of(entry.filename)))
        if len(self.members) > room.files:
            raise TooLarge(
                f"{self.name}: {len(self.members):,} files to read in it, and the request may read at "
                f"most {max(room.files, 0):,} more"
            )
        declared = sum(m.size for m in self.members)
        if declared > room.bytes:
            raise TooLarge(
                f"{self.name}: its files unpack to {declared:,} bytes, and the request's files may hold "
                f"at most {max(room.bytes, 0):,} more"
            )
        self.bytes_left = room.bytes
        self._by_index = {m.index: m for m in self.members}

    def content(self, index: int, limits: FileLimits, cut: Cut) -> FileContent:
        """The member at entry ``index`` read as a file: its passages, titled with its label."""
        member = self._by_index.get(index)
        if member is None:
            raise DocumentError(f"{self.name}: no file to read at entry {index}")
        return _content(member.label, member.suffix, self._inflate(member), limits, cut)

    def _inflate(self, member: Member) -> bytes:
        """The member's bytes, counted as they come out: never more than it declared, nor a bomb's."""
        entry = self.entries[member.index]
        packed, out = max(entry.compress_size, 1), bytearray()
        try:
            with self.zip.open(entry) as stream:
                while chunk := stream.read(1 << 16):
                    out += chunk
                    self.bytes_left -= len(chunk)
                    if len(out) > min(member.size, self.limits.file_bytes) or self.bytes_left < 0:
                        raise TooLarge(f"{member.label}: unpacks to more than its archive declares")
                    if len(out) > _SMALL_PART and len(out) > self.limits.zip_ratio * packed:
                        raise _bomb(member.label, len(out) / packed, self.limits)
        except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, RuntimeError, ValueError) as err:
            raise DocumentError(f"{member.label}: could not be unpacked ({type(err).__name__})") from None
        except zlib.error:
            raise DocumentError(f"{member.label}: could not be unpacked (damaged data)") from None
        return bytes(out)


def _open_zip(name: str, data: bytes, limits: FileLimits) -> zipfile.ZipFile:
    """The zip, its declared entries counted before zipfile lists them."""
    declared = _declared_entries(data)
    if declared is not None and declared > limits.zip_entries:
        raise TooLarge(f"{name}: {declared:,} entries in the archive, at most {limits.zip_entries:,}")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as err:
        raise DocumentError(f"{name}: not a readable .zip archive ({type(err).__name__})") from None
    if len(entries) > limits.zip_entries:
        raise TooLarge(f"{name}: {len(entries):,} entries in the archive, at most {limits.zip_entries:,}")
    return archive


def _declared_entries(data: bytes) -> int | None:
    """How many entries a zip's end record declares (zip64's too); None when there is none to read."""
    tail = data[-(22 + 65_535) :]
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    entries = int.from_bytes(tail[at + 10 : at + 12], "little")
    if entries != 0xFFFF:
        return entries
    locator = tail.rfind(b"PK\x06\x07", 0, at)  # zip64: the count is in its own end record
    if locator < 0 or at - locator < 20:
        return None
    offset = int.from_bytes(tail[locator + 8 : locator + 16], "little")
    record = data[offset : offset + 56]
    return int.from_bytes(record[32:40], "little") if record[:4] == b"PK\x06\x06" else None


def _is_zip_noise(raw: str) -> bool:
    last = raw.rstrip("/").rsplit("/", 1)[-1]
    return raw.startswith(_ZIP_NOISE[0]) or last in _ZIP_NOISE[1:] or last.startswith("._")


def _member_path(raw: str) -> str:
    """A member's path inside its archive, as a label: printable, ``/`` between its parts."""
    parts = [p for p in re.split(r"[/\\]", raw) if p not in ("", ".")]
    return _printable("/".join(parts), 250) or "(no name)"


def _member_problem(label: str, entry: zipfile.ZipInfo, limits: FileLimits) -> Unreadable | None:
    """Why a member is not read (checked on what the archive declares, before it inflates), or None."""
    raw, suffix = entry.filename, suffix_of(entry.filename)
    parts = re.split(r"[/\\]", raw)
    if raw.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", raw) or ".." in parts:
        return Unreadable(label, "its name is an absolute path or climbs out of the archive ('..'): not read")
    if suffix in _NESTED_ARCHIVES:
        return Unreadable(
            label, "an archive (or compressed file) inside the archive: not expanded", skipped="archive"
        )
    if suffix not in SUFFIXES:
        kind = suffix or "(none)"
        return Unreadable(label, f"not a type BRAG reads ({suffix or 'no suffix'})", skipped=kind)
    if entry.flag_bits & 0x1:
        return Unreadable(label, "encrypted: zip it again without a password")
    if entry.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return Unreadable(label, "packed by a method BRAG does not unpack (only stored or deflated)")
    if entry.file_size > limits.file_bytes:
        message = f"{entry.file_size:,} bytes unpacked, at most {limits.file_bytes:,} per file"
        return Unreadable(label, message, too_large=True)
    packed = max(entry.compress_size, 1)
    if entry.file_size > _SMALL_PART and entry.file_size > limits.zip_ratio * packed:
        return Unreadable.of(label, _bomb(label, entry.file_size / packed, limits))
    return None


def _bomb(label: str, ratio: float, limits: FileLimits) -> TooLarge:
    return TooLarge(
        f"{label}: inflates {ratio:,.0f} times its packed size, at most {limits.zip_ratio} (a zip bomb?)"
    )


@dataclass
class Reading:
    """What a request's files gave: the passages' rows, the files read, and those not read, with why."""

    rows: list[Row]
    read: list[str]  # each file (or archive member) read, by label
    failed: list[Unreadable]

    def summary(self, listed: int = 50) -> dict[str, Any]:
        """For a report: counts, the first ``listed`` files not read with the reason, skipped types."""
        tried = [f for f in self.failed if f.skipped in ("", "archive")]
        types: dict[str, int] = {}
        for failure in self.failed:
            if failure.skipped not in ("", "archive"):
                types[failure.skipped] = types.get(failure.skipped, 0) + 1
        return {
            "read": len(self.read),
            "passages": len(self.rows),
            "not_read": [{"file": f.name, "reason": f.reason} for f in tried[:listed]],
            "not_read_count": len(tried),
            "skipped_types": dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0]))[:20]),
            "skipped_count": sum(types.values()),
        }


class Source:
    """What :func:`read_all` reads with: here, in this process; the app's is the capped worker's."""

    def __init__(self, cut: Cut = Cut()) -> None:
        self.cut = cut
        self.archives: dict[int, Archive] = {}

    def file(self, name: str, data: bytes, limits: FileLimits) -> list[Row]:
        """A plain file's rows."""
        return file_rows(name, data, limits, self.cut)

    def archive(
        self, key: int, name: str, data: bytes, limits: FileLimits, room: Room
    ) -> tuple[list[Member], list[Unreadable]]:
        """Open the ``key``-th file, an archive: its members to read, and those skipped."""
        self.archives[key] = archive = Archive(name, data, limits, room)
        return archive.members, archive.skipped

    def member(self, key: int, member: Member, limits: FileLimits) -> list[Row]:
        """A member's rows, from the archive opened as ``key``."""
        return content_rows(self.archives[key].content(member.index, limits, self.cut), limits)


@dataclass(frozen=True)
class _Unit:
    label: str
    name: str = ""  # a plain file: its name and bytes
    data: bytes = b""
    key: int = -1  # an archive's member: the archive, and which
    member: Member | None = None


def read_all(
    files: Sequence[tuple[str, bytes]],
    limits: FileLimits,
    source: Source,
    *,
    strict: bool = False,
    on_file: Callable[[int, int, str], None] | None = None,
) -> Reading:
    """Every file, an archive's members as files of their own, read by ``source``, one at a time.

    A file that cannot be read is named in ``failed`` and the others are read (with ``strict``,
    the first one raises instead); a bound on all of them together (:class:`RequestTooLarge`)
    and a stopped request (:class:`RequestStopped`) end it. ``on_file(number, total, label)``
    is called before each file is read.
    """
    check_request(files, limits)
    units, failed = _plan(files, limits, source, strict)
    budget = TextBudget(limits.text_chars)
    reading = Reading([], [], failed)
    for number, unit in enumerate(units, 1):
        if on_file is not None:
            on_file(number, len(units), unit.label)
        left = replace(limits, passages=limits.passages - len(reading.rows))
        try:
            if unit.member is None:
                rows = source.file(unit.name, unit.data, left)
            else:
                rows = source.member(unit.key, unit.member, left)
            reading.rows.extend(budget.spend(unit.label, rows))
        except RequestStopped:
            raise
        except DocumentError as err:
            if strict:
                raise
            reading.failed.append(Unreadable.of(unit.label, err))
            continue
        reading.read.append(unit.label)
    return reading


def _plan(
    files: Sequence[tuple[str, bytes]], limits: FileLimits, source: Source, strict: bool
) -> tuple[list[_Unit], list[Unreadable]]:
    """The files to read in order, each archive opened and its members in its place; what is skipped."""
    plain = [(name, data) for name, data in files if not is_archive(name)]
    room = Room(limits.files - len(plain), limits.total_bytes - sum(len(data) for _, data in plain))
    units: list[_Unit] = []
    failed: list[Unreadable] = []
    for key, (name, data) in enumerate(files):
        if not is_archive(name):
            units.append(_Unit(display_name(name), name=name, data=data))
            continue
        try:
            members, skipped = source.archive(key, name, data, limits, room)
        except RequestStopped:
            raise
        except DocumentError as err:
            if strict:
                raise
            failed.append(Unreadable.of(display_name(name), err))
            continue
        if strict and (bad := next((s for s in skipped if not s.skipped), None)) is not None:
            raise bad.error()
        failed += skipped
        units += [_Unit(m.label, key=key, member=m) for m in members]
        room = Room(room.files - len(members), room.bytes - sum(m.size for m in members))
    return units, failed


def read_tree(
    files: Iterable[tuple[str, bytes]],
    limits: FileLimits = FileLimits(),
    cut: Cut = Cut(),
    on_file: Callable[[int, int, str], None] | None = None,
) -> Reading:
    """Files and archives read in this process as the app reads an upload (:func:`read_all`).

    Each file that cannot be read is named with its reason, and the others are read.
    """
    return read_all(list(files), limits, Source(cut), on_file=on_file)


# One reader per document type, by suffix (a file's bytes to its sections): a type BRAG reads is
# a reader and its entry here; the app's file input, the command line and the checks take it.
READERS: dict[str, Callable[[str, bytes, FileLimits], list[Section]]] = {
    ".txt": _plain_sections,
    ".md": _markdown_sections,
    ".markdown": _markdown_sections,
    ".rst": _rst_sections,
    ".pdf": _pdf_sections,
    ".docx": _docx_sections,
    ".html": _html_sections,
    ".htm": _html_sections,
}
# Every file BRAG reads: documents, then passage files.
SUFFIXES = (*READERS, *PASSAGE_SUFFIXES)
# Every file an upload may be: those, and archives of them.
UPLOAD_SUFFIXES = (*SUFFIXES, *ARCHIVE_SUFFIXES)
