"""Every security probe against the real app over HTTP: input, response, time and memory.

The probes are the ones ``tests/test_security.py`` asserts (``tests/security_probes.py``): five
``python app.py`` processes on loopback with server secrets set (the default endpoint policy, an
allow-list, two behind a trusted proxy, one over Milvus Lite), plus loopback endpoints that
record what they receive.

    python bench/security.py                      # every probe, into bench/results/security.md
    python bench/security.py --only REGEX --out F  # the probes whose finding matches, into F
    python bench/security.py --only '^41' --json new.json --sessions 1000   # and the outcomes as JSON
    python bench/security.py compare old.json new.json --out F  # two runs side by side (old code, new)

Probes marked ``suite=False`` (slow, their findings covered by unit tests) run here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from security_probes import REQUEST_TIMEOUT, run, start_lab


def cell(text: str, width: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def compare(old_path: Path, new_path: Path, out: Path) -> None:
    """The probes of two runs (``--json``), the old code's beside the new's, as one table."""
    old = {o["finding"]: o for o in json.loads(old_path.read_text())}
    rows = []
    for new in json.loads(new_path.read_text()):
        before = old.get(new["finding"])
        cells = [cell(new["finding"], 90)]
        for o in (before, new):
            if o is None:
                cells += ["(not run)"] * len(COLUMNS)
                continue
            verdict = "holds" if o["failure"] is None else "fails: " + o["failure"]
            cells += [cell(o["response"], 120), f"{o['seconds']:.2f}", f"{o['cpu']:.2f}"]
            cells += [
                f"{o['rss_before']:.0f} → {o['rss_after']:.0f}",
                f"{o['rss_peak']:.0f}",
                f"{o['honest']:.2f}",
                cell(verdict, 80),
            ]
        rows.append("| " + " | ".join(cells) + " |")
    head = ["finding"] + [f"{code}: {x}" for code in ("old", "new") for x in COLUMNS]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]
    out.write_text("\n".join(table) + "\n", encoding="utf-8")
    print("\n".join(table))


COLUMNS = ("response", "s", "CPU s", "RSS MB", "peak MB", "honest s", "verdict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", help="compare OLD.json NEW.json: two runs side by side")
    parser.add_argument("--only", default="", help="a regular expression: the probes whose finding matches")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "security.md")
    parser.add_argument("--json", type=Path, help="also write the outcomes here, as JSON")
    parser.add_argument("--sessions", type=int, help="sessions of the many-sessions probe (40 in the suite)")
    args = parser.parse_args()
    if args.what:
        if len(args.what) != 3 or args.what[0] != "compare":
            parser.error("compare OLD.json NEW.json")
        compare(Path(args.what[1]), Path(args.what[2]), args.out)
        return
    if args.sessions:
        os.environ["BRAG_PROBE_SESSIONS"] = str(args.sessions)
    with ExitStack() as stack:
        outcomes = run(start_lab(stack), lambda finding: re.search(args.only, finding) is not None)
    if args.json:
        rows = [
            {**{k: v for k, v in dataclasses.asdict(o).items() if k != "probe"}, "finding": o.probe.finding}
            for o in outcomes
        ]
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    rows = []
    for i, o in enumerate(outcomes, 1):
        verdict = "ok" if o.failure is None else o.failure
        cells = [i, cell(o.probe.finding, 90), o.probe.app, cell(o.probe.sent, 70), cell(o.response)]
        cells += [f"{o.seconds:.2f}", f"{o.cpu:.2f}", f"{o.rss_before:.0f} → {o.rss_after:.0f}"]
        cells += [f"{o.rss_peak:.0f}", f"{o.honest:.2f}", verdict]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    passed = sum(o.failure is None for o in outcomes)
    text = "\n".join(
        [
            "# Security probes against the running app",
            "",
            f"Command: `python bench/security.py{' --only ' + repr(args.only) if args.only else ''}` "
            "(the same probes as `tests/test_security.py`).",
            f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}. "
            "Six `python app.py` processes on loopback, with `OPENAI_API_KEY`, `HF_TOKEN`, a secret in "
            "another environment variable and a password in `BRAG_MODEL`'s URL; "
            f"`BRAG_REQUEST_TIMEOUT` = {REQUEST_TIMEOUT:g} s and `BRAG_DOCUMENTS_CACHE_BYTES` = 20 MB. "
            "*public*: the default endpoint policy; *listed*: `BRAG_ALLOWED_ENDPOINTS` names the probes' "
            "own recording endpoints (and one that answers too much); *fair*: behind a trusted proxy "
            "(`BRAG_TRUSTED_PROXIES`), two workers, one request per caller and a queue of three; "
            "*crowd*: behind a proxy that appends the caller (`BRAG_TRUSTED_PROXIES=*`), four workers, "
            "the default per-caller limits and a 120 s "
            "deadline; *milvus*: `BRAG_MILVUS_URI` on a Milvus Lite collection of 3,000 passages; "
            "*selftest*: behind '*', four workers, one /calibrate slot, self-tests of ten questions bounded "
            "at 20 s and 150,000 prompt characters, ten kept fits (three an address), and loopback "
            "endpoints that pass a self-test's checks at several paces (tests/selftest_probes.py). "
            "Each app has a cache and a temp folder of its own, so a file written anywhere else is seen.",
            "",
            "Time is the whole request as the caller saw it; CPU is the app's, with the processes it "
            "started (file readers, Milvus Lite), over the probe; memory is the app process's resident set "
            "(MB) before and after, and its peak during the probe. After every probe the same server "
            "answered a normal question (checked); "
            "*honest s* is how long that question took. Probes of callers who hold workers time the other "
            "caller themselves, in the response.",
            "",
            "| # | finding | app | sent | response | s | CPU s | RSS MB | peak MB | honest s | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"{passed} of {len(outcomes)} probes refused or bounded as required.",
        ]
    )
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
