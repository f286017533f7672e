"""Launch ``python app.py`` for real on a free loopback port (used by tests and bench/)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
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
