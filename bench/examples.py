"""The app's Demo examples and the README's example, answered by the embedded model.

Each question runs as the app runs it: ``BRAG(llm)`` with the calibration shipped for the model
and the Demo corpus (it has none of its own, so the model's pooled one) at the default λ, over
the app's Demo corpus; the README example is the README's own snippet, executed as written
(``BRAG(llm)``: the fit for a caller's documents). The gold answers are read off the Demo corpus by hand.

    python bench/examples.py --model local
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import brag
import bragkit.serving.corpora
from bragkit import llms

GOLD = {
    "Where was the architect of the Glass Tower born?": "Bergen",
    "Which political party used the idea coined by Friedrich Ratzel?": "Nazi Party",
    "In which city was the author of The Silent Orchard born?": "Trondheim",
    "Into which sea does the river that flows through Marie Curie's birthplace flow?": "Baltic Sea",
}
README_GOLD = "Nazi Party"


def readme_snippet() -> str:
    """The README's programmatic example, as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Programmatic use", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise SystemExit("README.md has no python example under 'Programmatic use'")
    return match.group(1)


def row(source: str, question: str, gold: str, answer: str, report: dict[str, Any], seconds: float) -> dict:
    steps = [s["action"] for s in report["steps"] if s["action"]]
    return {
        "source": source,
        "question": question,
        "gold": gold,
        "answer": answer,
        "right": brag.exact_match(answer, (gold,)),
        "actions": " → ".join(steps) or "none",
        "calls": report["totals"]["llm_calls"],
        "seconds": seconds,
        "calibration": report["config"]["calibration"]["name"],
        "trust": report["confidence"]["summary"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local", help="a make_llm spec (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "examples.md")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import app  # the Demo corpus and examples exactly as the app has them

    llm = llms.make_llm(args.model)
    corpus = brag.Corpus(bragkit.serving.corpora.DEMO_CORPUS_PATH.read_text(encoding="utf-8"))
    demo_fit = brag.shipped_calibration(brag.llm_name(llm), bragkit.serving.corpora.DEMO)
    controller = brag.BRAG(llm, calibration=demo_fit)
    rows = []
    for question, corpus_name in app.EXAMPLES:
        assert corpus_name == bragkit.serving.corpora.DEMO and question in GOLD, question
        t0 = time.perf_counter()
        answer, report = controller.run(question, corpus)
        rows.append(row("app Demo", question, GOLD[question], answer, report, time.perf_counter() - t0))
    snippet = readme_snippet().replace('make_llm("local")', f"make_llm({args.model!r})")
    namespace: dict[str, Any] = {}
    t0 = time.perf_counter()
    exec(compile(snippet, "README.md", "exec"), namespace)  # our own README, as a user runs it
    question = re.search(r'\.run\("([^"]+)"', snippet).group(1)
    seconds = time.perf_counter() - t0
    rows.append(row("README", question, README_GOLD, namespace["answer"], namespace["report"], seconds))

    right = sum(r["right"] for r in rows)
    lines = [
        "# The app's Demo examples and the README's example",
        "",
        f"Command: `python bench/examples.py --model {args.model}`",
        f"Model: `{llm.name}`; λ = {controller.lam} (the default); calibration `{rows[0]['calibration']}` "
        f"({brag.calibration_status(controller.calibration, llm.name)}); "
        f"at most {controller.hops} second hops.",
        "",
        f"**{right} of {len(rows)} right** (exact match after SQuAD normalisation).",
        "",
        "| source | question | gold | answer | right | what the report says | actions | calls | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['question']} | {r['gold']} | {r['answer'] or '(none)'} | "
            f"{'✓' if r['right'] else '✗'} | {r['trust']} | {r['actions']} | {r['calls']} | "
            f"{r['seconds']:.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
