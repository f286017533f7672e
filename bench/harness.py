"""What the benchmark scripts share: the evaluation data, peak memory, and results files.

A results file's written notes survive a rerun. Standard library only (brag is imported when
the data is asked for), so a process whose memory is measured loads nothing more for it.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def data_dir_or_exit(script: str) -> Path:
    """The shared evaluation data (``storage.data_dir``), or exit 2 saying how to point at it."""
    sys.path.insert(0, str(ROOT))

    from bragkit import storage

    root = storage.data_dir()
    if root is None:
        print(f"{script}: set BRAG_DATA_DIR to the shared evaluation data", file=sys.stderr)
        raise SystemExit(2)
    return root


def peak_rss_mb() -> float:
    """Peak resident memory of the calling process so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_keeping(path: Path, lines: list[str], heading: str = "## Notes") -> None:
    """Write ``lines`` to ``path``, then what followed ``heading`` in the old file, if anything."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = [heading + old.split(heading, 1)[1].rstrip("\n")] if heading in old else []
    path.write_text("\n".join([*lines, *kept]).rstrip("\n") + "\n", encoding="utf-8")


def documents_parser(doc: str | None) -> argparse.ArgumentParser:
    """A command line for a script over the labelled document sets: its docstring, and ``--docs DIR``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=Path, required=True, help="the fetched documents, DIR/<set>/")
    return parser
