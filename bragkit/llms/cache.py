"""A SQLite response cache around any backend, with record, replay and backfill modes."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import brag
from brag import LLM, Completion

from .calls import MAX_CACHED_TOKENS, CallOptions, token_logprobs
from .errors import CacheDamaged, CacheMiss

# ------------------------------------------------------------------------------------------

CACHE_MODES = ("read-write", "replay", "off", "retime", "backfill")


def request_key(
    model: str,
    messages: list[dict[str, str]],
    n: int,
    temperature: float,
    max_tokens: int,
    stop: list[str] | None,
    seed: int | None,
) -> str:
    """SHA-256 of everything that determines a response; the prompt text itself is not stored."""
    payload = {
        "model": model,
        "messages": messages,
        "n": n,
        "temperature": round(float(temperature), 6),
        "max_tokens": max_tokens,
        "stop": stop or [],
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class CachedLLM:
    """Store every response in SQLite keyed by a request hash; ``replay`` turns a miss into an error.

    Safe under concurrent threads (one connection behind a lock; the LLM call runs outside it)
    and processes (WAL journal, busy timeout). When two threads miss on the same key, the first
    stored response wins and both return it, so a replay sees what the run saw.

    Each entry keeps the call's latency, so replayed runs can still report LLM time. ``retime``
    is read-write that re-issues a hit with no stored latency once, to record it; the stored
    texts are kept, so results never change.

    Each entry keeps the tokens' log-probabilities when the backend gave them. ``backfill`` is
    read-write that re-issues a greedy (temperature 0) hit stored without them, once, and keeps
    them only when the new texts are the stored ones, so a replay's answers never change.
    """

    def __init__(
        self, llm: LLM, path: str | os.PathLike[str], *, model: str | None = None, mode: str = "read-write"
    ):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        self.llm, self.mode = llm, mode
        self.model = model or brag.llm_name(llm)
        self.name = self.model
        self.hits = self.misses = 0
        self.backfilled = self.mismatched = 0  # backfill: log-probabilities stored, or not (texts differed)
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if mode != "off":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._damage():
                self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
                if self._db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise sqlite3.DatabaseError("integrity check failed")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, texts TEXT NOT NULL, "
                    "prompt_tokens INTEGER, completion_tokens INTEGER, estimated INTEGER, requests INTEGER, "
                    "seconds REAL)"
                )
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
                if "seconds" not in columns:  # a cache written before latencies were stored
                    self._db.execute("ALTER TABLE responses ADD COLUMN seconds REAL")
                if "logprobs" not in columns:  # ... or before log-probabilities were
                    self._db.execute("ALTER TABLE responses ADD COLUMN logprobs TEXT")
                self._db.commit()

    @contextmanager
    def _damage(self) -> Iterator[None]:
        """Turn SQLite's errors about the file into one that names it and says what to do."""
        try:
            yield
        except (sqlite3.DatabaseError, json.JSONDecodeError, TypeError) as err:
            if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
                raise
            raise CacheDamaged(
                f"response cache {self.path} is damaged ({err}): delete it to fetch every response "
                "again, or restore it from version control"
            ) from None

    def _get(self, key: str) -> Completion | None:
        assert self._db is not None
        with self._lock, self._damage():
            row = self._db.execute(
                "SELECT texts, prompt_tokens, completion_tokens, estimated, requests, seconds, logprobs "
                "FROM responses WHERE key = ?",
                (key,),
            ).fetchone()
            texts = json.loads(row[0]) if row is not None else None
            logprobs = json.loads(row[6]) if row is not None and row[6] is not None else None
        if row is None:
            return None
        return Completion(
            texts,
            row[1],
            row[2],
            cached=True,
            estimated=bool(row[3]),
            requests=row[4],
            seconds=row[5],
            logprobs=token_logprobs(logprobs, len(texts), max_tokens=MAX_CACHED_TOKENS),
        )

    def _stale(self, hit: Completion, options: CallOptions) -> bool:
        """Whether this mode re-issues a hit: no latency (retime), no log-probabilities (backfill)."""
        if self.mode == "retime":
            return hit.seconds is None
        return self.mode == "backfill" and hit.logprobs is None and options.temperature == 0

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """A cached response when there is one, else the wrapped LLM's (stored for next time)."""
        call = CallOptions(**options)
        kwargs = asdict(call)
        if self._db is None:
            return self.llm.complete(messages, **kwargs)
        key = request_key(self.model, messages, **kwargs)
        hit = self._get(key)
        if hit is not None and not self._stale(hit, call):
            with self._lock:
                self.hits += 1
            return hit
        if self.mode == "replay":
            raise CacheMiss(f"replay: no cached response for request {key[:12]} (model {self.model})")
        if hit is not None and self.mode == "backfill":
            return self._backfill(key, hit, messages, kwargs)
        t0 = time.perf_counter()
        fresh = self.llm.complete(messages, **kwargs)
        seconds = time.perf_counter() - t0 if fresh.seconds is None else fresh.seconds
        if hit is not None:  # retime: record the latency, keep the stored texts
            self._update(key, "seconds", seconds)
            return replace(hit, seconds=seconds)
        with self._lock, self._damage():
            self.misses += 1
            self._db.execute(
                "INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    json.dumps(fresh.texts),
                    fresh.prompt_tokens,
                    fresh.completion_tokens,
                    int(fresh.estimated),
                    fresh.requests,
                    seconds,
                    json.dumps(fresh.logprobs) if fresh.logprobs is not None else None,
                ),
            )
            self._db.commit()
        stored = self._get(key)
        assert stored is not None
        return replace(stored, cached=False)

    def _backfill(
        self, key: str, hit: Completion, messages: list[dict[str, str]], kwargs: dict[str, Any]
    ) -> Completion:
        """A stored greedy response, with the log-probabilities of its own texts added.

        A backend that can score a given text (the embedded model) scores the stored texts; any
        other is asked again, and its log-probabilities are kept only if it wrote the same texts.
        """
        score = getattr(self.llm, "score", None)
        if callable(score):
            logprobs = score(messages, hit.texts)
        else:
            fresh = self.llm.complete(messages, **kwargs)
            logprobs = fresh.logprobs if fresh.texts == hit.texts else None
        if logprobs is None:
            self.mismatched += 1
            return hit
        self._update(key, "logprobs", json.dumps(logprobs))
        self.backfilled += 1
        return replace(hit, logprobs=logprobs)

    def _update(self, key: str, column: str, value: Any) -> None:
        assert self._db is not None and column in ("seconds", "logprobs")
        with self._lock, self._damage():
            self.hits += 1
            self._db.execute(f"UPDATE responses SET {column} = ? WHERE key = ?", (value, key))
            self._db.commit()

    def close(self) -> None:
        """Close the database."""
        if self._db is not None:
            self._db.close()
            self._db = None
