"""A perfect multi-hop reader behind a loopback OpenAI-compatible endpoint.

It knows each question's gold answer and supporting passages. A read answers right exactly when
every supporting passage is in its prompt; otherwise it says NONE and proposes, as its follow-up
query, the title of a supporting passage it has not seen. Closed-book, it always gives the same
wrong answer with full agreement. This is the check of the controller the issue describes: a
controller that reads when reading pays answers nearly everything such a reader can.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from openai_server import FakeOpenAI, Reply

WRONG = "Atlantis"
TITLE = re.compile(r"^\[\d+\] (.*)$", re.MULTILINE)


class PerfectReader(FakeOpenAI):
    """``PerfectReader(items)``: ``items`` are calibrate.Labelled with supporting titles."""

    def __init__(self, items: list[Any]) -> None:
        self.truth = {item.question: (item.gold[0], set(item.supporting)) for item in items}
        super().__init__(handler=self.reply, model="perfect-reader")

    def reply(self, request: dict[str, Any]) -> Reply:
        content = request["messages"][-1]["content"]
        question = content.rsplit("Question: ", 1)[-1].strip()
        gold, supporting = self.truth.get(question, ("", set()))
        if not content.startswith("Passages:"):  # closed book
            return Reply(texts=[f"Answer: {WRONG}"] * int(request.get("n") or 1))
        seen = set(TITLE.findall(content))
        missing = sorted(supporting - seen)
        if gold and not missing:
            return Reply(texts=[f"Answer: {gold}\nFollow-up query: {gold}"])
        return Reply(texts=[f"Answer: NONE\nFollow-up query: {missing[0] if missing else question}"])


def calls_it_needs(report: dict[str, Any], supporting: set[str]) -> list[str]:
    """What is wrong with the calls BRAG made for one question with this reader (nothing: [])."""
    steps = [s for s in report["steps"] if s["action"]]
    reads = [s for s in steps if s["action"] in ("R1", "R2")]
    problems = []
    if report["totals"]["llm_calls"] != len(steps):
        problems.append(f"{report['totals']['llm_calls']} calls for {len(steps)} actions")
    # A read is right exactly when its prompt held every supporting passage: reading on after
    # such a read wastes a call, and so does a second closed-book call (its answer never changes).
    whole = [supporting <= {p["title"] for p in s["observation"]["passages"]} for s in reads]
    if True in whole and len(reads) > whole.index(True) + 1:
        problems.append(f"{len(reads) - whole.index(True) - 1} read(s) after the passages were all read")
    if [s["action"] for s in steps].count("CB") > 1:
        problems.append("closed-book asked more than once")
    # Each hop searches for what the reader said was missing (a supporting passage's title) and
    # brings that passage into its prompt.
    for before, hop in itertools.pairwise(reads):
        wanted = before["observation"]["follow_up_query"]
        if hop["observation"]["query"] != wanted:
            problems.append(f"a hop searched {hop['observation']['query']!r}, not the reader's {wanted!r}")
        if wanted in supporting and wanted not in {p["title"] for p in hop["observation"]["passages"]}:
            problems.append(f"a hop did not bring in {wanted!r}, which the reader asked for")
    return problems
