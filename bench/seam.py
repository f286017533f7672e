"""The seam between the runner, the kinds and calibration, measured against a reference checkout.

Three measures, each for this checkout and for ``--reference`` (a checkout of the commit
before the change, e.g. ``git worktree add /tmp/old 1609b2e``), in one run:

- the code: lines of ``brag.py`` and ``calibrate.py``, the sizes of ``brag.__all__`` and
  ``llms.__all__``, the longest function of each, what ``calibrate.py`` imports from
  ``bragkit``, and the places product code recognises a kind by its class;
- the decision step: ``bench/decision_overhead.py`` of each checkout, alternately, ``--pairs``
  times (``--runs`` runs and ``--rounds`` rounds each); the median of each checkout's medians;
- a self-test's LLM calls per kept question, from each checkout's
  ``bench/results/selftest/loopback.json`` (``python bench/selftest.py loopback --docs DIR``
  run in each checkout: a loopback reader that answers at once).

    python bench/seam.py --reference /tmp/old [--pairs 3 --runs 100 --rounds 3]

Writes ``bench/results/seam_measures.md``; ``bench/results/seam.md`` holds what is read off it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
LOOKAHEAD = re.compile(r"^\| lookahead, priced in tokens \| \d+ \| ([0-9.]+) \|", re.MULTILINE)
RATE = re.compile(r"^\| rate, priced in tokens \| \d+ \| ([0-9.]+) \|", re.MULTILINE)
# A kind recognised by its class: isinstance on a kind, an exact type() of one, a kind class as a key.
# (A check that a row's kind is a VoteKind at all, and a call of a kind's static helper, are not.)
BY_CLASS = re.compile(
    r"isinstance\([\w.]*kind, (?!VoteKind\))|type\([\w.]*kind\)|brag\.(?:Read|Hop|Samples)\b(?!\.branches)"
)
PRODUCT = ("brag.py", "calibrate.py", "app.py", "bragkit")
T = TypeVar("T")


def product_files(root: Path) -> list[Path]:
    files = [root / name for name in PRODUCT if name.endswith(".py")]
    return files + sorted((root / "bragkit").rglob("*.py"))


def longest_function(path: Path) -> tuple[str, int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    return max(found, key=lambda item: item[1])


def all_size(root: Path, module: str) -> int:
    code = f"import sys; sys.path.insert(0, {str(root)!r}); import {module} as m; print(len(m.__all__))"
    return int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )


def bragkit_imports(path: Path) -> list[str]:
    """What a module imports from bragkit at its top level (not under ``if __name__``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bragkit"):
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("bragkit")]
    return found


def code_measures(root: Path) -> dict[str, object]:
    lines = {name: len((root / name).read_text(encoding="utf-8").splitlines()) for name in PRODUCT[:2]}
    by_class = sum(len(BY_CLASS.findall(p.read_text(encoding="utf-8"))) for p in product_files(root))
    return {
        "lines": lines,
        "brag.__all__": all_size(root, "brag"),
        "llms.__all__": all_size(root, "bragkit.llms"),
        "longest": {name: longest_function(root / name) for name in PRODUCT[:2]},
        "calibrate imports from bragkit": bragkit_imports(root / "calibrate.py"),
        "kinds recognised by class": by_class,
    }


def decision_medians(root: Path, runs: int, rounds: int) -> tuple[float, float]:
    out = Path("/tmp") / f"seam-decision-{abs(hash(str(root)))}.md"
    command = [sys.executable, "bench/decision_overhead.py", "--runs", str(runs), "--rounds", str(rounds)]
    subprocess.run([*command, "--out", str(out)], cwd=root, check=True, capture_output=True)
    text = out.read_text(encoding="utf-8")
    return float(LOOKAHEAD.search(text)[1]), float(RATE.search(text)[1])


def calls_per_kept(root: Path) -> dict[str, tuple[int, int]]:
    path = root / "bench" / "results" / "selftest" / "loopback.json"
    return {row["set"]: (row["calls"], row["kept"]) for row in json.loads(path.read_text(encoding="utf-8"))}


def alternately(trees: dict[str, Path], pairs: int, measure: Callable[[Path], T]) -> dict[str, list[T]]:
    """``measure`` of each tree, ``pairs`` times, the trees taking turns.

    So a drift of the machine's speed hits both alike.
    """
    found: dict[str, list[T]] = {name: [] for name in trees}
    for _ in range(pairs):
        for name, root in trees.items():
            found[name].append(measure(root))
    return found


def comparison_parser(doc: str, pairs: int, out: Path) -> argparse.ArgumentParser:
    """The command line of a script that measures this checkout against ``--reference``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of the commit before")
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--out", type=Path, default=out)
    return parser


def main() -> int:
    parser = comparison_parser(__doc__, 3, ROOT / "bench" / "results" / "seam_measures.md")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"before": args.reference.resolve(), "after": ROOT}
    code = {name: code_measures(root) for name, root in trees.items()}
    timings = alternately(trees, args.pairs, lambda root: decision_medians(root, args.runs, args.rounds))
    per_set = {name: calls_per_kept(root) for name, root in trees.items()}
    command = f"python bench/seam.py --reference {args.reference}"
    if (args.pairs, args.runs, args.rounds) != (3, 100, 3):
        command += f" --pairs {args.pairs} --runs {args.runs} --rounds {args.rounds}"
    lines = ["# The seam, measured", "", f"Command: `{command}`", "", "## Code", ""]
    lines += ["| measure | before | after |", "|---|---|---|"]
    for key in code["before"]:
        lines.append(f"| {key} | {code['before'][key]} | {code['after'][key]} |")
    lines += ["", "## The decision step (µs, median of each checkout's median rounds)", ""]
    lines += [
        "| policy | before | after | after / before | fastest before | fastest after | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, policy in enumerate(("lookahead, priced in tokens", "rate, priced in tokens")):
        before = statistics.median(t[i] for t in timings["before"])
        after = statistics.median(t[i] for t in timings["after"])
        # The fastest run of each: this machine's speed drifts, and a busy spell only adds time.
        low_before, low_after = min(t[i] for t in timings["before"]), min(t[i] for t in timings["after"])
        lines.append(
            f"| {policy} | {before:.2f} | {after:.2f} | {after / before:.3f} "
            f"| {low_before:.2f} | {low_after:.2f} | {low_after / low_before:.3f} |"
        )
    for name in trees:
        pairs = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in timings[name])
        lines.append(f"\n{name}, each run (lookahead/rate): {pairs}")
    lines += ["", "## Self-test LLM calls per kept question (loopback reader)", ""]
    lines += ["| set | before | after | saved |", "|---|---|---|---|"]
    for name, (calls, kept) in per_set["after"].items():
        old_calls, old_kept = per_set["before"][name]
        saved = 1 - (calls / kept) / (old_calls / old_kept)
        lines.append(
            f"| {name} | {old_calls} / {old_kept} = {old_calls / old_kept:.2f} "
            f"| {calls} / {kept} = {calls / kept:.2f} | {saved:.1%} |"
        )
    lines.append("")
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
