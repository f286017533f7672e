"""Documents in: extraction and ingestion speed, and retrieval on passages the splitter cut.

- **Speed.** A 100-page PDF and a Word file of 100 sections (made here with fpdf2 and
  python-docx), and 1,000 Markdown files: each read, cut and indexed in a fresh process, with
  pages (or files) per second, passages per second and that process's peak RSS; then the same
  files read as the app reads an upload, in a capped worker process (``bragkit/serving/parse_worker.py``,
  its start included), in the same run.
- **Retrieval.** The HotpotQA corpus rebuilt as documents, one per title, cut by
  ``documents.rows_of`` at several sizes; recall@5 of the supporting paragraphs on the
  benchmark's 200 test questions against the original paragraphs, in the same run. A supporting
  paragraph counts as found when a retrieved passage of its document holds at least half of its
  words (the original passages hold all of them).

    python bench/documents.py [--out bench/results/documents.md]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from harness import data_dir_or_exit, peak_rss_mb

import brag
from bragkit import documents

LOREM = (
    "The river runs north past the old mill and the stone bridge, where the town keeps its market "
    "on Thursdays and the ferry leaves at noon for the islands beyond the bay."
)
SIZES = (100, 150, 200)


def make_files(kind: str) -> list[tuple[str, bytes]]:
    from document_files import docx_bytes, pdf_bytes

    if kind == "pdf":
        pages = [f"Page {n}. {LOREM}\n\n{LOREM} {LOREM}\n\n{LOREM}" for n in range(1, 101)]
        return [("report.pdf", pdf_bytes(pages))]
    if kind == "docx":
        blocks = [b for n in range(100) for b in ((1, f"Section {n}"), (0, LOREM * 2), (0, LOREM))]
        return [("notes.docx", docx_bytes(blocks))]
    return [
        (f"note{n}.md", f"# Note {n}\n\n{LOREM}\n\n## Detail\n\n- {LOREM}\n- item {n}\n".encode())
        for n in range(1000)
    ]


def ingest(kind: str, isolated: bool, queue: Any) -> None:
    """In a fresh process: read (in a worker when ``isolated``), cut and index ``kind``'s files."""
    from bragkit.serving import parse_worker

    files = make_files(kind)
    units = len(files) if kind == "md" else 100  # pages, or sections
    started = time.perf_counter()
    limits = documents.FileLimits(files=len(files), total_bytes=1 << 40, text_chars=1 << 40)
    if isolated:
        passages = documents.as_passages(parse_worker.FileReaders().read(files, limits))
    else:
        passages = documents.read_files(files, limits)
    read = time.perf_counter() - started
    brag.Corpus(passages)
    total = time.perf_counter() - started
    rss_mb = peak_rss_mb()
    queue.put((kind, isolated, units, len(passages), read, total, rss_mb, sum(len(d) for _, d in files)))


def speed() -> list[tuple[Any, ...]]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for isolated in (False, True):
        for kind in ("pdf", "docx", "md"):
            queue = context.Queue()
            process = context.Process(target=ingest, args=(kind, isolated, queue))
            process.start()
            rows.append(queue.get(timeout=600))
            process.join()
    return rows


def recall(root: Path) -> tuple[dict[str, float], dict[str, int], int]:
    """recall@5 of supporting paragraphs: the original passages, and cut at each size."""
    corpus_items = json.loads((root / "hotpotqa/hotpotqa_ircot500_corpus.json").read_text(encoding="utf-8"))
    questions = json.loads((root / "hotpotqa/hotpotqa_ircot500.json").read_text(encoding="utf-8"))[60:260]
    text_of = {item["title"]: item["text"] for item in corpus_items}
    corpora = {"original paragraphs": brag.Corpus(corpus_items)}
    counts = {"original paragraphs": len(corpus_items)}
    for size in SIZES:
        cut = documents.Cut(max_words=size, overlap=min(30, size // 5))
        passages = documents.as_passages(
            row
            for title, text in text_of.items()
            for row in documents.rows_of(title, [documents.Section("", None, [text])], cut)
        )
        corpora[f"cut at {size} words"] = brag.Corpus(passages)
        counts[f"cut at {size} words"] = len(passages)
    found = dict.fromkeys(corpora, 0)
    wanted = 0
    for q in questions:
        supporting = [p["title"] for p in q["paragraphs"] if p.get("is_supporting") and p["title"] in text_of]
        wanted += len(supporting)
        for name, corpus in corpora.items():
            hits = [corpus[i] for i, _ in corpus.retrieve(q["question"], 5).hits]
            for title in supporting:
                words = set(text_of[title].split())
                if any(h.title == title and len(words & set(h.text.split())) >= len(words) / 2 for h in hits):
                    found[name] += 1
    return {name: found[name] / wanted for name in corpora}, counts, wanted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "documents.md")
    args = parser.parse_args()
    root = data_dir_or_exit("documents")
    lines = [
        "# Documents: extraction, ingestion and retrieval on cut passages",
        "",
        "Command: `python bench/documents.py`",
        f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}",
        "",
        "## Speed (each in a fresh process; the peak RSS is that process's, not its worker's)",
        "",
        "| input | size | units | passages | read + cut s | + index s | units / s | passages / s "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"pdf": "100-page PDF", "docx": "Word file, 100 sections", "md": "1,000 Markdown files"}
    unit = {"pdf": "pages", "docx": "sections", "md": "files"}
    for kind, isolated, units, passages, read, total, rss, size in speed():
        name = names[kind] + (", in the parse worker" if isolated else "")
        lines.append(
            f"| {name} | {size / 1e6:.2f} MB | {units} {unit[kind]} | {passages} | {read:.2f} | "
            f"{total:.2f} | {units / read:.0f} | {passages / total:.0f} | {rss:.0f} |"
        )
    found, counts, wanted = recall(root)
    lines += [
        "",
        f"## Retrieval: recall@5 of the {wanted} supporting paragraphs of HotpotQA's 200 test questions",
        "",
        "| passages | count | recall@5 | Δ vs original |",
        "|---|---|---|---|",
    ]
    base = found["original paragraphs"]
    for name, value in found.items():
        lines.append(f"| {name} | {counts[name]:,} | {value:.3f} | {value - base:+.3f} |")
    default = documents.Cut()
    lines += [
        "",
        f"The default cut is {default.max_words} words with a {default.overlap}-word overlap: within "
        f"{base - found[f'cut at {default.max_words} words']:.3f} of the original (target: 0.02), where "
        "100 words loses more and 200 gains nothing but longer prompts.",
        "",
        " ".join(__doc__.split("\n\n")[1].split()),
        "",
    ]
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
