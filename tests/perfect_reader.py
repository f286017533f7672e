"""A perfect multi-hop reader behind a loopback OpenAI-compatible endpoint.

It knows each question's gold answer and supporting passages. A read answers right exactly when
every supporting passage is in its prompt; otherwise it says NONE and proposes, as its follow-up
query, the title of a supporting passage it has not seen. Closed-book, it always gives the same
wrong answer with full agreement. This is the check of the controller the issue describes: a
controller that reads when reading pays answers nearly everything such a reader can.
"""

from __future__ import annotations

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
