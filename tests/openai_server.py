"""A real OpenAI-compatible HTTP server on 127.0.0.1 for tests, scripted per test.

It serves ``GET /v1/models`` and ``POST /v1/chat/completions`` from a thread. Each chat request
is answered by ``handler(request_json) -> Reply``; the default handler answers every choice with
``answer`` and reports fixed usage. Every request is recorded.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """What the server sends back for one request."""

    texts: list[str] | None = None  # one per choice; None = as many as requested
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None  # raw body overrides everything (malformed JSON, errors)
    delay: float = 0.0  # seconds to wait before answering
    trickle: float = 0.0  # send the body one byte per this many seconds (a slow-loris endpoint)
    usage: dict[str, int] | None = None  # None = the server's default usage
    # Per choice, (token, logprob) pairs sent when the request asks for logprobs; None = the
    # text's first max_tokens "tokens" (see _tokens) at log-probability -0.1 each
    logprobs: list[list[tuple[str, float]]] | None = None
    omit_logprobs: bool = False  # a server that gives none, even when asked


def _tokens(text: str, most: int) -> list[str]:
    """The first ``most`` "tokens" of a text: words, and pieces of 8 characters of a longer one."""
    found = []
    for match in re.finditer(r"\s*\S{1,8}", text):
        found.append(match.group())
        if len(found) == most:
            break
    return found


class FakeOpenAI:
    """Start with ``with FakeOpenAI() as server:``; ``server.url`` ends in ``/v1``."""

    def __init__(
        self,
        handler: Callable[[dict[str, Any]], Reply] | None = None,
        *,
        answer: str = "Answer: Paris\nFollow-up query: Paris France",
        model: str = "fake-model",
        prompt_tokens: int = 50,
        completion_tokens: int = 5,
        supports_n: bool = True,
    ) -> None:
        self.handler = handler or (lambda request: Reply())
        self.answer, self.model = answer, model
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.supports_n = supports_n
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.usage_sent: list[dict[str, int]] = []
        self.release = threading.Event()  # set on exit so a hanging handler ends
        self.abandoned = threading.Event()  # set when a client closed the connection mid-reply
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("path", "").endswith("/chat/completions")]

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def _respond(self, request: dict[str, Any]) -> tuple[int, dict[str, str], bytes, float]:
        reply = self.handler(request)
        if reply.delay:
            self.release.wait(reply.delay)
        if reply.body is not None or reply.status != 200:
            body = (
                reply.body
                if reply.body is not None
                else json.dumps({"error": {"message": "scripted"}}).encode()
            )
            return reply.status, reply.headers, body, reply.trickle
        n = int(request.get("n") or 1) if self.supports_n else 1
        texts = reply.texts if reply.texts is not None else [self.answer] * n
        usage = (
            reply.usage
            if reply.usage is not None
            else {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens * len(texts),
                "total_tokens": self.prompt_tokens + self.completion_tokens * len(texts),
            }
        )
        with self._lock:
            self.usage_sent.append(usage)
        body = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model") or self.model,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                for i, t in enumerate(texts)
            ],
        }
        if request.get("logprobs") and not reply.omit_logprobs:
            # Like a real server, log-probabilities for at most max_tokens generated tokens.
            most = int(request.get("max_tokens") or 64)
            pieces = reply.logprobs or [[(p, -0.1) for p in _tokens(t, most)] for t in texts]
            for choice, tokens in zip(body["choices"], pieces, strict=False):
                choice["logprobs"] = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(str(p).encode()), "top_logprobs": []}
                        for p, lp in tokens
                    ]
                }
        if usage:
            body["usage"] = usage
        return 200, reply.headers, json.dumps(body).encode(), reply.trickle

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms per response

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, headers: dict[str, str], body: bytes, trickle: float = 0.0) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                try:
                    if not trickle:
                        self.wfile.write(body)
                        return
                    for byte in body:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        if server.release.wait(trickle):
                            return
                except (BrokenPipeError, ConnectionResetError):
                    server.abandoned.set()

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    body = {
                        "object": "list",
                        "data": [{"id": server.model, "object": "model", "owned_by": "test"}],
                    }
                    with server._lock:
                        server.requests.append({"path": self.path})
                    self._send(200, {}, json.dumps(body).encode())
                else:
                    self._send(404, {}, b'{"error": {"message": "not found"}}')

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    request = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    request = {}
                request["path"] = self.path
                with server._lock:
                    server.requests.append(request)
                    server.headers.append(dict(self.headers))
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {}, b'{"error": {"message": "not found"}}')
                    return
                self._send(*server._respond(request))

        return Handler


def main() -> None:
    """Serve a fixed answer after a fixed delay until killed (a separate process for benchmarks)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--answer", default="Answer: Bergen\nFollow-up query: Lina Berg")
    args = parser.parse_args()
    with FakeOpenAI(handler=lambda request: Reply(delay=args.delay), answer=args.answer) as server:
        print(server.url, flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    main()
