"""Launch ``python app.py`` for real on a free loopback port (used by tests and bench/)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppProcess:
    """``with AppProcess(env) as app:``; ``app.url`` is ready when the block starts."""

    def __init__(self, env: dict[str, str] | None = None, startup_timeout: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.env = {
            **os.environ,
            "GRADIO_SERVER_NAME": "127.0.0.1",
            "GRADIO_SERVER_PORT": str(self.port),
            "GRADIO_ANALYTICS_ENABLED": "False",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            **(env or {}),
        }
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"brag-app-{self.port}.log"

    def __enter__(self) -> AppProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "app.py")],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "gradio_api/info", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"app did not start within {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def rest_events(
    url: str, api_name: str, data: list, timeout: float = 120, session_hash: str | None = None
) -> list[tuple[str, str]]:
    """Call an endpoint over Gradio's REST protocol: POST for an event id, then read its SSE stream.

    Returns every ``(event, data)`` pair until ``complete`` or ``error``. Without
    ``session_hash`` every call opens a new Gradio session, as a one-off REST caller does.
    """
    body: dict = {"data": data}
    if session_hash:
        body["session_hash"] = session_hash
    request = urllib.request.Request(
        f"{url}gradio_api/call/{api_name}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        event_id = json.loads(response.read())["event_id"]
    return rest_stream(url, api_name, event_id, timeout)


def rest_stream(url: str, api_name: str, event_id: str, timeout: float = 120) -> list[tuple[str, str]]:
    """Every ``(event, data)`` pair a REST call streams, until ``complete`` or ``error``."""
    events: list[tuple[str, str]] = []
    with urllib.request.urlopen(f"{url}gradio_api/call/{api_name}/{event_id}", timeout=timeout) as stream:
        event = None
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event:
                events.append((event, line.split(":", 1)[1].strip()))
                if event in ("complete", "error"):
                    return events
    raise RuntimeError(f"{api_name}: the stream ended without a result")


def rest_call(
    url: str, api_name: str, data: list, timeout: float = 120, session_hash: str | None = None
) -> list:
    """The final result of a REST call (see :func:`rest_events`); an error event raises."""
    event, payload = rest_events(url, api_name, data, timeout, session_hash)[-1]
    if event == "error":
        raise RuntimeError(f"{api_name} failed: {payload}")
    return json.loads(payload)


def upload(url: str, name: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST a file to Gradio's upload route, as a REST caller does: the status, and the stored
    file's server path (or the refusal's text)."""
    boundary = "brag-test"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    request = urllib.request.Request(
        url + "gradio_api/upload",
        data=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            (path,) = json.loads(reply.read())
            return reply.status, path
    except urllib.error.HTTPError as err:
        return err.code, err.read()[:500].decode(errors="replace")


def upload_many(url: str, files: list[tuple[str, bytes]]) -> list[str]:
    """POST many files to Gradio's upload route in one body, as a browser uploads a selection;
    their server paths (an error when refused)."""
    boundary = "brag-test-many"
    parts = [
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + b"\r\n"
        for name, data in files
    ]
    request = urllib.request.Request(
        url + "gradio_api/upload",
        data=b"".join(parts) + f"--{boundary}--\r\n".encode(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(
            f"upload refused: HTTP {err.code} {err.read()[:500].decode(errors='replace')}"
        ) from None


def upload_over_rest(url: str, name: str, data: bytes) -> str:
    """POST a file to Gradio's upload route; its server path (an error when refused)."""
    status, path = upload(url, name, data)
    if status != 200:
        raise RuntimeError(f"upload refused: HTTP {status} {path}")
    return path


def call_asgi(
    app,
    path: str,
    body: bytes = b"",
    headers: dict | None = None,
    client=("192.0.2.9", 1),
    chunk: int = 0,
    method: str = "POST",
    query: bytes = b"",
):
    """One HTTP request through an ASGI app: its status and body."""
    sent: list[dict] = []
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "path": path, "headers": raw, "client": client, "method": method}
    scope["query_string"] = query
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] if chunk and body else [body]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)
    ]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
