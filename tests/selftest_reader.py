"""A reader that can pass a self-test: it writes the question for a blanked sentence, and fills it.

In-process (``SelfTestReader``) and behind a loopback OpenAI-compatible server (``reply``).
"""

from __future__ import annotations

import re

import brag

# Passages about made-up tools, each with answers of known shapes no other passage holds.
SENTENCES = [
    "The frobnicate program reads its settings from the FROB_CONF variable when it starts.",
    "Quuxify rotates its journal once it holds 4096 records, unless told otherwise on start.",
    "Every blarg archive is written below the /var/spool/blarg directory by the nightly job.",
    "To print only warnings, zorch accepts the --quiet-mode flag on its command line today.",
    "Wibble ignores files listed in its exclusion table, which the WIBBLE_SKIP setting names.",
    "A plonk server answers health checks on port 8421 after its workers have come up fully.",
    "Snarf compresses old reports with the gzip_level knob set in its main configuration file.",
    "The grault daemon gives up on a stalled peer after 75 seconds and logs that it did so.",
    "Fnord stores each user's bookmarks in ~/.fnordrc, a plain file with one entry per line.",
    "Xyzzy builds its search index with the make_index() helper before answering any query.",
    "Garply writes a crash report to the GARPLY_DUMP_DIR folder whenever a worker dies badly.",
    "The waldo scheduler starts at most 12 jobs at once and queues every job after those.",
]
PASSAGES = [{"title": f"manual part {i}", "text": text} for i, text in enumerate(SENTENCES)]
GENERATOR = "You turn a fill-in-the-blank"


def cloze_of(question: str) -> str:
    return re.search(r"'(.*)'", question).group(1)


def replies(
    messages: list[dict], n: int, wrong: str = "", copy: bool = False, vague: bool = False
) -> list[str]:
    """What the reader says to ``messages``: see :class:`SelfTestReader`."""
    system, prompt = messages[0]["content"], messages[-1]["content"]
    if system.startswith(GENERATOR):
        cloze = prompt.removeprefix("Sentence: ")
        if vague:
            return ["Question: What is the colour of the sky on a summer day?"]
        if copy:  # the sentence it came from, answer and all
            before, _, after = cloze.partition("____")
            whole = next(t for t in SENTENCES if t.startswith(before) and t.endswith(after))
            return [f"Question: Is it true that {whole}?"]
        return [f"Question: What completes '{cloze}'?"]
    if system == brag.CLOSED_BOOK_INSTRUCTIONS:
        return ["Answer: NONE"] * n
    question = prompt.rsplit("Question: ", 1)[-1]
    if wrong:
        return [f"Answer: {wrong}\nFollow-up query: x"]
    if "'" not in question:
        return ["Answer: NONE\nFollow-up query: x"]
    before, _, after = cloze_of(question).partition("____")
    found = re.search(re.escape(before.strip()) + r"\s*(.+?)\s*" + re.escape(after.strip()), prompt)
    answer = found.group(1) if found else "NONE"
    return [f"Answer: {answer}\nFollow-up query: {answer}"]


class SelfTestReader:
    """The generator asks for the blank of the sentence it was shown; a read fills it from its passages.

    ``wrong``: reads answer this instead (the roundtrip fails); ``copy``: the generator's question
    holds the answer; ``vague``: the question is about nothing in the corpus.
    """

    def __init__(self, wrong: str = "", copy: bool = False, vague: bool = False) -> None:
        self.wrong, self.copy, self.vague = wrong, copy, vague
        self.calls: list[str] = []
        self.name = "selftest-reader"

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        system = messages[0]["content"]
        kind = (
            "generate"
            if system.startswith(GENERATOR)
            else "closed-book"
            if system == brag.CLOSED_BOOK_INSTRUCTIONS
            else "read"
        )
        self.calls.append(kind)
        return brag.Completion(replies(messages, n, self.wrong, self.copy, self.vague))


class WideReadsErr(SelfTestReader):
    """Right on a read of one passage (so its questions pass the roundtrip), wrong on every
    ``every``-th read of several; no token log-probabilities, as many backends give none."""

    def __init__(self, every: int = 3) -> None:
        super().__init__()
        self.every, self.reads = every, 0

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        prompt = messages[-1]["content"]
        if messages[0]["content"] != brag.CLOSED_BOOK_INSTRUCTIONS and "[2]" in prompt:
            self.reads += 1
            if self.reads % self.every == 0:
                self.calls.append("read")
                return brag.Completion(["Answer: a wrong guess\nFollow-up query: x"])
        return super().complete(messages, n=n, temperature=temperature, max_tokens=max_tokens, stop=stop)
