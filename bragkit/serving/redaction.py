"""What leaves the server: its secrets scrubbed from every text, and JSON any encoder takes.

Errors, answers, reports, streamed events and log lines all pass :meth:`Secrets.scrub`; a report
passes :func:`json_safe` before Gradio encodes it. No Gradio here.
"""

from __future__ import annotations

import base64
import math
import os
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

from bragkit import llms


class Secrets:
    """The server's own secret values, and their scrubbing from every text that leaves the server.

    The values are every remote backend's declared credentials (``llms.secret_env_names``:
    ``HF_TOKEN``, ``OPENAI_API_KEY``), ``BRAG_MILVUS_TOKEN`` and the credentials inside ``BRAG_MODEL``'s
    URL, each also in base64 (the form an ``Authorization: Basic`` header carries, which some
    proxies repeat in their error pages). Errors, answers, reports, streamed events and log
    lines all pass :meth:`scrub`.
    """

    MIN_LENGTH = 6  # shorter values would scrub ordinary words

    def __init__(self, values: Iterable[str]) -> None:
        wanted = {v for v in values if len(v) >= self.MIN_LENGTH}
        forms = wanted | {base64.b64encode(v.encode()).decode() for v in wanted}
        forms |= {f.rstrip("=") for f in forms}
        ordered = sorted(forms, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @classmethod
    def from_env(cls) -> Secrets:
        """The secrets this server holds in its environment."""
        # Each backend's declared credentials, and the Milvus server's token.
        names = (*llms.secret_env_names(), "BRAG_MILVUS_TOKEN")
        values = [os.environ.get(name, "") for name in names]
        model = os.environ.get("BRAG_MODEL", "").strip()
        if "://" in model:  # an endpoint URL, of any backend's scheme (http, https, scheme+https...)
            netloc = urllib.parse.urlsplit(model).netloc
            if "@" in netloc:
                userinfo = netloc.rpartition("@")[0]
                user, _, password = userinfo.partition(":")
                values += [userinfo, urllib.parse.unquote(userinfo), password, urllib.parse.unquote(password)]
                values.append(f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}")
        return cls(values)

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        return self.pattern.sub("***", text) if self.pattern is not None and text else text

    def scrub_data(self, value: Any) -> Any:
        """Every string inside a JSON-like value, scrubbed (a new value; the input is not changed)."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub_data(k): self.scrub_data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_data(v) for v in value]
        return value


# JSON any encoder takes (Gradio's orjson among them): whole numbers within 53 bits (a float's),
# finite floats, string keys, at most this deep.
MAX_JSON_DEPTH = 32
_MAX_SAFE_INT = 2**53


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as any JSON encoder takes it; a part it would refuse becomes a short description.

    A report carries numbers from backends and calibrations a caller chose: one integer past
    64 bits, a NaN or a list nested 300 deep makes Gradio's encoder fail the whole response.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        within = -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT
        return value if within else f"(an integer of {value.bit_length()} bits)"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_JSON_DEPTH:
        return "(nested too deeply)"
    if isinstance(value, dict):
        return {_json_key(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, depth + 1) for v in value]
    return f"({type(value).__name__})"


def _json_key(key: Any) -> str:
    return key if isinstance(key, str) else str(json_safe(key, MAX_JSON_DEPTH))
