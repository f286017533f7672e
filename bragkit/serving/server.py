"""The endpoints: :class:`Server` runs ``/brag`` and ``/calibrate`` for :class:`Settings`.

Each request holds one of its caller's slots, runs under its deadline, and every failure leaves
as one clear message: a :class:`~serving.limits.RequestRefused` or a failed run becomes a
``gr.Error`` in :meth:`Server._scrubbed_errors`, with the server's secrets scrubbed out.
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gradio as gr

import brag
import calibrate
from bragkit import documents as doc_files
from bragkit import fits, llms, selftest
from bragkit.serving import uploads

from .callers import CallerLimits, SessionFits, SessionUploads, trusted_proxies
from .corpora import YOUR_DOCUMENTS, CorpusStore, MilvusSettings, own_index
from .inputs import check_cost, check_lam, check_question, read_calibration, read_labelled, read_uploads
from .lane import Lane
from .limits import Limits, RequestRefused, concurrency, refused
from .models import EndpointPolicy, LLMPool, ModelPolicy
from .presentation import calibration_frame, fitted_on_text, model_label, plural, stated_answer
from .redaction import Secrets, json_safe

log = logging.getLogger("brag.app")


def self_test_setting() -> bool:
    """``BRAG_SELF_TEST``: on (the default) or off."""
    value = os.environ.get("BRAG_SELF_TEST", "on").strip().lower()
    if value not in ("on", "off", "1", "0", "true", "false"):
        raise SystemExit(f"BRAG_SELF_TEST must be on or off, got {value!r}")
    return value in ("on", "1", "true")


def _failure(err: Exception) -> RequestRefused:
    """The message a user sees for a failed request; never a stack trace, never the token."""
    if isinstance(err, brag.RunAborted):
        report, cause = err.report, err.__cause__
        done = report["totals"]["llm_calls"]
        best = report["answer"] or "none yet"
        what = str(err) if isinstance(cause, brag.InputError | llms.LLMError) else _internal(cause, err.step)
        return refused(
            f"{what} — work done before the failure: {plural(done, 'LLM call')}, best answer so far: {best}"
        )
    if isinstance(err, brag.InputError | llms.LLMError):
        return refused(str(err))
    return refused(_internal(err))


def _internal(err: BaseException | None, step: str = "") -> str:
    """A fault of the server's own: its text (which can name paths or values) stays in the log."""
    log.error("unexpected error", exc_info=err)
    said = f"{step} failed: an internal error" if step else "Internal error"
    return f"{said} ({type(err).__name__}); the server is still up, please retry."


@dataclass(frozen=True)
class Settings:
    """Everything the owner sets through the environment, read and checked once at start-up.

    ``Settings.from_env()`` reads it (a bad value stops the app with a message naming the
    variable); a test builds one directly and passes it to ``app.build``.
    """

    limits: Limits = field(default_factory=Limits)
    endpoints: EndpointPolicy = field(default_factory=EndpointPolicy)
    models: ModelPolicy = field(default_factory=lambda: ModelPolicy("local"))
    secrets: Secrets = field(default_factory=lambda: Secrets(()))
    proxies: uploads.Proxies = field(default_factory=uploads.Proxies)  # BRAG_TRUSTED_PROXIES
    own_index: tuple[str, Path] | None = None  # BRAG_CORPUS_DIR: its name and folder
    milvus: MilvusSettings | None = None  # BRAG_MILVUS_URI: the owner's collections
    concurrency: int = 16
    cache_dir: Path = field(default_factory=brag.cache_dir)
    self_test: bool = True  # BRAG_SELF_TEST=off turns "Check these documents" and /calibrate's self-test off
    self_test_model: str = (
        ""  # BRAG_SELF_TEST_MODEL: the model that writes self-test questions (the reader's)
    )

    @classmethod
    def from_env(cls) -> Settings:
        """The settings this process's environment gives."""
        try:  # read now, so a bad value stops the app at start-up, not the first request
            llms.max_response_bytes()
            llms.local_idle_timeout()
        except ValueError as err:
            raise SystemExit(str(err)) from None
        return cls(
            limits=Limits.from_env(),
            endpoints=EndpointPolicy.from_env(),
            models=ModelPolicy.from_env(),
            secrets=Secrets.from_env(),
            proxies=trusted_proxies(),
            own_index=own_index(),
            milvus=MilvusSettings.from_env(),
            concurrency=concurrency(),
            cache_dir=brag.cache_dir(),
            self_test=self_test_setting(),
            self_test_model=os.environ.get("BRAG_SELF_TEST_MODEL", "").strip(),
        )


