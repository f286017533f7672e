"""The code base passes ruff's lint and format checks (configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        exe = shutil.which("ruff") or "ruff"
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff(args):
    result = ruff(*args)
    assert result.returncode == 0, result.stdout + result.stderr
