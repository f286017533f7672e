"""A real documentation tree uploaded to the app, as files and as one .zip: what is read, and how fast.

Each tree (``--tree DIR``, a folder on this machine: nothing is downloaded) is sent through the
app's own path for an upload, without HTTP: the files copied into an upload folder and taken by
``serving.inputs.read_uploads`` (the request's file count and sizes), read one by one in the
capped parse worker (``documents_from_files``, the app's ``Limits``: the defaults, or the
environment's ``BRAG_*`` settings), then indexed as ``/brag`` indexes them. It does so twice: the
files a browser's file picker offers (the types the file input accepts), then the whole tree
zipped in memory (deflated) as one upload. For each it reports the files and bytes, the seconds
to read and to index, the passages, and each file not read with why (or the refusal of the
request). With ``--ask`` it answers the questions over the tree with the embedded model
(``local``: it runs the LLM, minutes of CPU).

    python bench/tree_upload.py --tree /tmp/tree_sphinx-doc --tree /tmp/tree_git
    python bench/tree_upload.py --tree DIR --ask "How do I make a table of contents?"

A Debian package's tree makes a real one: ``apt-get download sphinx-doc && dpkg-deb -x
sphinx-doc_*.deb /tmp/tree_sphinx-doc``.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shlex
import shutil
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import brag
from bragkit import documents
from bragkit.serving import inputs, parse_worker
from bragkit.serving.limits import Limits, RequestRefused

OUT = ROOT / "bench" / "results" / "tree_upload.md"


def tree_files(tree: Path) -> list[Path]:
    """The tree's regular files, in order; links (to files or folders) are not followed."""
    found = []
    for folder, subfolders, names in os.walk(tree):
        subfolders.sort()
        for name in sorted(names):
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return found