@dataclass(frozen=True, kw_only=True)
class AskRequest:
    """The inputs of one /brag request, typed as the endpoint declares them.

    A remote caller can still send any JSON in any field, so the server checks each one
    (``check_question``, ``check_lam``, ...) before it is used.
    """

    question: str
    corpus: str = ""
    documents: str = ""
    lam: float = 0.05
    model: str = ""
    hf_token: str = ""
    provider: str = ""
    calibration: str = ""
    cost: str = brag.DEFAULT_COST_UNIT
    price_in: float | None = None
    price_out: float | None = None
    files: list[str] | None = None
    session: str = ""  # the browser session, which may name the files it uploaded before
    gone: Callable[[], bool] = lambda: False  # whether the caller has gone (caller_gone)
    caller: str = ""  # the caller's address, through trusted proxies
    on_file: Callable[[int, int, str], None] | None = None  # before each file is read (reading_progress)


class Picked(NamedTuple):
    """The corpus a request names: the corpus, its label, its shipped fit's name, what its files gave."""

    corpus: brag.Retriever
    label: str
    fit_name: str | None
    files: dict[str, Any] | None = None  # documents.Reading.summary(); None without files


def files_label(names: list[str], shown: int = 3) -> str:
    """The uploaded files as a report names the corpus: the first few, then how many more."""
    names = [doc_files.display_name(name) for name in names]
    if len(names) <= shown + 1:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown:,} more files"


def reading_progress(progress: Any) -> Callable[[int, int, str], None]:
    """Each file read shown in Gradio's progress: "Reading 37 of 300: manual.zip/html/intro.html"."""

    def on_file(number: int, total: int, label: str) -> None:
        llms.time_left()  # raises once the caller has gone or the deadline passed: no file more
        progress((number - 1) / total, desc=f"Reading {number:,} of {total:,}: {label}")

    return on_file


