"""Check the labelled document sets: gold answers on their pages, unanswerable key terms nowhere.

For every set in ``bench/docs/sets.json`` and ``bench/docs/sets_more.json``, the fetched
documents are read as the app reads an upload (``bragkit.documents.read_file``, as
``bench/selftest.py``'s ``corpus_of`` does). Then:

- every answerable question (the set's ``questions`` file) has at least one gold string in
  the text of its page;
- every unanswerable question (``<set>_unanswerable.json``, when there is one) has none of its
  key terms anywhere in the set's text.

Texts are compared after Unicode NFKC, case folding and whitespace collapsing. One line per
failure, a summary per set; exit status 1 on any failure.

    python bench/check_sets.py --docs DIR [--fetch] [--set NAME]
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import documents_parser

from bragkit import documents

DOCS = ROOT / "bench" / "docs"
SET_FILES = (DOCS / "sets.json", DOCS / "sets_more.json")
PDF_PAGE = re.compile(r", p\. (\d+)$")


def all_sets() -> list[dict[str, Any]]:
    """The entries of every sets file that exists, in order."""
    entries: list[dict[str, Any]] = []
    for path in SET_FILES:
        if path.is_file():
            entries += json.loads(path.read_text(encoding="utf-8"))["sets"]
    return entries


def local_name(name: str) -> str:
    """A packaged file's name once fetched: a gzipped one is unpacked."""
    return Path(name).name.removesuffix(".gz")


def normalise(text: str) -> str:
    """NFKC, case-folded, every run of whitespace one space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def fetched(entry: dict[str, Any], docs: Path) -> bool:
    return all((docs / entry["name"] / local_name(f)).is_file() for f in entry["files"])


def fetch(entry: dict[str, Any], docs: Path) -> None:
    """The set's Debian package at its version, unpacked; its files copied to DIR/<set>/."""
    target = docs / entry["name"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", f"{entry['package']}={entry['version']}"], cwd=tmp, check=True)
        deb = next(Path(tmp).glob("*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), "out"], cwd=tmp, check=True)
        target.mkdir(parents=True, exist_ok=True)
        for name in entry["files"]:
            data = (Path(tmp) / "out" / name).read_bytes()
            (target / local_name(name)).write_bytes(gzip.decompress(data) if name.endswith(".gz") else data)


def page_texts(entry: dict[str, Any], docs: Path) -> dict[str | int, str]:
    """Normalised text by fetched file name and, for a PDF, by page number too.

    A PDF's passages are titled ``name.pdf, p. N``; a question's ``page`` may be that N (as the
    bash set's are), which names the page of the set's PDF.
    """
    parts: dict[str | int, list[str]] = {}
    for name in entry["files"]:
        path = docs / entry["name"] / local_name(name)
        for p in documents.read_file(path.name, path.read_bytes()):
            passage = f"{p.title}\n{p.text}"
            parts.setdefault(path.name, []).append(passage)
            page = PDF_PAGE.search(p.title) if path.suffix.lower() == ".pdf" else None
            if page:
                parts.setdefault(int(page.group(1)), []).append(passage)
    return {key: normalise("\n".join(texts)) for key, texts in parts.items()}


def load(name: str) -> list[dict[str, Any]]:
    path = DOCS / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def check(entry: dict[str, Any], docs: Path) -> list[str]:
    """The set's failures, one line each; its summary is printed."""
    name = entry["name"]
    texts = page_texts(entry, docs)
    whole = "\n".join(text for key, text in texts.items() if isinstance(key, str))
    failures: list[str] = []
    answerable = load(entry["questions"])
    for q in answerable:
        page = texts.get(q["page"])
        if page is None:
            failures.append(f"{name} {q['id']}: page {q['page']!r} is not one of the set's files")
        elif not q["answer"]:
            failures.append(f"{name} {q['id']}: no gold answer")
        elif not any(normalise(a) in page for a in q["answer"]):
            failures.append(f"{name} {q['id']}: no gold {q['answer']!r} in {q['page']}")
    unanswerable = load(f"{name}_unanswerable.json")
    for q in unanswerable:
        terms = q.get("key_terms") or []
        if q.get("answer") or not terms:
            failures.append(f"{name} {q['id']}: an unanswerable question needs an empty answer and key terms")
        found = [t for t in terms if normalise(t) in whole]
        if found:
            failures.append(f"{name} {q['id']}: key terms {found!r} are in the set's text")
    size = len(whole.encode("utf-8"))
    print(
        f"{name}: {len(answerable)} answerable, {len(unanswerable)} unanswerable, "
        f"{size:,} bytes of text; {len(failures)} failures"
    )
    return failures


def main() -> int:
    parser = documents_parser(__doc__)
    parser.add_argument("--fetch", action="store_true", help="apt-get download any set missing from DIR")
    parser.add_argument("--set", help="check only this set")
    args = parser.parse_args()
    failures: list[str] = []
    for entry in all_sets():
        if args.set and entry["name"] != args.set:
            continue
        if not fetched(entry, args.docs):
            if not args.fetch:
                failures.append(f"{entry['name']}: not fetched to {args.docs} (use --fetch)")
                print(failures[-1])
                continue
            fetch(entry, args.docs)
        lines = check(entry, args.docs)
        for line in lines:
            print(line)
        failures += lines
    print(f"{'FAIL' if failures else 'OK'}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
