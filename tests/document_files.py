"""Real PDF, Word, Markdown and HTML files, made here (fpdf2, python-docx) for the tests and bench."""

from __future__ import annotations

import io
import zipfile

import docx
from fpdf import FPDF
from fpdf.enums import EncryptionMethod


def pdf_bytes(pages: list[str], password: str | None = None) -> bytes:
    """A PDF with one page per text (blank lines separate its paragraphs)."""
    pdf = FPDF()
    pdf.set_auto_page_break(False)
    for text in pages:
        pdf.add_page()
        pdf.set_font("helvetica", size=11)
        for paragraph in text.split("\n\n"):
            pdf.multi_cell(0, 6, paragraph)
            pdf.ln(6)
    if password:
        pdf.set_encryption(
            owner_password="owner", user_password=password, encryption_method=EncryptionMethod.RC4
        )
    return bytes(pdf.output())


def docx_bytes(blocks: list[tuple[int, str]]) -> bytes:
    """A Word file: ``(level, text)`` blocks, level 0 a paragraph and 1-3 a heading."""
    document = docx.Document()
    for level, text in blocks:
        if level:
            document.add_heading(text, level)
        else:
            document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def raw_pdf(pages: int, content: bytes, *, shared: bool = True) -> bytes:
    """A hand-written PDF whose ``pages`` pages draw ``content`` (zlib-packed): one stream shared
    by every page (``shared``), as a crafted file can, or a copy per page."""
    import zlib

    packed = zlib.compress(content, 9)
    streams = 1 if shared else pages
    first_page = 3 + streams
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids ["
        + b" ".join(b"%d 0 R" % (first_page + i) for i in range(pages))
        + b"] /Count %d >>" % pages,
        *[b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream"]
        * streams,
        *[
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
            b"/Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>"
            % (3 + (0 if shared else i))
            for i in range(pages)
        ],
    ]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.writelines(b"%010d 00000 n \n" % offset for offset in offsets)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def docx_with_body(body: bytes, prolog: bytes = b"") -> bytes:
    """A real Word file (python-docx's) whose document.xml body is ``body``, after ``prolog``
    (a DOCTYPE, say) in place of the XML declaration: for files crafted to hurt a reader."""
    source = zipfile.ZipFile(io.BytesIO(docx_bytes([(0, "x")])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as crafted:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename == "word/document.xml":
                start = data.index(b"<w:document")
                head = data[start : data.index(b"<w:body>") + len(b"<w:body>")]
                data = (prolog or data[:start]) + head + body + b"</w:body></w:document>"
            crafted.writestr(info.filename, data)
    return out.getvalue()


def zip_bytes(members: list[tuple[str, bytes]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A .zip of ``(path inside, bytes)`` members; a path ending in ``/`` is a folder entry."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as archive:
        for name, data in members:
            archive.writestr(zipfile.ZipInfo(name) if name.endswith("/") else name, data)
    return out.getvalue()


def with_declared_size(data: bytes, size: int) -> bytes:
    """A one-member zip whose headers declare ``size`` unpacked bytes, whatever its data inflates to."""
    patched = bytearray(data)
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = patched.find(signature)
        patched[at + offset : at + offset + 4] = size.to_bytes(4, "little")
    return bytes(patched)


def html_page(number: int, fact: str = "") -> bytes:
    """A small manual page, real HTML: a title, a heading and a paragraph or two."""
    body = f"<p>{fact}</p>" if fact else ""
    return (
        f"<!DOCTYPE html><html><head><title>Page {number}</title><style>p {{}}</style></head><body>"
        f"<h1>Chapter {number}</h1><h2>Section {number}.1</h2><p>Option {number} sets the size of "
        f"buffer {number} in the tool; its default is {number * 4} kilobytes.</p>{body}</body></html>"
    ).encode()
