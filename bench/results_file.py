"""Rewrite a results file's measured part and keep its written part (from a heading on)."""

from __future__ import annotations

from pathlib import Path


def write_keeping(path: Path, lines: list[str], heading: str = "## Notes") -> None:
    """Write ``lines`` to ``path``, then what followed ``heading`` in the old file, if anything."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = [heading + old.split(heading, 1)[1].rstrip("\n")] if heading in old else []
    path.write_text("\n".join([*lines, *kept]).rstrip("\n") + "\n", encoding="utf-8")
