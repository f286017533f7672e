"""The embedded local models: latency and tokens/s, and which prompt format reads better.

1. Latency, measured in one run with nothing cached: Qwen2.5-Coder-0.5B-Instruct (the default,
   in both prompt formats) and SmolLM2-135M-Instruct (``local:smollm2``), each on an R1-sized
   read (the top-5 BM25 passages of a HotpotQA question) and a CB call with m = 5 samples; and
   Qwen with llama.cpp's weight repacking ("extra buffer types") on and off.
2. Prompt format, on the first ``--questions`` calibration questions of each dataset: the
   model's own chat template against the same worked examples flattened into one plain
   completion prompt. R1 and CB run exactly as ``BRAG.run`` issues them, through the response
   cache, so a later calibration reuses the winner's responses. The format that reads better
   is the one whose R1 reads are right more often.

    python bench/llm_latency.py --repeats 5 --questions 40
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import brag
import calibrate
from bragkit import (
    llms,
    storage,
)
from bragkit.llms import worker as llm_worker

# Calibration questions (the benchmark tests only on later ones) and their corpora.
DATASETS = {
    "HotpotQA": ("hotpotqa/hotpotqa_ircot500.json", "hotpotqa/hotpotqa_ircot500_corpus.json"),
    "2WikiMultihopQA": (
        "2wikimultihopqa/2wikimultihopqa.json",
        "2wikimultihopqa/2wikimultihopqa_corpus.json",
    ),
    "MuSiQue": ("musique/musique_migres200.json", "musique/musique_migres200_corpus.json"),
}
PRIORS = ROOT / "tests" / "prior_calibration.json"


def load(name: str, n: int) -> tuple[list[calibrate.Labelled], brag.Corpus]:
    root = storage.data_dir()
    if root is None:
        raise SystemExit("the shared evaluation data is missing: set BRAG_DATA_DIR")
    questions, corpus = DATASETS[name]
    items = calibrate.read_labelled(root / questions)[:n]
    return items, brag.Corpus((root / corpus).read_text(encoding="utf-8"))


def timed(calls: list[Callable[[], brag.Completion]]) -> dict[str, float]:
    seconds, prompt, completion = [], [], []
    for call in calls:
        t0 = time.perf_counter()
        out = call()
        seconds.append(time.perf_counter() - t0)
        prompt.append(out.prompt_tokens)
        completion.append(out.completion_tokens)
    total = sum(seconds)
    return {
        "calls": len(calls),
        "prompt": statistics.median(prompt),
        "completion": statistics.median(completion),
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "prompt_tps": sum(prompt) / total,
        "completion_tps": sum(completion) / total,
    }


def row(model: str, call: str, r: dict[str, float]) -> str:
    cells = [model, call, r["calls"], f"{r['prompt']:.0f}", f"{r['completion']:.0f}", f"{r['median_s']:.2f}"]
    cells += [f"{r['max_s']:.2f}", f"{r['prompt_tps']:.0f}", f"{r['completion_tps']:.1f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def latency(repeats: int) -> tuple[list[str], list[str]]:
    items, corpus = load("HotpotQA", repeats)
    reads = [
        brag.read_messages(i.question, [corpus[p] for p, _ in corpus.search(i.question, 5)]) for i in items
    ]
    books = [brag.closed_book_messages(i.question) for i in items]
    read_kw = {"max_tokens": 48, "stop": brag.READ_STOP, "seed": 0}
    book_kw = {"n": 5, "temperature": 0.7, "max_tokens": 16, "stop": ["\n"], "seed": 0}
    rows, loads = [], []
    for label, make in [
        ("Qwen2.5-Coder-0.5B Q4_K_M, chat template", lambda: llms.LocalModel(prompt_format="chat")),
        ("Qwen2.5-Coder-0.5B Q4_K_M, plain prompt", lambda: llms.LocalModel(prompt_format="plain")),
        ("SmolLM2-135M Q4_1, plain prompt", lambda: llms.LocalModel(weights=llms.SMOLLM2)),
    ]:
        model = make()
        model.runner.stop()  # a cold start: the worker process and the weights
        t0 = time.perf_counter()
        model.complete([{"role": "user", "content": "Hello"}], max_tokens=1)
        loads.append(f"{label}: {time.perf_counter() - t0:.2f} s")
        for call, prompts, kw in (("R1 read, top-5", reads, read_kw), ("CB, m = 5", books, book_kw)):
            rows.append(row(label, call, timed([partial(model.complete, m, **kw) for m in prompts])))
        model.runner.stop()
    # Weight repacking, in this process with the worker's own loading and generation code.
    path = str(llms.weights_file(llms.QWEN_CODER))
    for extra in (True, False):
        model = llm_worker.load_llama(
            {"path": path, "n_ctx": 4096, "n_threads": None, "extra_buffers": extra}
        )
        request = {"n": 1, "temperature": 0.0, "format": "chat", **read_kw}

        def generate(m: list[dict[str, str]], model: Any = model, request: dict = request) -> brag.Completion:
            out = llm_worker.generate(model, {**request, "messages": m})
            return brag.Completion(out["texts"], out["prompt_tokens"], out["completion_tokens"])

        label = f"Qwen, chat, repacking {'on' if extra else 'off (as the runner loads it)'}"
        rows.append(row(label, "R1 read, top-5", timed([partial(generate, m) for m in reads])))
        model.close()
    return rows, loads


def formats(n: int, cache: Path) -> tuple[list[str], dict[str, float]]:
    """R1 and CB accuracy per prompt format and dataset, and how well R1's follow-up queries find."""
    rows, totals = [], {}
    for fmt in llms.PROMPT_FORMATS:
        llm = llms.CachedLLM(llms.LocalModel(prompt_format=fmt), cache)
        controller = brag.BRAG(llm, calibration=PRIORS, lam=0.0)
        right_total = 0
        for name in DATASETS:
            items, corpus = load(name, n)
            stats = dict.fromkeys(("r1_answered", "r1_right", "cb_right", "agreement", "written", "found"), 0)
            needing = 0
            for item in items:
                _, report = controller.run(item.question, corpus, actions=["R1", "CB"])
                r1, cb = (s["observation"] for s in report["steps"] if s["action"])
                stats["r1_answered"] += bool(r1["answer"])
                stats["r1_right"] += calibrate.is_correct(r1["answer"], item.gold)
                stats["cb_right"] += calibrate.is_correct(cb["answer"], item.gold)
                stats["agreement"] += cb["agreement"]
                stats["written"] += not r1["follow_up_fallback"]
                window = {p["title"] for p in r1["passages"]}
                missing = set(item.supporting) - window
                if missing:  # does the model's own follow-up query find a missing passage?
                    needing += 1
                    hop = [
                        corpus[i].title
                        for i, _ in corpus.search(r1["follow_up_query"], 10)
                        if corpus[i].title
                    ]
                    stats["found"] += bool(missing & set(hop)) and not r1["follow_up_fallback"]
            right_total += stats["r1_right"]
            q = len(items)
            found = f"{stats['found']}/{needing}" if needing else "n/a (no supporting titles)"
            cells = [fmt, name, q, f"{stats['r1_right'] / q:.3f}", f"{stats['r1_answered'] / q:.2f}"]
            cells += [
                f"{stats['cb_right'] / q:.3f}",
                f"{stats['agreement'] / q:.2f}",
                f"{stats['written'] / q:.2f}",
            ]
            rows.append("| " + " | ".join(map(str, [*cells, found])) + " |")
        totals[fmt] = right_total
        llm.close()
    return rows, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="calls per latency row")
    parser.add_argument("--questions", type=int, default=40, help="calibration questions per dataset")
    parser.add_argument("--cache", type=Path, default=ROOT / "bench" / "cache" / "llm.sqlite")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "llm_latency.md")
    args = parser.parse_args()

    latency_rows, loads = latency(args.repeats)
    format_rows, totals = formats(args.questions, args.cache)
    best = max(totals, key=lambda f: (totals[f], f == "chat"))
    text = "\n".join(
        [
            "# The embedded local models: latency, tokens/s and prompt format",
            "",
            f"Command: `python bench/llm_latency.py --repeats {args.repeats} --questions {args.questions}`",
            f"Machine: {platform.machine()}, 2 cores, no GPU, Python {platform.python_version()}; "
            "llama-cpp-python 0.3.36 built for AVX2 (requirements.txt), one worker process per model.",
            "",
            "## Latency (one run, nothing cached)",
            "",
            "Cold start (worker process, weights, first token): " + "; ".join(loads) + ".",
            "",
            "| model | call | calls | median prompt tokens | median completion tokens | median s / call "
            "| max s | prompt tokens/s (all) | completion tokens/s (all) |",
            "|---|---|---|---|---|---|---|---|---|",
            *latency_rows,
            "",
            "CB prompt tokens are summed over its 5 samples. Tokens/s are the row's total tokens over its",
            "total wall time, prompt processing and generation together. The repacking rows load the",
            "model in the benchmark's own process with the worker's code.",
            "",
            f"## Prompt format (calibration questions 0:{args.questions} of each dataset)",
            "",
            "R1 reads the top-5 BM25 passages; CB takes m = 5 samples at temperature 0.7 (seed 0).",
            "Correct = normalised exact match or token F1 >= 0.8 with a gold answer (calibrate.py).",
            "*Follow-up finds*: of the questions whose R1 window misses a supporting passage, how many",
            "times the model's own follow-up query (not the non-LLM fallback) retrieves one in its top 10.",
            "",
            "| format | dataset | questions | R1 accuracy | R1 answer rate | CB accuracy | CB mean agreement "
            "| follow-up written | follow-up finds a missing passage |",
            "|---|---|---|---|---|---|---|---|---|",
            *format_rows,
            "",
            "R1 right answers over all datasets: "
            + ", ".join(f"{f} {totals[f]}" for f in llms.PROMPT_FORMATS)
            + f". Kept: **{best}** (`llms.QWEN_CODER.prompt_format`).",
        ]
    )
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
