"""The command line (bragkit/cli.py): ``python -m brag index``, the same as the ``brag`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from brag import Corpus

ROOT = Path(__file__).resolve().parent.parent


def test_the_index_command_indexes_a_jsonl_collection(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "\n".join(
            json.dumps(d) for d in [{"title": "A", "text": "alpha rivers"}, "beta lakes", {"text": "gamma"}]
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "brag", "index", str(docs), str(tmp_path / "out"), "--name", "Lakes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "indexed 3 passages" in result.stdout and "indexing 3 passages" in result.stderr
    corpus = Corpus.load(tmp_path / "out")
    assert corpus.name == "Lakes" and corpus[1].text == "beta lakes" and corpus[0].title == "A"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"title": "A", "text": "fine"}\n{not json\n')
    failed = subprocess.run(
        [sys.executable, "-m", "brag", "index", str(broken), str(tmp_path / "never")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2 and "broken.jsonl, line 2: malformed JSON" in failed.stderr
    assert "Traceback" not in failed.stderr and not (tmp_path / "never").exists()


def test_the_index_command_needs_only_brags_three_packages(tmp_path):
    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(["alpha rivers", "beta lakes", "gamma hills"]))
    # tqdm is absent on the minimal install (numpy, scipy, bm25s): importing it must fail here.
    blocked = (
        "import sys; sys.modules['tqdm'] = None; from bragkit import cli; sys.exit(cli.main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked, "index", str(docs), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tokenizing: 3 of 3 passages" in result.stderr and len(Corpus.load(tmp_path / "out")) == 3


def test_python_m_brag_and_brag_py_run_the_same_command_line(tmp_path):
    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(["alpha rivers", "beta lakes"]))
    bare = subprocess.run([sys.executable, "-m", "brag"], cwd=ROOT, capture_output=True, text=True)
    assert bare.returncode == 2 and "usage: python -m brag" in bare.stderr and "index" in bare.stderr
    script = [sys.executable, str(ROOT / "brag.py"), "index", str(docs), str(tmp_path / "out")]
    result = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(Corpus.load(tmp_path / "out")) == 2
    again = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
