"""Which models and endpoints a caller may pick, and the backends built for them.

:class:`EndpointPolicy` bounds where a caller's model URL may point; :class:`ModelPolicy` which
models beyond URLs callers may pick and which the server's secrets pay for; :class:`LLMPool`
builds each backend once under both and shares it. No Gradio here.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import brag
from bragkit import llms

from .limits import refused

# An Inference Providers name, as a caller may give it ("auto", "together", ...).
PROVIDER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


@dataclass(frozen=True)
class EndpointPolicy:
    """Where a caller-chosen model URL may point (``BRAG_ALLOWED_ENDPOINTS``).

    Unset: any public http(s) host; loopback, private, link-local and multicast addresses are
    refused at connection time, by the address actually connected to. ``*``: anything (a local
    deployment). Otherwise a comma-separated list of URL prefixes; a URL must share a prefix's
    scheme, host and port and extend its path. The owner's model (``BRAG_MODEL``, else the
    default) is always allowed and is the only one that gets the server's secrets.
    """

    prefixes: tuple[str, ...] = ()
    allow_all: bool = False

    @classmethod
    def from_env(cls) -> EndpointPolicy:
        """The policy ``BRAG_ALLOWED_ENDPOINTS`` sets."""
        raw = os.environ.get("BRAG_ALLOWED_ENDPOINTS", "").strip()
        if raw == "*":
            return cls(allow_all=True)
        prefixes = tuple(p.strip() for p in raw.split(",") if p.strip())
        for prefix in prefixes:
            if urllib.parse.urlsplit(prefix).scheme not in ("http", "https"):
                raise SystemExit(f"BRAG_ALLOWED_ENDPOINTS: {llms.redact_url(prefix)} is not an http(s) URL")
        return cls(prefixes)

    def listed(self, url: str) -> bool:
        """True when ``url`` extends one of the allowed prefixes."""
        target = _url_parts(url)
        for prefix in self.prefixes:
            scheme, host, port, path = _url_parts(prefix)
            if target[:3] == (scheme, host, port) and (
                target[3] == path or target[3].startswith(path.rstrip("/") + "/")
            ):
                return True
        return False


def has_dot_segments(url: str) -> bool:
    """A path with ``.``/``..`` segments, backslashes or encoded slashes (in any encoding depth).

    Servers resolve these, so ``/tenantA/v1/../../tenantB`` would match the prefix ``/tenantA``
    and reach another tenant; they have no use in an endpoint URL, so they are refused.
    """
    path = urllib.parse.urlsplit(url).path
    for _ in range(4):  # %252e decodes to %2e, then to "."
        lowered = path.lower()
        if "\\" in path or "%2f" in lowered or "%5c" in lowered:
            return True
        if any(segment in (".", "..") for segment in path.split("/")):
            return True
        decoded = urllib.parse.unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True


@dataclass(frozen=True)
class ModelPolicy:
    """Which models callers may pick beyond URLs, and which of them the server's secrets pay for.

    The owner's default model (``BRAG_MODEL``, else the one :func:`llms.default_model` picks) is
    always offered and gets the server's secrets. ``BRAG_ALLOWED_MODELS`` lists more: Hugging
    Face model ids that the server's ``HF_TOKEN`` may pay for, and embedded models (``local``,
    ``local:smollm2``) that callers may start. Any other Hugging Face model needs the caller's
    own token; any other embedded model is refused.
    """

    default: str
    allowed: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls) -> ModelPolicy:
        """The policy ``BRAG_MODEL`` and ``BRAG_ALLOWED_MODELS`` set."""
        raw = os.environ.get("BRAG_ALLOWED_MODELS", "")
        listed = frozenset(_canonical_model(m) for m in raw.split(",") if m.strip())
        for spec in listed:
            if spec.startswith(("http://", "https://")):
                raise SystemExit(
                    "BRAG_ALLOWED_MODELS lists model names; endpoint URLs go in BRAG_ALLOWED_ENDPOINTS"
                )
        return cls(_canonical_model(llms.default_model()), listed)

    def owner(self, spec: str) -> bool:
        """True for the owner's default model."""
        return _canonical_model(spec) == self.default

    def listed(self, spec: str) -> bool:
        """True for the default and for every model the owner lists."""
        return self.owner(spec) or _canonical_model(spec) in self.allowed

    def describe(self) -> str:
        """The offered models, for an error message."""
        return ", ".join(sorted({llms.redact_url(self.default), *self.allowed}))


def _canonical_model(spec: str) -> str:
    spec = spec.strip()
    return "local" if spec == "local:qwen" else spec


