"""The app's parts without the page: the request policy stands without Gradio, and the server
turns its refusals into the page's errors in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest

import serving.policy
import serving.server

ROOT = Path(__file__).resolve().parent.parent


def test_the_request_policy_imports_and_refuses_without_gradio():
    blocked = (
        "import sys; sys.modules['gradio'] = None\n"
        "import serving.policy as policy\n"
        "try:\n"
        "    policy.check_question('  ', policy.Limits())\n"
        "except policy.RequestRefused as err:\n"
        "    print(type(err).__mro__[1].__name__, err)\n"
        "print('gradio' in sys.modules and sys.modules['gradio'] is not None)\n"
    )
    result = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["ValueError The question is empty.", "False"]


def test_a_refusal_reaches_the_page_as_a_gradio_error(tmp_path):
    server = serving.server.Server(serving.server.Settings(cache_dir=tmp_path))
    with pytest.raises(gr.Error, match="The question is empty") as refused:
        list(server.run_brag("", "Demo", "", 0.05, "local", "", "", ""))
    assert not isinstance(refused.value, serving.policy.RequestRefused)
    with pytest.raises(gr.Error, match="λ must lie between 0 and 10"):
        list(server.run_brag("Where?", "Demo", "", 99, "local", "", "", ""))


def test_a_refusal_leaves_the_server_escaped_and_without_its_secrets(tmp_path):
    secrets = serving.policy.Secrets(["sk-owner-secret-1234"])
    server = serving.server.Server(serving.server.Settings(cache_dir=tmp_path, secrets=secrets))
    calibration = '{"version": "<b>sk-owner-secret-1234</b>"}'
    with pytest.raises(gr.Error) as refused:
        list(server.run_brag("Where?", "Demo", "", 0.05, "local", "", "", calibration))
    message = refused.value.message  # the refusal quotes the value: scrubbed, then escaped
    assert "sk-owner-secret-1234" not in message and "&lt;b&gt;***&lt;/b&gt;" in message


def test_an_ask_request_is_built_by_keyword():
    with pytest.raises(TypeError):
        serving.server.AskRequest("Where?", "Demo")  # type: ignore[misc]
    ask = serving.server.AskRequest(question="Where?", corpus="Demo")
    assert (ask.question, ask.corpus, ask.files) == ("Where?", "Demo", None)
