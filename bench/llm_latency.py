"""Latency and tokens/s of the embedded local model (SmolLM2-135M-Instruct Q4_1, llama-cpp-python).

Two workloads, each repeated: an R1-sized read prompt (about 700 tokens: the worked examples plus
the top-5 BM25 passages of a HotpotQA question) and a CB call with m = 5 samples.

    python bench/llm_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import brag
import llms


def read_prompts(n: int) -> list[list[dict[str, str]]]:
    """R1 prompts for the first ``n`` HotpotQA questions (demo corpus when the data is absent)."""
    root = brag.data_dir()
    source = root / "hotpotqa" / "hotpotqa_ircot500.json" if root else None
    if source and source.exists():
        questions = [q["question"] for q in json.loads(source.read_text())[:n]]
        corpus = brag.Corpus(json.loads((root / "hotpotqa" / "hotpotqa_ircot500_corpus.json").read_text()))
    else:
        questions = ["Where was the architect of the Glass Tower born?"] * n
        corpus = brag.Corpus(
            json.loads((Path(__file__).parent.parent / "data" / "demo_corpus.json").read_text())
        )
    prompts = []
    for q in questions:
        passages = [corpus[i] for i, _ in corpus.search(q, 5)]
        prompts.append(brag.read_messages(q, passages))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_latency.md")
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = llms.make_llm("local")
    model.complete([{"role": "user", "content": "Hello"}], max_tokens=1)  # loads the weights
    load_s = time.perf_counter() - t0

    reads = read_prompts(args.repeats)
    questions = [m[-1]["content"].rsplit("Question: ", 1)[-1].removesuffix("\nAnswer:") for m in reads]
    rows = []
    for label, prompts, kwargs in [
        ("R1 read (top-5 passages)", reads, {"max_tokens": 48, "stop": brag.READ_STOP}),
        (
            "CB, m = 5 samples",
            [brag.closed_book_messages(q) for q in questions],
            {"n": 5, "temperature": 0.7, "max_tokens": 16, "stop": ["\n"], "seed": 0},
        ),
    ]:
        seconds, prompt_tokens, completion_tokens = [], [], []
        for messages in prompts:
            t0 = time.perf_counter()
            out = model.complete(messages, **kwargs)
            seconds.append(time.perf_counter() - t0)
            prompt_tokens.append(out.prompt_tokens)
            completion_tokens.append(out.completion_tokens)
        total_s = sum(seconds)
        rows.append(
            f"| {label} | {len(prompts)} | {statistics.median(prompt_tokens):.0f} | "
            f"{statistics.median(completion_tokens):.0f} | {statistics.median(seconds):.2f} | "
            f"{max(seconds):.2f} | {sum(prompt_tokens) / total_s:.0f} | "
            f"{sum(completion_tokens) / total_s:.1f} |"
        )

    text = "\n".join(
        [
            "# Local model latency (SmolLM2-135M-Instruct Q4_1 through llama-cpp-python)",
            "",
            f"Command: `python bench/llm_latency.py --repeats {args.repeats}`",
            f"Machine: {platform.machine()}, 2 cores, no GPU, Python {platform.python_version()}. "
            f"Model load (first call, 1 token): {load_s:.2f} s.",
            "",
            "| call | calls | median prompt tokens | median completion tokens | median s / call | max s "
            "| prompt tokens/s (all) | completion tokens/s (all) |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Prompt tokens of the CB row are summed over the 5 samples (each sample is a generation).",
            "Tokens/s are total tokens over total wall time of that row, so they include prompt",
            "processing and generation together.",
        ]
    )
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
