"""Real PDF, Word, Markdown and HTML files, made here (fpdf2, python-docx) for the tests and bench."""

from __future__ import annotations

import io

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
