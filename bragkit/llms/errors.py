"""What can go wrong in an LLM call (the tree in ``llms``' docstring), and which failures a retry may cure."""

from __future__ import annotations

from typing import Any


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


class Cancelled(LLMError):
    """The caller cancelled the request or went away, so the call was stopped (``transport.cancellable``)."""


class MalformedResponse(LLMError):
    """The server answered, but not with a chat completion."""


class RequestRejected(LLMError):
    """400/422: the server refused the request itself (a parameter it does not support)."""


class ResponseTooLarge(MalformedResponse):
    """The response body was over ``BRAG_MAX_RESPONSE_BYTES`` once decompressed."""


class CacheMiss(LLMError):
    """Replay mode found no cached response for a request."""


class EndpointRefused(LLMError):
    """The endpoint is not one this server may connect to (its policy, not the endpoint, said no)."""


class LocalModelCrashed(LLMError):
    """The worker process running the local model died (native crash, out of memory, killed)."""


class CacheDamaged(LLMError, ValueError):
    """The response cache file is not a readable SQLite database (not the LLM's fault).

    Also a ValueError: like a malformed input file, the user fixes it by replacing the file.
    """


class Retryable(Exception):
    """Internal: a transient failure worth another try, with the final error if it persists."""

    def __init__(self, final: LLMError, retry_after: float | None = None) -> None:
        super().__init__(str(final))
        self.final = final
        self.retry_after = retry_after


def http_error(status: int, detail: str, where: str, retry_after: float | None) -> Exception:
    """Map an HTTP status to the error a user sees (wrapped in Retryable when transient)."""
    detail = " ".join(detail.split())[:300]
    suffix = f": {detail}" if detail else ""
    if status in (401, 403):
        return TokenRejected(f"token rejected by {where} (HTTP {status}){suffix}")
    if 300 <= status < 400:
        return RequestRejected(
            f"{where} answered with a redirect (HTTP {status}); give the final URL instead"
        )
    if status == 404:
        return ModelNotFound(f"model or endpoint not found at {where} (HTTP 404){suffix}")
    if status == 429:
        return Retryable(RateLimited(f"rate limited by {where} (HTTP 429){suffix}"), retry_after)
    if status >= 500:
        return Retryable(EndpointUnreachable(f"{where} failed with HTTP {status}{suffix}"), retry_after)
    return RequestRejected(f"{where} rejected the request (HTTP {status}){suffix}")


def check_token(token: str | None) -> None:
    """Refuse a token that no server could accept, without echoing it (it may be a secret)."""
    if token and (len(token) > 4096 or any(ch.isspace() or not ch.isprintable() for ch in token)):
        raise TokenRejected("the token holds spaces, line breaks or other control characters; paste it again")


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form), if any."""
    try:
        value = headers.get("retry-after") if headers is not None else None
        return max(float(value), 0.0) if value is not None else None
    except (TypeError, ValueError):
        return None
