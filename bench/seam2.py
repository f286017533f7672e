"""The window, the rows and the extension points, measured against a reference checkout (issue 59).

Two measures, each for this checkout and for ``--reference`` (a checkout of the commit before
the change, e.g. ``git worktree add /tmp/old 8959e5b``), in one run:

- the code: lines of ``brag.py`` and ``calibrate.py``, the longest serving module, the names of
  ``brag.__all__`` and how many of them only tests use, the members of the contexts a kind's
  window and step see, the kinds' methods that take any keyword (``**_``), the kept-fit stores,
  and the tests of ``tests/test_llms.py`` that fail with ``HF_HUB_OFFLINE=1``;
- the decision step: each checkout's ``_Run._decide`` timed as the runner times it
  (``policy_us``), alternately, ``--pairs`` times, over the same runs for both: the app's Demo
  question and corpus, a scripted LLM whose replies vary, λ = 0, under the HotpotQA fit (two
  evidence levels) and under the documents fit (evidence curves, which price each read by its
  window's signals); the median of each checkout's medians.

    python bench/seam2.py --reference /tmp/old [--pairs 11 --runs 100]

Writes ``bench/results/seam2_measures.md``; ``bench/results/seam2.md`` holds what is read off it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from harness import write_keeping
from seam import alternately, comparison_parser, longest_function, product_files

SERVING_MODULES = "bragkit/serving"
# The decision timing run in a checkout: its brag, this script's runs (the same for both).
TIMING = """
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
import brag  # the checkout's own; decision_overhead (this checkout's runs) then uses it
sys.path.insert(0, sys.argv[3])
import decision_overhead as runs

corpus = brag.Corpus(open(sys.argv[1] + "/data/demo_corpus.json", encoding="utf-8").read())
model = "local:qwen2.5-coder-0.5b-instruct-q4_k_m:chat"
fits = {"HotpotQA fit": brag.shipped_calibration(model, "HotpotQA")}
fits["documents fit"] = brag.shipped_calibration(model)
settings = [("HotpotQA fit", "lookahead"), ("HotpotQA fit", "rate"), ("documents fit", "lookahead")]
found = {}
for fit, policy in settings:
    times = runs.decision_times(policy, brag.DEFAULT_COST_UNIT, int(sys.argv[2]), corpus, fits[fit])
    found[f"{fit}, {policy}"] = statistics.median(times)
print(json.dumps(found))
"""


def all_names(root: Path) -> list[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); import brag, json; print(json.dumps(brag.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def used_only_by_tests(root: Path, names: list[str], docs_count: bool = True) -> list[str]:
    """Names of ``brag.__all__`` that no product module or benchmark uses (nor a doc, if ``docs_count``)."""
    product = [
        p.read_text(encoding="utf-8")
        for p in root.rglob("*.py")
        if p.parts[len(root.parts)] not in ("tests", ".venv", "build") and p.name != "brag.py"
    ]
    docs = "\n".join(p.read_text(encoding="utf-8") for p in [*root.glob("docs/*.md"), root / "README.md"])
    return [
        name
        for name in names
        if not any(re.search(rf"\bbrag\.{name}\b|from brag import[^\n]*\b{name}\b", text) for text in product)
        and not (docs_count and re.search(rf"`(brag\.)?{re.escape(name)}[`(.\[]", docs))
    ]


def protocol_members(tree: ast.Module, name: str) -> int:
    """How many members (annotated fields and methods) the class ``name`` declares; 0 if none."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return sum(isinstance(item, ast.AnnAssign | ast.FunctionDef) for item in node.body)
    return 0


def catch_all_methods(tree: ast.Module) -> int:
    """Methods of the vote kinds that take any keyword at all (``**_``)."""
    kinds = {"VoteKind", "Read", "Hop", "Samples", "SampledRead"}
    return sum(
        1
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name in kinds
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.args.kwarg is not None
    )


def offline_failures(root: Path) -> str:
    """``tests/test_llms.py`` run in ``root`` with ``HF_HUB_OFFLINE=1``: its summary line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_llms.py"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def code_measures(root: Path) -> dict[str, object]:
    brag_tree = ast.parse((root / "brag.py").read_text(encoding="utf-8"))
    serving = {
        p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (root / SERVING_MODULES).glob("*.py")
    }
    biggest = max(serving, key=serving.get)
    stores = sorted(
        {
            m
            for p in product_files(root)
            for m in re.findall(r"^class (Kept\w+|FitStore)\b", p.read_text(encoding="utf-8"), re.M)
        }
    )
    names = all_names(root)
    return {
        "lines of brag.py": len((root / "brag.py").read_text(encoding="utf-8").splitlines()),
        "lines of calibrate.py": len((root / "calibrate.py").read_text(encoding="utf-8").splitlines()),
        "longest serving module": f"{biggest}, {serving[biggest]} lines",
        "brag.__all__": len(names),
        "of them used by no product module or benchmark": len(used_only_by_tests(root, names, False)),
        "of them used by none, nor documented": len(used_only_by_tests(root, names)),
        "StepContext members": protocol_members(brag_tree, "StepContext"),
        "WindowContext members": protocol_members(brag_tree, "WindowContext"),
        "kinds' methods taking any keyword (**_)": catch_all_methods(brag_tree),
        "kept-fit stores": ", ".join(stores),
        "longest function, brag.py": "{}, {} lines".format(*longest_function(root / "brag.py")),
        "longest function, calibrate.py": "{}, {} lines".format(*longest_function(root / "calibrate.py")),
        "tests/test_llms.py with HF_HUB_OFFLINE=1": offline_failures(root),
    }


def decision_medians(root: Path, runs: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", TIMING, str(root), str(runs), str(ROOT / "bench")],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def main() -> int:
    args = comparison_parser(__doc__, 11, ROOT / "bench" / "results" / "seam2_measures.md").parse_args()
    trees = {"before": args.reference.resolve(), "after": ROOT}
    code = {name: code_measures(root) for name, root in trees.items()}
    timings = alternately(trees, args.pairs, lambda root: decision_medians(root, args.runs))
    command = f"python bench/seam2.py --reference {args.reference}"
    if (args.pairs, args.runs) != (11, 100):
        command += f" --pairs {args.pairs} --runs {args.runs}"
    lines = ["# The window, the rows and the extension points, measured", "", f"Command: `{command}`", ""]
    lines += ["## Code", "", "| measure | before | after |", "|---|---|---|"]
    lines += [f"| {key} | {code['before'][key]} | {code['after'][key]} |" for key in code["before"]]
    lines += ["", "## The decision step (µs: the median of each checkout's median per pair)", ""]
    lines += ["| calibration, policy | before | after | after / before |", "|---|---|---|---|"]
    for setting in timings["after"][0]:
        before = statistics.median(t[setting] for t in timings["before"])
        after = statistics.median(t[setting] for t in timings["after"])
        lines.append(f"| {setting} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    for name in trees:
        runs = "; ".join(", ".join(f"{v:.1f}" for v in t.values()) for t in timings[name])
        lines.append(f"\n{name}, each pair (in the table's order): {runs}")
    write_keeping(args.out, lines)
    print(args.out.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
