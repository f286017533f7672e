"""A loopback stand-in for the Hugging Face Hub's file downloads (``HF_ENDPOINT``).

It answers ``HEAD`` and ``GET /datasets/<repo>/resolve/<revision>/<file>`` with the headers
``huggingface_hub.hf_hub_download`` reads (commit, ETag, size), from an in-memory file table.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, files: dict[str, bytes]) -> None:
        """``files`` maps ``datasets/<repo>/<file>`` to its bytes."""
        self.files = files
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms per response

            def log_message(self, *args: object) -> None:
                pass

            def _lookup(self) -> bytes | None:
                parts = self.path.split("?")[0].strip("/").split("/")
                # datasets / org / name / resolve / revision / file
                if len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve":
                    return hub.files.get("/".join([parts[0], parts[1], parts[2], *parts[5:]]))
                return None

            def _reply(self, with_body: bool) -> None:
                hub.requests.append((self.command, self.path))
                body = self._lookup()
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header("X-Repo-Commit", "0" * 40)
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._reply(with_body=False)

            def do_GET(self) -> None:
                self._reply(with_body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
