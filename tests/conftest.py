"""Shared test helpers: a scripted in-process LLM and the shared data directory."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# No test reaches the Hub: a backend or a download that tried would fail here as it would offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The hand-set priors the shipped calibration started from: tests whose expectations rest on
# particular reliabilities use these, so refitting data/calibration.json cannot move them.
PRIORS = ROOT / "tests" / "prior_calibration.json"

import brag
from bragkit import storage


class ScriptedLLM:
    """An LLM whose replies are functions of the prompt; records every request.

    ``read(prompt)`` answers R1/R2 prompts, ``closed_book(prompt, n)`` answers CB prompts with n
    texts. Usage is reported per request as fixed numbers so totals can be checked.
    """

    def __init__(
        self,
        read: Callable[[str], str],
        closed_book: Callable[[str, int], list[str]] | None = None,
        prompt_tokens: int = 100,
        completion_tokens: int = 7,
        logprob: Callable[[str], float] | None = None,
    ) -> None:
        self.read = read
        # With ``logprob``, each word of a read's reply comes back as one token of that
        # log-probability (given the reply), as a backend that reports them would send it.
        self.logprob = logprob
        self.closed_book = closed_book or (lambda prompt, n: ["NONE"] * n)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.requests: list[dict] = []

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        prompt = messages[-1]["content"]
        self.requests.append({"messages": messages, "n": n, "temperature": temperature})
        if messages[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS:
            texts = self.closed_book(prompt, n)
        else:
            texts = [self.read(prompt)]
        assert len(texts) == n
        logprobs = None
        if self.logprob is not None and messages[0]["content"] != brag.CLOSED_BOOK_INSTRUCTIONS:
            logprobs = [
                [(piece, self.logprob(text)) for piece in re.findall(r"\s*\S+", text)] for text in texts
            ]
        return brag.Completion(texts, self.prompt_tokens, self.completion_tokens * n, logprobs=logprobs)


def without(report: Any, keys: set[str]) -> Any:
    """A report with ``keys`` removed at every depth (what a run measures afresh, say)."""
    if isinstance(report, dict):
        return {k: without(v, keys) for k, v in report.items() if k not in keys}
    if isinstance(report, list):
        return [without(v, keys) for v in report]
    return report


def last_block(prompt: str) -> str:
    """The part of a prompt after the worked examples: the real passages and question."""
    return prompt.rsplit("\n\nPassages:\n", 1)[-1]


@pytest.fixture
def shared_data() -> Path:
    path = storage.data_dir()
    if path is None or not path.is_dir():
        pytest.skip("shared evaluation data not found (set BRAG_DATA_DIR)")
    return path
