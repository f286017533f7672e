"""Throughput and latency of the app (``python app.py``) against a loopback LLM with fixed latency.

For each client concurrency (default 1, 4, 16), 64 ``/brag`` requests over the REST API;
the LLM is the tests' loopback OpenAI-compatible server answering every request after 200 ms.
The app's own overhead per request is its latency minus the LLM time it waited for
(LLM calls x 200 ms, taken from each report).

    python bench/app_throughput.py [--requests 64] [--latency 0.2] [--levels 1 4 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from app_server import AppProcess, rest_call

QUESTION = "Where was the architect of the Glass Tower born?"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(args: argparse.Namespace, rows: list[str]) -> str:
    return "\n".join(
        [
            "# App throughput and overhead",
            "",
            f"Command: `python bench/app_throughput.py --requests {args.requests} --latency {args.latency} "
            f"--levels {' '.join(map(str, args.levels))}`",
            f"Machine: {platform.machine()}, 2 cores shared by all three processes, Python "
            f"{platform.python_version()}. The app runs with BRAG_CONCURRENCY=16 on the Demo corpus; the",
            f"loopback LLM (its own process) answers every request after {args.latency * 1000:.0f} ms; the",
            "clients call the REST API (`POST /gradio_api/call/brag`, then its SSE stream) from threads.",
            "",
            "| Gradio session | client concurrency | requests | requests/s | p50 latency s | p95 latency s "
            "| LLM s / request | overhead p50 ms | overhead p95 ms | overhead / LLM time (p50) "
            "| app CPU ms / request |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Overhead = latency − LLM calls × LLM latency: queueing in Gradio, the HTTP round trips of",
            "the client and to the LLM, retrieval and the controller. Target: < 5 % of LLM time at",
            "concurrency 16.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per LLM request")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "app_throughput.md")
    args = parser.parse_args()

    # The loopback LLM runs in its own process so that it and the load generator do not share a GIL.
    llm = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "openai_server.py"), "--delay", str(args.latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    llm_url = llm.stdout.readline().strip()
    rows = []
    with AppProcess({"BRAG_MODEL": llm_url + "#m", "BRAG_CONCURRENCY": "16"}) as app:
        inputs = [QUESTION, "Demo", "", 0.05, "", "", "auto", ""]
        rest_call(app.url, "brag", inputs)  # warm-up

        def one(i: int, level: int, reuse: bool) -> tuple[float, int]:
            # A client that keeps its session: one per thread, so no two requests share one at once.
            session = f"bench-{level}-{threading.get_ident()}" if reuse else None
            started = time.perf_counter()
            _, report = rest_call(app.url, "brag", inputs, session_hash=session)
            return time.perf_counter() - started, report["totals"]["llm_calls"]

        for reuse, level in [(reuse, level) for reuse in (True, False) for level in args.levels]:
            cpu_before = cpu_seconds(app.proc.pid)
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=level) as pool:
                results = list(
                    pool.map(one, range(args.requests), [level] * args.requests, [reuse] * args.requests)
                )
            wall = time.perf_counter() - started
            app_cpu_ms = (cpu_seconds(app.proc.pid) - cpu_before) / args.requests * 1000
            latencies = [r[0] for r in results]
            llm_time = [calls * args.latency for _, calls in results]
            overhead = [lat - t for lat, t in zip(latencies, llm_time, strict=True)]
            rows.append(
                f"| {'per client' if reuse else 'per request'} | {level} | {args.requests} "
                f"| {args.requests / wall:.2f} | {statistics.median(latencies):.3f} "
                f"| {percentile(latencies, 0.95):.3f} | {statistics.mean(llm_time):.2f} "
                f"| {statistics.median(overhead) * 1000:.0f} | {percentile(overhead, 0.95) * 1000:.0f} "
                f"| {statistics.median(overhead) / statistics.median(llm_time):.1%} | {app_cpu_ms:.0f} |"
            )
            print(rows[-1], flush=True)

    llm.terminate()
    llm.wait()
    text = report(args, rows)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