def zipped(tree: Path, files: list[Path]) -> bytes:
    """The tree as one .zip, its paths relative to the tree, deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, path.relative_to(tree).as_posix())
    return out.getvalue()


def upload(files: list[tuple[str, bytes]], limits: Limits) -> dict[str, Any]:
    """One upload through the app's path: read_uploads, the capped worker, the index."""
    folder = Path(tempfile.mkdtemp(prefix="brag-tree-upload-"))
    try:
        paths = []
        for number, (name, data) in enumerate(files):
            (folder / str(number)).mkdir()
            (folder / str(number) / name).write_bytes(data)
            paths.append(str(folder / str(number) / name))
        started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        given, not_read = inputs.read_uploads(paths, limits, folder=folder)
        readers = parse_worker.FileReaders(limits.parse_caps())
        passages, reading = inputs.documents_from_files(given, limits, readers, not_read=not_read)
        read_s = time.perf_counter() - started
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        worker_cpu = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        started = time.perf_counter()
        documents.read_tree(given, limits.file_limits())  # the same reading in this process, uncapped
        here_s = time.perf_counter() - started
        started = time.perf_counter()
        corpus = brag.Corpus(passages)
        index_s = time.perf_counter() - started
    except RequestRefused as err:
        return {"refused": str(err)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = reading.summary(listed=1_000)
    chars = sum(len(title) + len(text) for title, text, _, _ in reading.rows)
    return {
        "summary": summary,
        "read_s": read_s,
        "worker_cpu_s": worker_cpu,
        "here_s": here_s,
        "index_s": index_s,
        "corpus": corpus,
        "chars": chars,
    }


def measure(tree: Path, limits: Limits) -> dict[str, Any]:
    """The tree as the files a file picker offers, and as one .zip."""
    files = tree_files(tree)
    offered = [p for p in files if documents.suffix_of(p.name) in documents.UPLOAD_SUFFIXES]
    kinds = Counter(documents.suffix_of(p.name) or "(none)" for p in files)
    readable = [p for p in files if documents.suffix_of(p.name) in documents.SUFFIXES]
    archive = zipped(tree, files)
    return {
        "tree": tree,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "readable": len(readable),
        "readable_bytes": sum(p.stat().st_size for p in readable),
        "kinds": kinds,
        "zip_bytes": len(archive),
        "as files": upload([(p.name, p.read_bytes()) for p in offered], limits),
        "as a zip": upload([(f"{tree.name}.zip", archive)], limits),
    }


def ask(result: dict[str, Any], questions: list[str]) -> list[str]:
    """Each question answered over the tree (as a zip, else as files) by the embedded model."""
    from bragkit import llms

    corpus = (result["as a zip"].get("corpus")) or result["as files"].get("corpus")
    if corpus is None or not questions:
        return []
    llm = llms.make_llm(llms.parse_model("local"))
    controller = brag.BRAG(llm)  # the fit for a caller's documents, as /brag uses it
    lines = ["", "| question | answer | source | P(correct) | LLM calls | s |", "|---|---|---|---|---|---|"]
    for question in questions:
        started = time.perf_counter()
        answer, report = controller.run(question, corpus)
        source = (report.get("confidence") or {}).get("source") or {}
        seconds = time.perf_counter() - started
        lines.append(
            f"| {question} | {answer or '(none)'} | {source.get('passage', '')} | "
            f"{1 - report['p_err']:.0%} | {report['totals']['llm_calls']} | {seconds:.1f} |"
        )
    return lines


def section(result: dict[str, Any], limits: Limits) -> list[str]:
    """One tree's figures as markdown."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in result["kinds"].most_common(8))
    lines = [
        f"## `{result['tree']}`",
        "",
        f"{result['files']:,} files, {result['bytes']:,} bytes ({kinds}); {result['readable']:,} of a type "
        f"BRAG reads ({result['readable_bytes']:,} bytes); zipped: {result['zip_bytes']:,} bytes.",
        "",
        "| upload | files read | not read | skipped (type) | passages | text chars | read s | worker CPU s "
        "| in-process s | index s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for how in ("as files", "as a zip"):
        got = result[how]
        if "refused" in got:
            lines.append(f"| {how} | refused | | | | | | | | |")
            notes.append(f"- {how}: refused: {got['refused']}")
            continue
        s = got["summary"]
        counts = (s["read"], s["not_read_count"], s["skipped_count"], s["passages"], got["chars"])
        seconds = (got["read_s"], got["worker_cpu_s"], got["here_s"], got["index_s"])
        lines.append(
            f"| {how} | {' | '.join(f'{n:,}' for n in counts)} | {' | '.join(f'{t:.2f}' for t in seconds)} |"
        )
        for failure in s["not_read"][:20]:
            notes.append(f"- {how}: not read: {failure['file']}: {failure['reason']}")
        if s["skipped_types"]:
            skipped = ", ".join(f"{k} {v}" for k, v in s["skipped_types"].items())
            notes.append(f"- {how}: skipped, of types BRAG does not read: {skipped}")
    return [*lines, "", *notes, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree", type=Path, action="append", required=True, help="a folder (repeat for more)"
    )
    parser.add_argument("--ask", action="append", default=[], help="a question to answer (runs the LLM)")
    parser.add_argument("--max-files", type=int, help="BRAG_MAX_FILES for this run (default: the app's)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--append", action="store_true", help="add this run to --out instead of replacing it")
    args = parser.parse_args(argv)
    limits = Limits.from_env()
    if args.max_files:
        limits = replace(limits, files=args.max_files)
    command = "python bench/tree_upload.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [
        *(["# A documentation tree in one upload", ""] if not args.append else ["---", ""]),
        f"Command: `{command}` (read once; the CPU was shared with other jobs, so seconds are indicative).",
        "",
        f"Limits: BRAG_MAX_FILES {limits.files:,}, BRAG_MAX_FILE_BYTES {limits.file_bytes:,}, "
        f"BRAG_MAX_FILES_BYTES {limits.files_bytes:,}, BRAG_MAX_TEXT_CHARS {limits.text_chars:,}, "
        f"BRAG_MAX_PASSAGES {limits.passages:,}; the parse worker {limits.parse_memory_mb} MB, "
        f"{limits.parse_cpu_seconds} s of CPU a file. *As files*: the files the app's file input offers "
        "(its types); *as a zip*: the whole tree as one .zip. Read s: the upload's files checked and read "
        "in the capped worker, as the app reads them (wall time; the worker runs at a lower priority than "
        "the server, so on a busy machine it waits); worker CPU s: the CPU the workers used; in-process s: "
        "the same files read by `documents.read_tree` in this process, uncapped; index s: the BM25 index.",
        "",
    ]
    for tree in args.tree:
        result = measure(tree, limits)
        lines += section(result, limits)
        lines += ask(result, args.ask)
    text = "\n".join(lines) + "\n"
    before = args.out.read_text(encoding="utf-8") if args.append and args.out.exists() else ""
    args.out.write_text(before + text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
