"""What every backend shares: one call's options, a completion, its token log-probabilities."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from brag import Completion


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


# More tokens than any request could use: a usage past it is an endpoint's error or its joke.
MAX_USAGE_TOKENS = 100_000_000


def _token_count(value: Any) -> int | None:
    """A usage field as a count of tokens: a whole number from 0 to MAX_USAGE_TOKENS, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_USAGE_TOKENS:
        return None
    return value


def completion_from(texts: list[str], usage: Any, messages: list[dict[str, str]]) -> Completion:
    """A Completion from texts and a server usage object.

    Estimated when the server gave none, or gave counts no request could have (negative,
    fractional, or past ``MAX_USAGE_TOKENS``): a report's totals are never a server's fiction.
    """
    prompt = _token_count(getattr(usage, "prompt_tokens", None)) if usage is not None else None
    completion = _token_count(getattr(usage, "completion_tokens", None)) if usage is not None else None
    if prompt is not None and completion is not None:
        return Completion(texts, prompt, completion)
    estimate_prompt = sum(_estimate_tokens(m.get("content", "")) for m in messages)
    estimate_completion = sum(_estimate_tokens(t) for t in texts)
    return Completion(texts, estimate_prompt, estimate_completion, estimated=True)


def token_logprobs(raw: Any, n_texts: int, max_tokens: int) -> list[list[tuple[str, float]]] | None:
    """Per text, its tokens as (piece, log-probability); None when any part is missing or malformed.

    Accepts the worker's ``[[piece, logprob], ...]`` lists and OpenAI's ``logprobs.content``
    entries (objects or dicts with ``token`` and ``logprob``). A backend's log-probabilities are
    evidence, never required: anything unexpected makes them absent, not the call a failure.
    """
    if not isinstance(raw, list) or len(raw) != n_texts:
        return None
    out: list[list[tuple[str, float]]] = []
    for tokens in raw:
        if not isinstance(tokens, list):
            return None
        pieces = []
        for token in tokens[: max_tokens + 1]:
            if isinstance(token, (list, tuple)) and len(token) == 2:
                piece, logprob = token
            else:
                piece, logprob = field_of(token, "token"), field_of(token, "logprob")
            if (
                not isinstance(piece, str)
                or isinstance(logprob, bool)
                or not isinstance(logprob, (int, float))
            ):
                return None
            if math.isnan(logprob) or logprob > 1e-3:  # a probability above 1 is no probability
                return None
            pieces.append((piece[:MAX_TOKEN_PIECE_CHARS], min(0.0, max(float(logprob), MIN_LOGPROB))))
        out.append(pieces)
    return out


MAX_CACHED_TOKENS = 4096  # what a cache entry may hold per text (a request asks far fewer)
MAX_TOKEN_PIECE_CHARS = 64  # a token is a few characters; a longer "piece" is cut
MIN_LOGPROB = -100.0  # -inf (a token the server says it could not have chosen) is floored here


@dataclass(frozen=True)
class CallOptions:
    """One call's options, as ``brag.LLM.complete`` takes them by keyword.

    Every backend's ``complete(messages, **options)`` builds one, so the protocol's signature
    is written once (in brag.py) and an unknown option is a TypeError naming it.
    """

    n: int = 1
    temperature: float = 0.0
    max_tokens: int = 64
    stop: list[str] | None = None
    seed: int | None = None

    def request_fields(self) -> dict[str, Any]:
        """What a chat-completions request carries: the options that are set."""
        fields: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.n > 1:
            fields["n"] = self.n
        if self.stop:
            fields["stop"] = self.stop
        if self.seed is not None:
            fields["seed"] = self.seed
        return fields


def field_of(item: Any, name: str) -> Any:
    """A field of a parsed response part, whether the client gave a dict or an object."""
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)
