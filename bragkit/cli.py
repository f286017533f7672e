"""BRAG's command line: ``python -m brag index PATH... OUT`` (or ``brag index``).

Indexes documents or a passage collection once, into a folder that ``brag.Corpus.load`` opens
memory-mapped (the app serves it with ``BRAG_CORPUS_DIR``), or into a Milvus collection. The
document readers, Milvus and the embedders are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from brag import BM25_VARIANTS, Corpus, InputError, Passage, parse_json, parse_passages, read_json
from bragkit import documents  # the standard library alone at import; its PDF and HTML readers load when used


def _read_collection(path: Path) -> list[Any]:
    """Passages from a JSON list or a JSON Lines file (a string or a {title, text} per line).

    JSON Lines become Passages line by line, so a large file never holds both forms at once.
    """
    if path.suffix != ".jsonl":
        return read_json(path, str(path))
    passages: list[Passage | None] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                item = parse_json(line, f"{path}, line {number}")
                try:
                    (passage,) = parse_passages([item])
                except ValueError as err:
                    raise InputError(f"{path}, line {number}: {str(err).split(': ', 1)[-1]}") from None
                passages.append(passage or Passage("", ""))  # kept, so ids stay line numbers
    return passages


def _read_documents(paths: Sequence[Path]) -> list[Any]:
    """Passages from document files and folders (``bragkit/documents.py``), each file reported as it goes.

    A file that cannot be read is reported with the reason and skipped; the rest are indexed.
    """
    # A folder's regular files of a document type, and every file named (is_file() is False for
    # a FIFO, a device, or a link to one: those are reported, never opened).
    files = [
        f
        for p in paths
        for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])
        if not p.is_dir() or f.suffix.lower() in documents.SUFFIXES
    ]
    limits = documents.FileLimits(files=len(files), total_bytes=1 << 62, text_chars=1 << 62)
    passages: list[Any] = []
    skipped = 0
    for number, path in enumerate(files, 1):
        try:
            found = documents.read_file(path.name, _read_bounded(path, limits.file_bytes), limits)
        except (documents.DocumentError, OSError) as err:
            skipped += 1
            print(f"[{number}/{len(files)}] skipped {path}: {str(err).split(': ', 1)[-1]}", file=sys.stderr)
            continue
        passages += [replace(p, doc_id=str(path)) for p in found]
        count = f"{len(found):,} passage{'s' if len(found) != 1 else ''}"
        print(f"[{number}/{len(files)}] {path}: {count}", file=sys.stderr, flush=True)
    if not passages:
        raise InputError(f"no readable document among {len(files)} file{'s' if len(files) != 1 else ''}")
    if skipped:
        print(f"{skipped} of {len(files)} files skipped (above)", file=sys.stderr)
    return passages


def _read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused past ``limit`` before it is read (a file growing meanwhile too)."""
    if not path.is_file():
        raise documents.DocumentError(
            f"{path.name}: not a regular file (a folder, device, pipe or broken link)"
        )
    size = path.stat().st_size
    if size > limit:
        raise documents.TooLarge(f"{path.name}: {size:,} bytes, at most {limit:,} per file")
    with path.open("rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise documents.TooLarge(f"{path.name}: more than {limit:,} bytes, at most {limit:,} per file")
    return data


def _read_inputs(docs: Sequence[Path]) -> list[Any]:
    """Passages from one passage file, or from document files and folders."""
    if len(docs) == 1 and docs[0].is_file() and docs[0].suffix.lower() in documents.PASSAGE_SUFFIXES:
        print(f"reading {docs[0]}", file=sys.stderr, flush=True)
        return _read_collection(docs[0])
    return _read_documents(docs)


def _index_into_milvus(args: argparse.Namespace) -> int:
    """``index ... --milvus URI``: the same passages and ingestion dedup, into a collection."""
    from bragkit import milvus as milvus_corpus  # an optional engine beside this module: pymilvus

    try:
        passages = _read_inputs(args.paths)
        embedder = None
        if args.dense:
            from bragkit import embedders

            embedder = embedders.make_embedder(args.dense)
        client = milvus_corpus.connect(args.milvus, args.token)

        def progress(done: int, total: int) -> None:
            print(f"\rinserting: {done:,} of {total:,} passages", end="", file=sys.stderr, flush=True)

        counts = milvus_corpus.ingest(passages, client, args.collection, embedder=embedder, progress=progress)
        print(file=sys.stderr)
    except (ValueError, OSError) as err:
        print(f"brag index: {err}", file=sys.stderr)
        return 2
    print(
        f"{counts['passages']:,} passages, {counts['kept']:,} kept, {counts['inserted']:,} inserted into "
        f"{args.collection!r}"
    )
    return 0


def _save_whole(corpus: Corpus, out: Path, name: str) -> None:
    """Save into a hidden folder beside ``out`` and rename it: ``out`` appears only when complete."""
    if out.exists():
        raise InputError(f"{out} already exists: give a new folder, or delete it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        corpus.save(partial, name=name)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    # The same command as ``python -m brag`` or as the ``brag`` that ``pip install .`` adds.
    prog = "brag" if Path(sys.argv[0]).name == "brag" else "python -m brag"
    parser = argparse.ArgumentParser(prog=prog, description="BRAG's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    index = commands.add_parser("index", help="index documents or a passage collection into a folder")
    index.add_argument(
        "paths",
        type=Path,
        nargs="+",
        help=f"files and folders ({documents.described_suffixes()}), then the folder to write (the app "
        "serves it with BRAG_CORPUS_DIR); no folder with --milvus",
    )
    index.add_argument(
        "--milvus", help="index into Milvus instead: a Milvus Lite file, or http(s)://host:19530"
    )
    index.add_argument("--collection", default="brag", help="the Milvus collection (default: brag)")
    index.add_argument(
        "--token", default=os.environ.get("BRAG_MILVUS_TOKEN", ""), help="a Milvus server's token"
    )
    index.add_argument("--dense", help="with --milvus: also store dense vectors from this embedder")
    index.add_argument("--name", help="the corpus's name in the app (default: the folder's name)")
    index.add_argument("--variant", default="okapi", choices=list(BM25_VARIANTS))
    index.add_argument("--k1", type=float, default=1.5)
    index.add_argument("--b", type=float, default=0.75)
    return parser


def _index_into_folder(docs: Sequence[Path], out: Path, args: argparse.Namespace) -> int:
    """``index PATH... OUT``: a BM25 corpus saved whole into ``out``, for ``Corpus.load``."""
    started = time.perf_counter()
    try:
        passages = _read_inputs(docs)
        print(f"indexing {len(passages):,} passages", file=sys.stderr, flush=True)
        corpus = Corpus(passages, variant=args.variant, k1=args.k1, b=args.b, show_progress=True)
        del passages
        print(f"writing {out}", file=sys.stderr, flush=True)
        _save_whole(corpus, out, args.name or out.resolve().name)
    except (ValueError, OSError) as err:
        print(f"brag index: {err}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"indexed {len(corpus):,} passages ({corpus.dropped} empty dropped) in "
        f"{time.perf_counter() - started:.1f} s; {size / 1e6:.1f} MB in {out}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m brag index PATH... OUT`` (or ``--milvus URI``); the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.milvus:
        return _index_into_milvus(args)
    if len(args.paths) < 2:
        parser.error("give the documents, then the folder to write")
    return _index_into_folder(args.paths[:-1], args.paths[-1], args)


if __name__ == "__main__":
    sys.exit(main())