class Server:
    """The app's state, built from :class:`Settings`, and the endpoints that use it.

    ``run_brag`` and ``run_calibrate`` are ``/brag`` and ``/calibrate``: each holds one of the
    caller's slots (:class:`CallerLimits`), sets the request's deadline, turns every failure
    into a clear message and scrubs the server's secrets from all it returns.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings, self.limits = settings, settings.limits
        # The shipped calibrations by name: the hand-set prior and those fitted for particular
        # models. A request names one, names one that /calibrate kept, or sends JSON.
        self.shipped = brag.shipped_calibrations()
        limits = settings.limits
        # Every kept fit: those /calibrate made, by name per address, and the owner's self-tests
        # (calibrate.py self-test) by model and corpus, which /brag uses unasked for everyone.
        # A caller's own self-test applies to its session (session_fits).
        self.fits = fits.fit_store(settings.cache_dir, limits.kept_fits, limits.kept_fits_per_address)
        self.session_fits = SessionFits(limits.sessions * 10, limits.kept_fits_per_address)
        # /calibrate's slots, its fair line and each address's seconds of it (self-tests yield).
        self.lane = Lane(
            limits.calibrate_concurrency,
            limits.calibrate_queue,
            limits.self_test_wait,
            limits.self_test_share,
            limits.self_test_per_hour,
        )
        self._generator: llms.LLM | None = None
        self.store = CorpusStore(settings.limits, settings.own_index, settings.milvus)
        self.llms = LLMPool(settings.endpoints, settings.models)
        per_address = limits.address_share(settings.concurrency)
        calibrate_share = {"calibrate": limits.calibrate_share()}
        self.callers = CallerLimits(limits.per_session, per_address, settings.proxies, calibrate_share)
        self.secrets = settings.secrets
        self.session_files = SessionUploads(limits.files_bytes * 4)
        self.ledger = uploads.UploadLedger(
            limits.upload_store_bytes,
            limits.caller_upload_share(),
            limits.upload_ttl,
            per_caller_files=limits.caller_upload_files(),
            store_files=limits.upload_store_files,
            root=upload_folder(),
        )
        self.cancels = RecentIds()  # events the caller cancelled (/cancel), so their calls stop
        self.streams = WatchedStreams()  # sessions whose result stream a caller opened

    def check_files(self, value: Any) -> None:
        """A files input, before Gradio touches the disk (:func:`uploads.check_file_data`)."""
        # A path a session keeps, or one deleted for its age, goes on to read_uploads, which
        # serves the first and explains the second.
        known = lambda path: self.session_files.known(path) or self.ledger.expired(path)  # noqa: E731
        with self._scrubbed_errors():
            try:
                uploads.check_file_data(value, upload_folder(), self.limits.files, known)
            except uploads.FileRefused as err:
                raise refused(str(err)) from None

    def pick_corpus(
        self,
        corpus: Any,
        documents: Any,
        files: Any = None,
        session: str = "",
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
        on_file: Callable[[int, int, str], None] | None = None,
    ) -> Picked:
        """Uploaded files and pasted documents win over a named corpus; none is an error.

        The corpus, its label, the name its shipped fit goes by (a named corpus's own name, None
        for the caller's documents, whatever their files are called, which get the model's
        documents fit: :func:`brag.shipped_calibration`), and what was read of the files.
        ``on_file(number, total, label)`` before each file is read.
        """
        given, not_read = read_uploads(
            files, self.limits, self.session_files, session, self.ledger, folder=upload_folder()
        )
        text = documents if isinstance(documents, str) else ""
        if given or not_read or text.strip():
            label = files_label([name for name, _ in given]) if given else "your documents"
            chosen, read = self.store.documents_read(
                text, given, cancelled, caller, not_read=not_read, on_file=on_file
            )
            return Picked(chosen, label, None, read)
        name = (corpus or "").strip() if isinstance(corpus, str) else ""
        if name == YOUR_DOCUMENTS:
            raise refused(
                "“Your documents” is selected but none are given: upload files or paste text, or "
                "choose a corpus."
            )
        if not name:
            raise refused("No corpus: choose one or paste documents (one passage per line, or a JSON list).")
        if name not in self.store.names:
            raise refused(f"Unknown corpus: use one of {', '.join(self.store.names)}, or paste documents.")
        return Picked(self.store.named(name), name, name)

    def run_brag(
        self,
        question: str,
        corpus: str,
        documents: str,
        lam: float,
        model: str,
        hf_token: str,
        provider: str,
        calibration: str,
        cost: str = brag.DEFAULT_COST_UNIT,
        price_in: float | None = None,
        price_out: float | None = None,
        files: list[str] | None = None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom; not an API input)
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio passes it; not an API input
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Answer a question over a corpus, step by step.

        Yields ``(best answer so far, report so far)`` as each step starts (the report's
        ``finished`` is False), then the final ``(answer, report)``. ``cost`` prices the actions
        (calls, tokens, seconds, or usd with the two prices per million tokens). Files are read
        one by one, each shown in ``progress``; the report's ``server.files`` says how many were
        read and names each one that could not be, with why.
        """
        ask = AskRequest(
            question=question,
            corpus=corpus,
            documents=documents,
            lam=lam,
            model=model,
            hf_token=hf_token,
            provider=provider,
            calibration=calibration,
            cost=cost,
            price_in=price_in,
            price_out=price_out,
            files=files,
            session=getattr(request, "session_hash", None) or "",
            gone=caller_gone(self.cancels, self.streams),
            caller=self.callers.address(request) if request is not None else "",
            on_file=reading_progress(progress),
        )
        with self._scrubbed_errors(), self.callers.slot(request):
            for answer, report in self._answer(ask):
                yield self.secrets.scrub(stated_answer(answer, report)), self.secrets.scrub_data(report)

    def _answer(self, ask: AskRequest) -> Iterator[tuple[str, dict[str, Any]]]:
        """The run under the request's deadline, each report naming the corpus and the model."""
        question = check_question(ask.question, self.limits)
        lam = check_lam(ask.lam)
        pricing = check_cost(ask.cost, ask.price_in, ask.price_out)
        started = time.monotonic()
        end = started + self.limits.request_timeout
        try:
            with llms.deadline_at(end), llms.cancellable(ask.gone):
                picked, controller, whose = self._controller(ask, lam, pricing)
            chosen = picked.corpus
            steps = controller.stream(question, chosen)
            while True:
                # Gradio may run each step of a generator in another thread, so the deadline and
                # the cancel check are set around every step rather than once around the loop.
                with llms.deadline_at(end), llms.cancellable(ask.gone):
                    item = next(steps, None)
                if item is None:
                    break
                answer, report = item
                # What the server knows, under its own key: the library's figures stay as they are.
                report["server"] = {
                    "corpus": picked.label,
                    "engine": chosen.stats().get("engine", "bm25s"),  # which engine served the passages
                    "model": model_label(ask.model),
                    "calibration": _with_whose(report["config"]["calibration"], whose),
                    "elapsed_s": round(time.monotonic() - started, 3),  # the whole request
                    **({"files": picked.files} if picked.files is not None else {}),
                }
                yield answer, json_safe(report)
        except RequestRefused:
            raise
        except Exception as err:
            raise _failure(err) from None
        _log_answered(report)

    def _controller(
        self, ask: AskRequest, lam: float, pricing: tuple[str, tuple[float, float] | None]
    ) -> tuple[Picked, brag.BRAG, str]:
        """The corpus, the backend and the calibration a request names, as a controller.

        Also whose self-test fit it is, in words, when the server chose one unasked ("" otherwise).
        """
        picked = self.pick_corpus(
            ask.corpus, ask.documents, ask.files, ask.session, ask.gone, ask.caller, ask.on_file
        )
        chosen, fit_name = picked.corpus, picked.fit_name
        backend = self.llms.get(ask.model, ask.hf_token, ask.provider)
        own, whose = self._own_fit(ask.calibration, chosen, backend, ask.session, ask.caller)
        cal = own or read_calibration(
            ask.calibration, fit_name, brag.llm_name(backend), self.shipped, self.fits, self.limits
        )
        unit, prices = pricing
        return picked, brag.BRAG(backend, calibration=cal, lam=lam, cost=unit, prices=prices), whose

    def _own_fit(
        self, named: Any, corpus: brag.Retriever, backend: llms.LLM, session: str, caller: str
    ) -> tuple[brag.Calibration | None, str]:
        """The self-test fit for this model and corpus when the request names no calibration, and whose.

        The caller's own (its session's, from its address) first, then the owner's
        (``calibrate.py self-test``); another caller's never.
        """
        if (isinstance(named, str) and named.strip()) or (named and not isinstance(named, str)):
            return None, ""
        model, fingerprint = brag.llm_name(backend), corpus.fingerprint()
        name = self.session_fits.recall(session, caller, model, fingerprint)
        if name is not None:
            try:
                mine = self.fits.load(name)
                return mine, f"your self-test{_made(mine)}, kept as {name}"
            except brag.InputError:
                pass  # gone or unreadable: the owner's fit, or the shipped one
        owners = self.fits.own(model, fingerprint)
        return owners, (f"the server owner's self-test{_made(owners)}" if owners is not None else "")

    def run_calibrate(
        self,
        labelled_json: str,
        corpus: str,
        documents: str,
        model: str,
        hf_token: str,
        provider: str,
        files: list[str] | None = None,
        self_test: bool = False,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom)
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio passes it; not an API input
    ) -> str:
        """Fit a calibration for a model and corpus (JSON out; kept by name).

        From labelled questions; or, with ``self_test`` (or no questions at all), from questions
        BRAG writes from the documents, with any labelled ones added (:mod:`bragkit.selftest`).
        A self-test's fit (without labels) is kept for the model and corpus, and /brag then uses
        it unasked.
        """
        gone = caller_gone(self.cancels, self.streams)
        with self._scrubbed_errors(), self.callers.slot(request, "calibrate"):
            if gone():  # left while it waited: a REST event whose results nobody opened, a cancel
                raise refused("The caller left before the calibration started; nothing was run.")
            empty = labelled_json is None or (isinstance(labelled_json, str) and not labelled_json.strip())
            self_test = self_test is True or empty
            if self_test and not self.settings.self_test:
                raise refused(
                    "Self-tests are turned off on this server (BRAG_SELF_TEST=off): give labelled questions."
                )
            items = read_labelled(labelled_json, self.limits, self_test=self_test)
            session = getattr(request, "session_hash", None) or ""
            caller = self.callers.address(request) if request is not None else ""
            try:
                # One call, no yields inside: the deadline and the cancel check hold for all of it,
                # for every LLM call and between questions. A self-test ends at its own bound (its
                # meter) or its turn's end, and no call outlasts that by more than the grace.
                with (
                    self.lane.turn(caller, gone) as turn,
                    llms.deadline(self._calibrate_seconds(self_test)),
                    llms.cancellable(gone),
                ):
                    chosen, label, fit_name, read = self.pick_corpus(
                        corpus, documents, files, session, gone, caller, reading_progress(progress)
                    )
                    backend = self.llms.get(model, hf_token, provider)
                    if self_test:
                        base = brag.shipped_calibration(brag.llm_name(backend), fit_name, self.shipped)
                        result = self._self_test(
                            items, chosen, label, base, backend, model, progress, (gone, turn.should_yield)
                        )
                    else:
                        result = _fit(items, chosen, label, backend, model, progress)
            except RequestRefused:
                raise
            except selftest.Cancelled:
                raise refused("The self-test was cancelled; nothing was kept.") from None
            except Exception as err:
                raise _failure(err) from None
            return self._kept(result, read, caller, session if self_test and not items else "")

    def _kept(self, result: dict[str, Any], read: dict[str, Any] | None, caller: str, session: str) -> str:
        """A fit kept for ``caller`` (and applied to ``session``, if any), as /calibrate returns it.

        A self-test of the documents alone applies unasked to its caller's session (others may
        name it); a caller's own labels shape only the fit returned. What was read of the files
        goes with the answer, not into the kept fit.
        """
        result = {**result, "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        name = self.fits.keep(result, caller)
        if session:
            self.session_fits.remember(session, caller, str(result["model"]), str(result["corpus"]), name)
        shown = {**result, "name": name, **({"files": read} if read is not None else {})}
        return self.secrets.scrub(json.dumps(shown, indent=1))

    def _calibrate_seconds(self, self_test: bool) -> float:
        """The request's deadline: a self-test's own bound and one call's grace, within /calibrate's."""
        if not self_test:
            return self.limits.calibrate_timeout
        return min(self.limits.calibrate_timeout, self._self_test_seconds() + SELF_TEST_GRACE)

    def _self_test_seconds(self) -> float:
        return min(self.limits.self_test_seconds, self.limits.calibrate_timeout)

    def check_documents(
        self,
        corpus: str,
        documents: str,
        model: str,
        hf_token: str,
        provider: str,
        files: list[str] | None = None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom)
        request: gr.Request = None,  # type: ignore[assignment]
    ) -> str:
        """The page's "Check these documents": a self-test of the Ask tab's corpus, in words."""
        fitted = json.loads(
            self.run_calibrate(
                "", corpus, documents, model, hf_token, provider, files, True, progress, request
            )
        )
        status = brag.calibration_status(brag.load_calibration(fitted), str(fitted.get("model")))
        return (
            f"✓ {status}. Your questions over these documents from this page use it from now on; "
            f"elsewhere, give its name as the calibration: {fitted.get('name')}."
        )

    def _self_test(
        self,
        items: list[calibrate.Labelled],
        corpus: brag.Corpus,
        label: str,
        base: brag.Calibration,
        backend: llms.LLM,
        model: Any,
        progress: gr.Progress,
        stops: tuple[Callable[[], bool], Callable[[], bool]],
    ) -> dict[str, Any]:
        """A self-test of ``corpus`` within the server's bounds, refitting ``base`` (its shipped fit).

        ``stops``: whether its caller has gone (it is cancelled), and whether its turn in the lane
        has ended (it ends with a fit on what it has done).
        """
        gone, should_yield = stops
        limits = self.limits
        plan = fits.SelfTestPlan(
            questions=limits.self_test_questions,
            tries=4 * limits.self_test_questions,
            seconds=self._self_test_seconds(),
            prompt_chars=limits.self_test_prompt_chars,
            question_chars=limits.question_chars,
        )
        progress(0.0, desc="Writing questions from your documents")

        def on_progress(fraction: float, what: str) -> None:
            llms.time_left()  # raises once the caller has gone or the deadline passed
            progress(fraction, desc=what)

        fitted = fits.calibrate_corpus(
            corpus,
            backend,
            base,
            generator=self._self_test_writer(),
            plan=plan,
            labelled=items,
            on_progress=on_progress,
            should_stop=gone,
            should_yield=should_yield,
        )
        return {**fitted, "model_spec": model_label(model), "corpus_label": label}

    def _self_test_writer(self) -> llms.LLM | None:
        """The owner's model for writing self-test questions (BRAG_SELF_TEST_MODEL), else None: the reader."""
        spec = self.settings.self_test_model
        if not spec:
            return None
        if self._generator is None:
            self._generator = llms.make_llm(llms.parse_model(spec))
        return self._generator

    def show_calibration(self, text: Any) -> tuple[Any, Any]:
        """The calibration tab's table and its file to download, for the fit /calibrate just kept.

        The browser sends back /calibrate's JSON, but any caller can send anything here, so
        only the kept name is taken from it: the table and the file are the server's own kept
        copy, and nothing is written.
        """
        data = (
            brag.parse_json(text, "calibration") if isinstance(text, str) and text.startswith("{") else None
        )
        name = data.get("name") if isinstance(data, dict) else None
        path = self.fits.path(name) if isinstance(name, str) else None
        if path is None:
            return gr.update(visible=False), None
        text = path.read_text(encoding="utf-8")
        label = f"Fitted, per action and case: {fitted_on_text(json.loads(text))}"
        return gr.update(value=calibration_frame(text), visible=True, label=label), str(path)

    @contextmanager
    def _scrubbed_errors(self) -> Iterator[None]:
        """The one place a refusal becomes the page's error; it leaves holding none of the secrets."""
        try:
            yield
        except RequestRefused as err:
            # The page shows a message as HTML (Gradio sanitises it, but keeps tags such as img
            # and form), and a message can quote a document or a model: escaped, after scrubbing.
            message = html.escape(self.secrets.scrub(str(err)), quote=False)
            raise gr.Error(message, print_exception=False) from None


