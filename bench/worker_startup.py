"""The embedded model's worker process: start-up time and resident memory.

    python bench/worker_startup.py [--repeats 5]

Starts the worker the way ``llms.LocalRunner`` does, ``--repeats`` times, and reports the
median seconds until it is ready (imports plus loading the model), its resident memory once
ready, and the seconds and memory of the worker's imports alone (a bare ``python -c`` of the
module the worker runs). Writes ``bench/results/worker_startup.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bragkit import llms


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker_module() -> str:
    """A statement that loads what the worker process loads (what ``LocalRunner`` starts)."""
    import inspect

    source = inspect.getsource(llms.LocalRunner._start)
    if "worker.py" in source:  # a script run with -P: its imports, without its __main__ block
        return "import runpy; runpy.run_path('bragkit/llms/worker.py', run_name='worker')"
    return "import llm_worker" if "llm_worker" in source else "from bragkit import llms"


def imports_only(module: str) -> tuple[float, float]:
    """Seconds and RSS (MB) of a fresh interpreter once it has run the import statement ``module``."""
    # VmRSS, not ru_maxrss: a child's ru_maxrss starts from its parent's peak at fork.
    code = (
        f"import time; t = time.perf_counter(); {module}; s = time.perf_counter() - t; "
        "rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS:')][0].split()[1]; "
        "print(s, int(rss) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, peak = map(float, out.stdout.split())
    return seconds, peak


def ready(path: str) -> tuple[float, float]:
    """Seconds until a fresh worker has loaded the model, and its RSS (MB) then."""
    runner = llms.LocalRunner(path, n_ctx=8192, n_threads=None)
    started = time.perf_counter()
    try:
        runner._start(time.monotonic() + 300)
        seconds = time.perf_counter() - started
        assert runner.pid is not None
        return seconds, rss_mb(runner.pid)
    finally:
        runner.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    module = worker_module()
    path = str(llms.weights_file(llms.QWEN_CODER))
    imports = [imports_only(module) for _ in range(args.repeats)]
    loads = [ready(path) for _ in range(args.repeats)]
    rows = [
        ("imports only", statistics.median(s for s, _ in imports), statistics.median(m for _, m in imports)),
        (
            "ready (imports + model)",
            statistics.median(s for s, _ in loads),
            statistics.median(m for _, m in loads),
        ),
    ]
    lines = [
        f"## Worker module `{module}`",
        "",
        f"Command: `python bench/worker_startup.py --repeats {args.repeats}`; {platform.machine()}, "
        f"Python {platform.python_version()}, medians of {args.repeats} fresh processes.",
        "",
        "| phase | seconds | RSS MB |",
        "|---|---|---|",
        *[f"| {name} | {seconds:.3f} | {mb:.0f} |" for name, seconds, mb in rows],
        "",
    ]
    out = ROOT / "bench" / "results" / "worker_startup.md"
    previous = out.read_text(encoding="utf-8") if out.exists() else "# Local-model worker start-up\n\n"
    marker = f"## Worker module `{module}`"
    if marker in previous:  # replace this module's section, keep the other one for comparison
        head, _, tail = previous.partition(marker)
        rest = tail.split("\n## ", 1)
        previous = head + ("## " + rest[1] if len(rest) > 1 else "")
    out.write_text(previous.rstrip() + "\n\n" + "\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