def _url_parts(url: str) -> tuple[str, str, int | None, str]:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path or "/"


class LLMPool:
    """Backends reused across requests, one per (model, token, provider), built under the policy.

    Building an HTTP client costs about 0.1 s (TLS set-up), and every backend is thread-safe, so
    concurrent requests share one. Every request for the local model shares its one runner.
    """

    def __init__(self, policy: EndpointPolicy, models: ModelPolicy, size: int = 64) -> None:
        self._pool: OrderedDict[tuple[str, str, str], llms.LLM] = OrderedDict()
        self._lock = threading.Lock()
        self.policy, self.models = policy, models
        self.size = size

    def get(self, model: Any, hf_token: Any, provider: Any) -> llms.LLM:
        """The backend for this request, built on first use."""
        spec = model.strip() if isinstance(model, str) else ""
        spec = spec or llms.default_model()
        token = (hf_token.strip() if isinstance(hf_token, str) else "") or None
        provider = (provider.strip() if isinstance(provider, str) else "") or "auto"
        if len(spec) > 2_000:
            raise refused("The model name or URL is too long.")
        if not PROVIDER_NAME.match(provider):
            raise refused("provider must be an Inference Providers name such as 'auto' or 'together'.")
        key = (spec, hashlib.sha256((token or "").encode()).hexdigest(), provider)
        with self._lock:
            if key in self._pool:
                self._pool.move_to_end(key)
                return self._pool[key]
        try:
            llms.check_token(token)
            backend = self._build(spec, token, provider)
        except (brag.InputError, llms.LLMError) as err:
            raise refused(str(err)) from None
        with self._lock:
            backend = self._pool.setdefault(key, backend)
            while len(self._pool) > self.size:
                self._pool.popitem(last=False)
        return backend

    def _build(self, text: str, token: str | None, provider: str) -> llms.LLM:
        """The backend ``text`` names, read by the one parser ``make_llm`` uses (unknown: refused)."""
        spec = llms.parse_model(text)
        if self.models.owner(spec.text):
            return llms.make_llm(spec, token, provider)  # the server's own secrets may go there
        if spec.kind == "local":
            return self._local(spec)
        if spec.kind == "hosted":
            return self._hosted(spec, token, provider)
        if spec.kind == "endpoint":
            return self._endpoint(spec, token, provider)
        # A kind make_llm learns later is the owner's to offer: until this pool knows it, no.
        raise brag.InputError(f"model: {spec.kind} models are not offered on this server")

    def _endpoint(self, spec: llms.ModelSpec, token: str | None, provider: str) -> llms.LLM:
        """A caller's URL, within the owner's endpoint policy; it gets the caller's token or none."""
        if any(ch.isspace() for ch in spec.text) or not urllib.parse.urlsplit(spec.text).hostname:
            raise brag.InputError("model: that is not a valid http(s) URL")
        if has_dot_segments(spec.url):
            raise brag.InputError(
                "model: the URL's path may not hold '.' or '..' segments or encoded slashes"
            )
        if not self.policy.allow_all and self.policy.prefixes and not self.policy.listed(spec.url):
            raise llms.EndpointRefused(
                f"{llms.redact_url(spec.url)} is not an endpoint this server may call "
                "(BRAG_ALLOWED_ENDPOINTS)"
            )
        public_only = not self.policy.allow_all and not self.policy.prefixes
        return llms.make_llm(spec, token, provider, secrets_from_env=False, public_only=public_only)

    def _local(self, spec: llms.ModelSpec) -> llms.LLM:
        """An embedded model the owner offers: its default, or one ``BRAG_ALLOWED_MODELS`` lists."""
        if spec.is_path:
            names = ", ".join(["local", *(f"local:{name}" for name in llms.LOCAL_MODELS)])
            raise brag.InputError(f"model: a local model is named {names}; paths are not accepted here")
        if not self.models.listed(spec.text):
            raise llms.EndpointRefused(
                f"model: {spec.text} is not offered on this server (its owner lists models in "
                "BRAG_ALLOWED_MODELS)"
            )
        return llms.make_llm(spec)

    def _hosted(self, spec: llms.ModelSpec, token: str | None, provider: str) -> llms.LLM:
        """A Hugging Face model: the server's HF_TOKEN pays only for models the owner lists."""
        if self.models.listed(spec.text):
            return llms.make_llm(spec, token, provider)
        if token is None:
            raise llms.TokenRejected(
                f"model: {spec.text} needs your own HF token here; this server spends its own only on "
                f"{self.models.describe()} (BRAG_ALLOWED_MODELS)"
            )
        return llms.make_llm(spec, token, provider, secrets_from_env=False)