def upload_folder() -> Path:
    """Where Gradio stores uploaded files: the only folder an upload is read from."""
    return Path(gr.utils.get_upload_folder()).resolve()


class RecentIds:
    """The newest ``size`` ids recorded as their requests arrive (``guards.PublicRoutes``).

    The server keeps the events whose caller asked ``/cancel`` here: Gradio's own cancel waits
    for the running call to return; recorded, the call's next check (``caller_gone``) ends it first.
    """

    def __init__(self, size: int = 10_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def add(self, key: str) -> None:
        """Record ``key`` (an event id or a session hash)."""
        with self._lock:
            self._ids[key] = None
            self._ids.move_to_end(key)
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._ids


class WatchedStreams(RecentIds):
    """Sessions whose result stream a caller opened, while Gradio holds events of theirs.

    Recorded as the stream's request arrives (``guards.PublicRoutes``, through
    ``guards.Blocks.watch``). ``live(session)`` says whether Gradio still holds an event of a
    session (set by ``app.build``): only a live session is recorded, and when the record is full
    the sessions no longer live go first, so streams opened for made-up sessions record nothing
    and push no one's record out.
    """

    def __init__(self, size: int = 10_000) -> None:
        super().__init__(size)
        self.live: Callable[[str], bool] = lambda session: True

    def add(self, key: str) -> None:
        """Record that session ``key``'s result stream is open, if Gradio holds an event of it."""
        if not self.live(key):
            return
        with self._lock:
            if len(self._ids) >= self.size:
                for gone in [session for session in self._ids if not self.live(session)]:
                    del self._ids[gone]
        super().add(key)


def caller_gone(
    cancels: RecentIds | None = None, streams: WatchedStreams | None = None
) -> Callable[[], bool]:
    """Whether the caller of the request this thread runs has gone: a check to ask later.

    Gradio marks a running event not alive when its client disconnects, closed when its
    browser tab goes, and drops it from the running jobs when the client cancels it; a cancel
    is in ``cancels`` as soon as it arrives. An event whose result stream no one opened within
    ``STREAM_GRACE`` seconds of joining (its session is not in ``streams``) has no one waiting
    for it either. Outside an event Gradio runs (a direct Python call) the
    caller never goes.
    """
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    queue = getattr(blocks, "_queue", None)
    if queue is None or event_id is None:
        return lambda: False

    def gone() -> bool:
        if cancels is not None and event_id in cancels:
            return True
        try:
            for job in list(queue.active_jobs):
                for event in job or ():
                    if event._id == event_id:
                        return not event.alive or event.closed or unwatched(event)
        except (AttributeError, TypeError):  # another Gradio: the request's deadline still holds
            return False
        return True  # no longer running: cancelled

    def unwatched(event: Any) -> bool:
        if streams is None or getattr(event, "_brag_watched", False):
            return False
        if getattr(event, "session_hash", None) in streams:
            event._brag_watched = True  # seen once: no later record's eviction can unsee it
            return False
        return time.monotonic() - getattr(event, "enqueue_time", time.monotonic()) > STREAM_GRACE

    return gone


# Seconds a caller has to open an event's result stream after it joined the queue; an event
# nobody watches is gone (a client opens it at once: this is a hang guard, not a race).
STREAM_GRACE = 10.0
# What a self-test's calls may take past its own bound (BRAG_SELF_TEST_SECONDS) before the
# request's deadline ends them.
SELF_TEST_GRACE = 30.0


def _made(fit: brag.Calibration | None) -> str:
    made = fit.meta.get("made") if fit is not None else None
    return f" of {made}" if isinstance(made, str) and len(made) <= 40 else ""


def _with_whose(calibration: dict[str, Any], whose: str) -> dict[str, Any]:
    """The report's calibration, its status saying whose self-test fit the server chose, if it chose one."""
    if not whose:
        return calibration
    return {**calibration, "status": f"{calibration.get('status', '')} ({whose})", "whose": whose}


def _fit(
    items: list[calibrate.Labelled],
    corpus: brag.Corpus,
    label: str,
    backend: llms.LLM,
    model: Any,
    progress: gr.Progress,
) -> dict[str, Any]:
    *first, last = calibrate.default_actions()
    progress(0.0, desc=f"Running {', '.join(first)} and {last} on {len(items)} questions")
    labelled = sum(bool(item.gold) for item in items)

    def on_progress(done: int, total: int) -> None:
        llms.time_left()  # raises once the caller has gone or the deadline passed: no question more
        progress(done / total, desc=f"Question {done} of {total}")

    return calibrate.calibrate(
        items,
        corpus,
        backend,
        on_progress=on_progress,
        meta={
            "model_spec": model_label(model),
            "corpus": label,
            "note": f"fitted in the app on {len(items)} questions, {labelled} with gold answers",
        },
    )


def _log_answered(report: dict[str, Any]) -> None:
    totals = report["totals"]
    log.info(
        "answered: corpus=%s model=%s calls=%d tokens=%d %.2fs",
        report["server"]["corpus"],
        report["server"]["model"],
        totals["llm_calls"],
        totals["prompt_tokens"] + totals["completion_tokens"],
        totals["wall_time_s"],
    )
