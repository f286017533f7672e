"""The remote backends, both through the guarded transport.

``OpenAICompatible`` speaks to any OpenAI-compatible endpoint (``openai``); ``HFInference`` to
Hugging Face Inference Providers (``huggingface_hub``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar, copy_context
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import httpx2

from brag import Completion

from .calls import CallOptions, completion_from, field_of, token_logprobs
from .errors import (
    EndpointRefused,
    EndpointUnreachable,
    LLMError,
    LLMTimeout,
    MalformedResponse,
    ModelNotFound,
    RequestRejected,
    Retryable,
    TokenRejected,
    check_token,
    http_error,
    retry_after_seconds,
)
from .transport import (
    DEADLINE,
    GuardedTransport,
    Refused,
    RetryPolicy,
    deadline,
    in_chain,
    max_response_bytes,
    redact_url,
    time_left,
)


@dataclass
class RemoteBackend:
    """The base of an HTTP backend: retries, deadlines, and n samples natively or in parallel.

    A subclass implements :meth:`_request` (one HTTP exchange for ``options.n`` texts, raising an
    ``LLMError``), sets :attr:`where` (the endpoint in words, credentials redacted: errors name
    it) and declares in :attr:`secret_env` the environment variables it may read a credential
    from: the app scrubs their values from every text it returns (:func:`secret_env_names`).
    Its HTTP goes through :meth:`http_client`, whose sockets hold the call's deadline, whose
    responses are capped at ``BRAG_MAX_RESPONSE_BYTES``, which follows no redirect, and which
    with ``public_only`` connects to public addresses alone (a caller's URL): a client of its
    own has none of these.
    """

    # The environment variables a backend of this class may send as credentials.
    secret_env: ClassVar[tuple[str, ...]] = ()

    name: str
    timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_parallel: int = 8
    native_n: bool | None = None  # learnt on the first request with n > 1
    logprobs: bool | None = None  # whether the server gives token log-probabilities (learnt)
    where: str = field(default="", init=False)  # the endpoint, as errors name it

    def http_client(self, public_only: bool = False, max_bytes: int | None = None) -> httpx2.Client:
        """An HTTP client over the guarded transport: deadline-bound, capped, no redirects.

        ``public_only``: refuse to connect to any address that is not public (a URL a caller
        chose; the check is on the address connected to). Environment proxies are used only
        for the owner's own endpoints.
        """
        cap = max_response_bytes() if max_bytes is None else max_bytes
        return httpx2.Client(
            transport=GuardedTransport(public_only=public_only, max_bytes=cap),
            follow_redirects=False,  # an allowed URL cannot hand the call elsewhere
            trust_env=not public_only,
            timeout=self.timeout,
        )

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        """One HTTP exchange for ``options.n`` texts (raising an ``LLMError`` subclass)."""
        raise NotImplementedError

    def _send(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        def attempt() -> Completion:
            time_left()  # a call that would start after the deadline fails at once
            outer = DEADLINE.get()
            try:
                with deadline(self.timeout):  # the whole HTTP exchange, not each read
                    return self._request(messages, options)
            except LLMTimeout:
                if outer is not None and time.monotonic() >= outer - 0.05:
                    raise LLMTimeout(
                        f"the time limit for this request ran out waiting for {self.where}"
                    ) from None
                raise

        return self.retry.run(attempt)

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """``n`` samples as one request where the server supports ``n``, else in parallel."""
        call = CallOptions(**options)
        if call.n <= 1:
            return self._send(messages, replace(call, n=1))
        if self.native_n is False:
            return self._parallel(messages, call, offset=0)
        try:
            first = self._send(messages, call)
        except RequestRejected:
            if self.native_n:
                raise
            self.native_n = False
            return self._parallel(messages, call, offset=0)
        if len(first.texts) >= call.n:
            self.native_n = True
            logprobs = first.logprobs[: call.n] if first.logprobs is not None else None
            return replace(first, texts=first.texts[: call.n], logprobs=logprobs)
        self.native_n = False  # the server ignored n (Ollama, some providers): top up in parallel
        rest = self._parallel(messages, replace(call, n=call.n - len(first.texts)), offset=1)
        return _merge([first, rest])

    def _parallel(self, messages: list[dict[str, str]], call: CallOptions, offset: int) -> Completion:
        seeds = [None if call.seed is None else call.seed + offset + i for i in range(call.n)]
        with ThreadPoolExecutor(max_workers=min(call.n, self.max_parallel)) as pool:
            # Each sample runs in a copy of this context, so it keeps the caller's deadline.
            futures = [
                pool.submit(copy_context().run, self._send, messages, replace(call, n=1, seed=s))
                for s in seeds
            ]
            parts = [future.result() for future in futures]
        return _merge(parts)

    def _with_logprobs(self, send: Callable[[dict[str, Any]], Any]) -> Any:
        """Ask for token log-probabilities unless the server refused them; then stop asking.

        They are evidence for an answer's confidence, never a reason for a call to fail.
        """
        if self.logprobs is False:
            return send({})
        try:
            return send({"logprobs": True})
        except RequestRejected as err:
            # Only a refusal that names them is about them (and only before they ever came).
            if self.logprobs or "logprob" not in str(err).lower():
                raise
            self.logprobs = False
            return send({})

    def _noting_logprobs(self, completion: Completion) -> Completion:
        if completion.logprobs is not None:
            self.logprobs = True
        return completion


def _fault(err: Exception) -> str:
    """What was wrong with a response, in words: a parser's own message can quote any of it."""
    if isinstance(err, json.JSONDecodeError):
        return "its body is not JSON"
    if isinstance(err, ValueError):
        return "its JSON is not a chat completion, or holds a number past what a JSON reader takes"
    return type(err).__name__


def _choice_logprobs(choices: list[Any], max_tokens: int) -> list[list[tuple[str, float]]] | None:
    """Each choice's ``logprobs.content`` as (token, log-probability) pairs; None if any lacks them."""
    raw = [field_of(field_of(choice, "logprobs") or {}, "content") for choice in choices]
    return token_logprobs(raw, len(choices), max_tokens)


def _merge(parts: list[Completion]) -> Completion:
    logprobs = [p.logprobs for p in parts]
    return Completion(
        [t for p in parts for t in p.texts],
        sum(p.prompt_tokens for p in parts),
        sum(p.completion_tokens for p in parts),
        estimated=any(p.estimated for p in parts),
        requests=sum(p.requests for p in parts),
        logprobs=None if any(lp is None for lp in logprobs) else [t for lp in logprobs if lp for t in lp],
    )


@dataclass
class OpenAICompatible(RemoteBackend):
    """An OpenAI-compatible chat-completions endpoint (``base_url`` ends in ``/v1`` usually)."""

    secret_env: ClassVar[tuple[str, ...]] = ("OPENAI_API_KEY",)

    base_url: str = ""
    model: str | None = None  # served model name; asked from GET /models when None
    api_key: str | None = None
    secrets_from_env: bool = True  # with no api_key, send OPENAI_API_KEY from the environment
    public_only: bool = False  # connect only to public addresses (a caller-chosen URL)
    max_response_bytes: int = field(default_factory=max_response_bytes)

    def __post_init__(self) -> None:
        import openai

        check_token(self.api_key)
        key = self.api_key or (os.environ.get(self.secret_env[0]) if self.secrets_from_env else None)
        self._openai = openai
        self.where = redact_url(self.base_url)
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=key or "not-needed",
            timeout=self.timeout,
            max_retries=0,  # RetryPolicy decides, so Retry-After and the bounds are ours
            http_client=self.http_client(self.public_only, self.max_response_bytes),
        )
        self._lock = threading.Lock()

    def _classify(self, err: Exception) -> Exception:
        openai = self._openai
        where = self.where
        refused = in_chain(err, Refused)
        if refused is not None:
            return EndpointRefused(f"{where} is not allowed: {refused}")
        own = in_chain(err, LLMError)  # raised while reading the body (too large, corrupt)
        if own is not None:
            return own
        if isinstance(err, openai.APITimeoutError):
            return LLMTimeout(f"{where} did not answer in time (at most {self.timeout:g} s per call)")
        if isinstance(err, openai.APIConnectionError):
            return Retryable(EndpointUnreachable(f"cannot reach {where}: {err.__cause__ or err}"))
        if isinstance(err, openai.APIStatusError):
            detail = getattr(err, "message", "") or ""
            return http_error(err.status_code, detail, where, retry_after_seconds(err.response.headers))
        return MalformedResponse(f"{where} sent a malformed response ({_fault(err)})")

    def served_model(self) -> str:
        """The model name to request: given, or the first one ``GET /models`` lists."""
        with self._lock:
            if self.model is None:

                def listing() -> list[Any]:
                    with deadline(self.timeout):
                        return self._wrap(lambda: list(self._client.models.list()))

                models = self.retry.run(listing)
                if not models or not getattr(models[0], "id", None):
                    raise MalformedResponse(f"{self.where}/models lists no model; name one as URL#model")
                self.model = models[0].id
            return self.model

    def _wrap(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except LLMError:
            raise
        except Exception as err:
            raise self._classify(err) from None

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        model = self.served_model()
        kwargs = options.request_fields()
        response = self._with_logprobs(
            lambda extra: self._wrap(
                lambda: self._client.chat.completions.create(
                    model=model, messages=messages, **kwargs, **extra
                )
            )
        )
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse(f"{self.where} returned no choices")
        texts = []
        for choice in choices[: options.n]:  # a server may send more than asked for
            content = getattr(getattr(choice, "message", None), "content", None)
            if not isinstance(content, str):
                raise MalformedResponse(f"{self.where} returned a choice without message content")
            texts.append(content)
        completion = completion_from(texts, getattr(response, "usage", None), messages)
        return self._noting_logprobs(
            replace(completion, logprobs=_choice_logprobs(choices[: options.n], options.max_tokens))
        )


@dataclass
class HFInference(RemoteBackend):
    """Hugging Face Inference Providers chat completion (or any ``base_url`` speaking it)."""

    secret_env: ClassVar[tuple[str, ...]] = ("HF_TOKEN",)  # make_llm reads it for the token

    model: str | None = None
    token: str | None = None
    provider: str = "auto"
    base_url: str | None = None

    def __post_init__(self) -> None:
        from huggingface_hub import InferenceClient

        check_token(self.token)
        bound_hub_calls()
        self.where = (
            redact_url(self.base_url)
            if self.base_url
            else f"Hugging Face Inference ({self.model}, provider {self.provider})"
        )
        if self.base_url:
            self._client = InferenceClient(base_url=self.base_url, api_key=self.token, timeout=self.timeout)
        else:
            self._client = InferenceClient(
                model=self.model, provider=self.provider, api_key=self.token, timeout=self.timeout
            )

    def _classify(self, err: Exception) -> Exception:
        from huggingface_hub.errors import HfHubHTTPError, InferenceTimeoutError

        where = self.where
        own = in_chain(err, LLMError)  # raised while reading the body (too large, corrupt)
        if own is not None:
            return own
        if isinstance(err, InferenceTimeoutError | httpx2.TimeoutException):
            return LLMTimeout(f"{where} did not answer in time (at most {self.timeout:g} s per call)")
        if isinstance(err, HfHubHTTPError) and err.response is not None:
            detail = getattr(err, "server_message", None) or ""
            return http_error(
                err.response.status_code, detail, where, retry_after_seconds(err.response.headers)
            )
        if isinstance(err, httpx2.TransportError | ConnectionError):
            return Retryable(EndpointUnreachable(f"cannot reach {where}: {err}"))
        if isinstance(err, ValueError) and "api_key" in str(err):  # asked for before any request
            return TokenRejected(f"{where} needs a Hugging Face token: give one, or set HF_TOKEN")
        if isinstance(err, ValueError) and "provider" in str(err).lower():
            return ModelNotFound(f"{where}: {err}")
        return MalformedResponse(f"{where} sent a malformed response ({_fault(err)})")

    def _request(self, messages: list[dict[str, str]], options: CallOptions) -> Completion:
        kwargs = options.request_fields()

        def send(extra: dict[str, Any]) -> Any:
            named = _NAMED_SERVER.set(self.base_url)
            try:
                return self._client.chat_completion(messages, **kwargs, **extra)
            except LLMError:
                raise
            except Exception as err:
                raise self._classify(err) from None
            finally:
                _NAMED_SERVER.reset(named)

        response = self._with_logprobs(send)
        try:
            choices = list(response.choices[: options.n])
            texts = [choice.message.content for choice in choices]
        except (AttributeError, TypeError) as err:
            raise MalformedResponse(f"{self.where} sent a malformed response ({_fault(err)})") from None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise MalformedResponse(f"{self.where} returned no message content")
        completion = completion_from(texts, getattr(response, "usage", None), messages)
        return self._noting_logprobs(
            replace(completion, logprobs=_choice_logprobs(choices, options.max_tokens))
        )


_HUB_BOUND = False
_HUB_LOCK = threading.Lock()
# The server an HFInference call was given by URL (``base_url``), while it runs: the Hub's own
# offline switch (HF_HUB_OFFLINE) is about the Hub, not a server the caller named.
_NAMED_SERVER: ContextVar[str | None] = ContextVar("brag_hf_named_server", default=None)


def _hub_request_hook(request: httpx2.Request) -> Any:
    """The hub library's own hook, but for a request to the server an HFInference call named."""
    from huggingface_hub.utils._http import hf_request_event_hook  # what the stock client hooks in

    named = _NAMED_SERVER.get()
    if named:
        base = httpx2.URL(named)
        path = base.path.rstrip("/")
        same_server = (request.url.scheme, request.url.host, request.url.port) == (
            base.scheme,
            base.host,
            base.port,
        )
        if same_server and (request.url.path == path or request.url.path.startswith(path + "/")):
            return None
    return hf_request_event_hook(request)


def bound_hub_calls() -> None:
    """Make ``huggingface_hub`` (and so :class:`HFInference`) open deadline-bound sockets.

    The hub library shares one HTTP client that it builds itself; this swaps in one with the
    same settings over :class:`GuardedTransport`, so :func:`deadline` holds for Inference
    Providers calls too, and inference responses are capped at ``BRAG_MAX_RESPONSE_BYTES``.
    Every :class:`HFInference` calls it; later calls do nothing.
    """
    global _HUB_BOUND
    with _HUB_LOCK:
        if _HUB_BOUND:
            return
        _HUB_BOUND = True
    from huggingface_hub import set_client_factory

    cap = max_response_bytes()

    def factory() -> httpx2.Client:
        return httpx2.Client(
            # Inference calls are POSTs; the owner's corpus downloads (GET) are not capped.
            transport=GuardedTransport(max_bytes=cap, capped_methods=frozenset({"POST"})),
            event_hooks={"request": [_hub_request_hook]},
            follow_redirects=True,
            timeout=None,
        )

    set_client_factory(factory)


def secret_env_names() -> tuple[str, ...]:
    """Every environment variable a remote backend declares it may send as a credential.

    Each subclass of :class:`RemoteBackend` (at any depth, defined anywhere) counts, so a new
    backend's credential is scrubbed from what the app returns as soon as it declares it.
    """
    found: dict[str, None] = {}
    pending: list[type[RemoteBackend]] = [RemoteBackend]
    while pending:
        cls = pending.pop(0)
        found.update(dict.fromkeys(cls.secret_env))
        pending.extend(cls.__subclasses__())
    return tuple(found)
