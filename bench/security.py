"""Every security probe against the real app over HTTP: input, response, time and memory.

The probes are the ones ``tests/test_security.py`` asserts (``tests/security_probes.py``): five
``python app.py`` processes on loopback with server secrets set (the default endpoint policy, an
allow-list, two behind a trusted proxy, one over Milvus Lite), plus loopback endpoints that
record what they receive.

    python bench/security.py                      # every probe, into bench/results/security.md
    python bench/security.py --only REGEX --out F  # the probes whose finding matches, into F
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from security_probes import REQUEST_TIMEOUT, run, start_lab  # noqa: E402


def cell(text: str, width: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="a regular expression: the probes whose finding matches")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "security.md")
    args = parser.parse_args()
    with ExitStack() as stack:
        outcomes = run(start_lab(stack), lambda finding: re.search(args.only, finding) is not None)
    rows = []
    for i, o in enumerate(outcomes, 1):
        verdict = "ok" if o.failure is None else o.failure
        cells = [i, cell(o.probe.finding, 90), o.probe.app, cell(o.probe.sent, 70), cell(o.response)]
        cells += [f"{o.seconds:.2f}", f"{o.cpu:.2f}", f"{o.rss_before:.0f} → {o.rss_after:.0f}", verdict]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    passed = sum(o.failure is None for o in outcomes)
    text = "\n".join(
        [
            "# Security probes against the running app",
            "",
            f"Command: `python bench/security.py{' --only ' + repr(args.only) if args.only else ''}` "
            "(the same probes as `tests/test_security.py`).",
            f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}. "
            "Five `python app.py` processes on loopback, with `OPENAI_API_KEY`, `HF_TOKEN`, a secret in "
            "another environment variable and a password in `BRAG_MODEL`'s URL; "
            f"`BRAG_REQUEST_TIMEOUT` = {REQUEST_TIMEOUT:g} s and `BRAG_DOCUMENTS_CACHE_BYTES` = 20 MB. "
            "*public*: the default endpoint policy; *listed*: `BRAG_ALLOWED_ENDPOINTS` names the probes' "
            "own recording endpoints (and one that answers too much); *fair*: behind a trusted proxy "
            "(`BRAG_TRUSTED_PROXIES`), two workers, one request per caller and a queue of three; "
            "*crowd*: behind a trusted proxy, four workers, the default per-caller limits and a 120 s "
            "deadline; *milvus*: `BRAG_MILVUS_URI` on a Milvus Lite collection of 3,000 passages. "
            "Each app has a cache and a temp folder of its own, so a file written anywhere else is seen.",
            "",
            "Time is the whole request as the caller saw it; CPU is the app's, with the processes it "
            "started (file readers, Milvus Lite), over the probe; memory is the app process's resident set "
            "(MB) before and after. After every probe the same server answered a normal question (checked).",
            "",
            "| # | finding | app | sent | response | s | CPU s | RSS MB | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"{passed} of {len(outcomes)} probes refused or bounded as required.",
        ]
    )
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
