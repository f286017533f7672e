"""Where BRAG's data lives and how its files are written.

The evaluation data, installed packages' folders, and writes that readers see whole or not at all.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

CHECKOUT = Path(__file__).resolve().parent.parent  # where brag.py and data/ are


def data_dir() -> Path | None:
    """The evaluation data directory: ``BRAG_DATA_DIR``, else ``../shared/data`` when present."""
    configured = os.environ.get("BRAG_DATA_DIR")
    if configured:
        return Path(configured)
    fallback = CHECKOUT.parent / "shared" / "data"
    return fallback if fallback.is_dir() else None


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A file to write that replaces ``path`` only when the block ends without an error.

    It is a temporary file in the same folder, flushed to disk and then renamed over the target,
    so readers see the old file or the new one, never a part; on an error it is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # mkstemp makes the file private (0600); the result keeps the old file's mode, else 0644
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never a part."""
    with atomic_file(path) as out:
        out.write(text.encode("utf-8"))


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it (None when absent)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
