"""BRAG as a Gradio app: a browser UI plus the ``/brag`` and ``/calibrate`` API endpoints.

    python app.py          # http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT)

Environment: ``HF_TOKEN`` (server secret for Inference Providers), ``BRAG_MODEL`` (default
model), ``BRAG_ALLOWED_MODELS`` and ``BRAG_ALLOWED_ENDPOINTS`` (what callers may pick),
``BRAG_CONCURRENCY`` (requests run at once, default 16; the rest queue), ``BRAG_DATA_DIR``
(local corpora), ``BRAG_CORPUS_REPO`` (Hub dataset with the HippoRAG corpora); the limits are in
``bragkit.serving.limits.Limits`` and docs/deploying.md. This file is the page (``build``
and its tabs) and the entry point; the request policy, guards, corpora, presentation and the
endpoints are in ``serving/``.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import json
import logging
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

import brag
import calibrate
from bragkit import documents as doc_files
from bragkit import llms
from bragkit.serving import uploads
from bragkit.serving.corpora import DEMO, YOUR_DOCUMENTS
from bragkit.serving.guards import (
    Blocks,
    EventShare,
    PublicRoutes,
    RequestSizeLimit,
    configure_logging,
    max_request_bytes,
    ui_helper,
)
from bragkit.serving.presentation import (
    STEP_COLUMNS,
    failed,
    posterior_svg,
    render,
    starting,
    step_column_widths,
)
from bragkit.serving.server import Server, Settings

log = logging.getLogger("brag.app")


# The first is one the default model answers right (bench/results/examples.md).
EXAMPLES = [
    ["Which political party used the idea coined by Friedrich Ratzel?", DEMO],
    ["Where was the architect of the Glass Tower born?", DEMO],
    ["In which city was the author of The Silent Orchard born?", DEMO],
    ["Into which sea does the river that flows through Marie Curie's birthplace flow?", DEMO],
]


CSS = """
#answer h2 { font-size: 2rem; margin: 0.2rem 0; }
#answer { min-height: 4rem; }
#progress { min-height: 1.6rem; }
#steps th, #steps td { white-space: normal; word-break: normal; overflow-wrap: anywhere; }
#steps th { min-width: 4.5rem; }
"""


def use_documents(documents: Any, corpus: str) -> Any:
    """Pasted documents or uploaded files select "Your documents"; clearing them goes back to Demo."""
    if (isinstance(documents, str) and documents.strip()) or (isinstance(documents, list) and documents):
        return gr.update(value=YOUR_DOCUMENTS)
    return gr.update(value=DEMO if corpus == YOUR_DOCUMENTS else corpus)


# use_documents for pasted text, run in the browser: the text can be megabytes, and a page helper
# takes at most BRAG_MAX_HELPER_BYTES, so it is never sent to the server just to pick the corpus.
USE_PASTED_DOCUMENTS = (
    f"(documents, corpus) => (documents && documents.trim()) ? {json.dumps(YOUR_DOCUMENTS)} : "
    f"(corpus === {json.dumps(YOUR_DOCUMENTS)} ? {json.dumps(DEMO)} : corpus)"
)


def follow_documents(given: gr.components.Component, corpus: gr.Dropdown) -> None:
    """Selecting "Your documents" when files are given or text is pasted (see :func:`use_documents`)."""
    if isinstance(given, gr.File):
        given.change(ui_helper(use_documents), [given, corpus], corpus, api_visibility="private")
    else:
        given.change(None, [given, corpus], corpus, js=USE_PASTED_DOCUMENTS, api_visibility="private")


INTRO = (
    "# BRAG · cost-aware question answering\n"
    "A Bayesian controller decides which LLM calls are worth making: read the top passages "
    "(R1), take a second retrieval hop (R2), or sample closed-book answers (CB), and stops "
    "when another call is worth less than its price λ."
)


def build(settings: Settings | None = None) -> Blocks:
    """The Gradio Blocks app for ``settings`` (by default the environment's)."""
    server = Server(settings or Settings.from_env())
    choices = [*server.store.names, YOUR_DOCUMENTS]
    # Files Gradio makes for downloads are deleted ten minutes after they were made.
    with Blocks(title="BRAG · cost-aware question answering", delete_cache=(300, 600)) as demo:
        gr.Markdown(INTRO)
        with gr.Tab("Ask"):
            _ask_tab(server, choices)
        with gr.Tab("Calibrate"):
            download = _calibrate_tab(server, choices)
    demo.check_files, demo.ledger, demo.downloads = server.check_files, server.ledger, (download,)
    demo.cancels, demo.streams = server.cancels, server.streams
    runs = (server.run_brag, server.run_calibrate, server.check_documents)
    demo.document_events = frozenset(i for i, fn in demo.fns.items() if fn.fn in runs)
    server.ledger.forget = demo.upload_file_set.discard  # Gradio's record of a deleted upload goes too
    demo.queue(default_concurrency_limit=server.settings.concurrency, max_size=server.limits.queue_size)
    server.streams.live = demo.holds_session  # a stream is recorded only for a session Gradio holds
    llms.bound_hub_calls()  # deadlines and response caps hold for Inference Providers calls too
    return demo


def _file_input() -> gr.File:
    """Documents as files, several at once or a .zip of a tree; read once, deleted when the request ends."""
    return gr.File(
        label=(
            f"Your files (optional): {doc_files.described_suffixes()}; or a .zip of a documentation "
            "tree (its files are read one by one)"
        ),
        file_count="multiple",
        file_types=list(doc_files.UPLOAD_SUFFIXES),
        type="filepath",
        elem_id="files",
    )


def _model_row() -> list[gr.Textbox]:
    """The model, HF token and provider inputs, as both tabs show them.

    The model gets a line of its own, so a long id or URL stays readable at 1280 px.
    """
    with gr.Group():
        model = gr.Textbox(
            label="Model",
            placeholder=f"default: {llms.redact_url(llms.default_model())}",
            info="HF model id, an OpenAI-compatible URL, or 'local'",
            elem_id="model",
        )
        with gr.Row():
            hf_token = gr.Textbox(label="HF token", type="password", placeholder="optional", scale=2)
            provider = gr.Textbox(label="Provider", value="auto", scale=1, min_width=100)
    return [model, hf_token, provider]


def _ask_tab(server: Server, choices: list[str]) -> None:
    """The question, its corpus and model on the left; the answer, the chart and the steps."""
    with gr.Row():
        with gr.Column(scale=2):
            question = gr.Textbox(label="Question", placeholder="Ask a question about the corpus", lines=2)
            with gr.Row():
                # Custom values pass through to pick_corpus, which names the valid ones; the API
                # also takes "" with documents, as SPEC's signature has it.
                corpus = gr.Dropdown(
                    choices,
                    value=DEMO,
                    label="Corpus",
                    info="files or pasted documents below select “Your documents”",
                    allow_custom_value=True,
                )
                lam = gr.Slider(0.0, 0.5, value=0.05, step=0.005, label="λ (price of one LLM call)")
            cost = _cost_row()
            files = _file_input()
            documents = gr.Textbox(
                label="Or paste documents (optional: one passage per line, or a JSON list)", lines=3
            )
            model_row = _model_row()
            with gr.Accordion("Advanced: calibration", open=False):
                calibration = gr.Textbox(
                    label="Calibration: empty (the one for this model), a name, or JSON", lines=4
                )
            ask = gr.Button("Ask", variant="primary")
            _check_documents(server, [corpus, documents, *model_row, files])
            gr.Examples(EXAMPLES, inputs=[question, corpus])
        with gr.Column(scale=3):
            progress, answer_md, chart, totals = _answer_panel()
    shown = [progress, answer_md, chart, _steps_table(), totals]  # what render() returns, in order
    with gr.Accordion("Raw report", open=False):
        report = gr.JSON(label="report")
    answer = gr.Textbox(label="answer", visible=False)
    for given in (documents, files):
        follow_documents(given, corpus)
    inputs = [question, corpus, documents, lam, *model_row, calibration, *cost, files]
    for trigger, name in ((ask.click, "brag"), (question.submit, None)):
        started = trigger(starting, None, shown, api_visibility="private", show_progress="hidden")
        ran = started.then(
            server.run_brag,
            inputs,
            [answer, report],
            api_name=name,
            api_visibility="public" if name else "private",
            # Gradio's progress (each file being read) shows on the progress line only.
            show_progress="full",
            show_progress_on=[progress],
        )
        ran.failure(failed, None, progress, api_visibility="private")
    report.change(
        ui_helper(render),
        [answer, report],
        shown,
        api_visibility="private",
        show_progress="hidden",
        trigger_mode="always_last",
    )


def _check_documents(server: Server, inputs: list[Any]) -> gr.Markdown:
    """The "Check these documents" button: a self-test of the chosen corpus, its progress, a cancel."""
    with gr.Row():
        check = gr.Button("Check these documents", elem_id="check-documents", scale=2)
        cancel = gr.Button("Cancel the check", elem_id="cancel-check", variant="stop", scale=1)
    status = gr.Markdown(
        "BRAG can write questions from your documents, check its own answers to them and fit how "
        "sure it should be on them (a few minutes; the answers' P(correct) use it from then on).",
        elem_id="self-test",
        latex_delimiters=[],
    )
    checking = check.click(
        server.check_documents,
        inputs,
        status,
        api_visibility="private",
        concurrency_id="calibrate",  # a self-test counts against the caller's /calibrate share
        concurrency_limit=server.limits.calibrate_events(),  # the lane holds them to its slots
        show_progress="full",
    )
    cancel.click(None, None, None, cancels=[checking], api_visibility="private")
    return status


def _cost_row() -> list[Any]:
    """The unit actions are priced in, and the two prices when it is usd."""
    with gr.Row():
        unit = gr.Dropdown(
            list(brag.COST_UNITS),
            value=brag.DEFAULT_COST_UNIT,
            label="Price actions in",
            info="relative to one read, so λ keeps its meaning",
            scale=2,
        )
        price_in = gr.Number(label="$ / M input tokens", value=None, visible=False, scale=1)
        price_out = gr.Number(label="$ / M output tokens", value=None, visible=False, scale=1)
    unit.change(ui_helper(show_prices), unit, [price_in, price_out], api_visibility="private")
    return [unit, price_in, price_out]


def show_prices(unit: Any) -> tuple[Any, Any]:
    """The price inputs show only for usd."""
    visible = unit == "usd"
    return gr.update(visible=visible), gr.update(visible=visible)


def _steps_table() -> gr.Dataframe:
    return gr.Dataframe(
        headers=STEP_COLUMNS,
        label=(
            "Steps: each action's expected drop in P(error) per unit of cost (a read = 1), ✓ above λ; "
            "the best one runs"
        ),
        wrap=True,
        visible=False,
        elem_id="steps",
        column_widths=step_column_widths(),
    )


def _answer_panel() -> list[Any]:
    """Progress, the headline answer, the totals and the chart (the steps table follows)."""
    # No LaTeX: the answer and its source are a document's and a model's words, shown as written.
    progress = gr.Markdown(elem_id="progress", latex_delimiters=[])
    answer_md = gr.Markdown(elem_id="answer", latex_delimiters=[])
    totals = gr.Markdown(latex_delimiters=[])
    gr.Markdown("**How the belief moved** (posterior after each step)")
    chart = gr.HTML(posterior_svg({}))
    return [progress, answer_md, chart, totals]


def _calibrate_tab(server: Server, choices: list[str]) -> gr.File:
    """Labelled questions, corpus and model in; the fitted table, a download and the JSON out.

    Returns the download, the one component whose files the app serves.
    """
    limits = server.limits
    gr.Markdown(
        "Fit the controller's reliabilities for your model and corpus from your questions "
        f"({limits.labelled_min} to {limits.labelled_max}), or with no questions from a self-test: "
        "questions BRAG writes from the documents and checks against them. Give gold answers where "
        "you have them: "
        f"questions without gold are fitted by EM only alongside at least {calibrate.MIN_QUESTIONS} "
        "with gold, and the fit says which kind it is. The fit is kept under the name it returns: "
        "give that name (or paste the JSON) as the calibration on the Ask tab."
    )
    labelled = gr.Textbox(
        label='Questions: [{"question": ..., "gold": [...]}, ...]; "gold" is optional', lines=6
    )
    with gr.Row():
        cal_corpus = gr.Dropdown(choices, value=DEMO, label="Corpus", allow_custom_value=True)
        cal_documents = gr.Textbox(label="Or paste documents (optional)", lines=2)
    cal_files = _file_input()
    model_row = _model_row()
    self_test = gr.Checkbox(
        label="Self-test: also write questions from the documents and fit on them (no questions needed)",
        value=False,
    )
    fit = gr.Button("Calibrate", variant="primary")
    cal_table = gr.Dataframe(
        label="Fitted, per action and case", wrap=True, visible=False, elem_id="calibration-table"
    )
    cal_file = gr.File(label="Download the calibration (JSON)")
    with gr.Accordion("Calibration JSON", open=False):
        cal_out = gr.Code(label="calibration", language="json")
    for given in (cal_documents, cal_files):
        follow_documents(given, cal_corpus)
    fit.click(
        server.run_calibrate,
        [labelled, cal_corpus, cal_documents, *model_row, cal_files, self_test],
        cal_out,
        api_name="calibrate",
        # Its own slots, so an hour-long fit never holds up /brag.
        concurrency_id="calibrate",
        concurrency_limit=limits.calibrate_events(),  # the lane holds them to its slots
    ).success(ui_helper(server.show_calibration), cal_out, [cal_table, cal_file], api_visibility="private")
    return cal_file


def launch_options(settings: Settings, demo: Blocks) -> dict[str, Any]:
    """What ``launch`` needs beyond the page: error policy, file serving, the ASGI guards."""
    limits = settings.limits
    return {
        "server_name": os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        "theme": gr.themes.Soft(),
        "css": CSS,
        # Only gr.Error's own words reach a caller; any other exception's text (which can name
        # server paths) stays in the log.
        "show_error": False,
        # Gradio serves the kept fit the calibration tab offers for download from there.
        "allowed_paths": [str(settings.cache_dir / "calibrations")],
        # A .zip may hold all of a request's files; any other file over BRAG_MAX_FILE_BYTES is
        # named as not read, never read.
        "max_file_size": limits.upload_file_bytes(),
        # /monitoring would tell anyone every endpoint's traffic, and show session hashes.
        "enable_monitoring": False,
        # Sessions Gradio keeps (each small: Blocks.process_api clears its values).
        "state_session_capacity": limits.sessions,
        "app_kwargs": {
            "middleware": [
                Middleware(
                    RequestSizeLimit,
                    max_bytes=max_request_bytes(limits),
                    # a request's files, and room for the multipart framing
                    upload_bytes=limits.upload_body_bytes(),
                    max_files=limits.files,
                    helper_bytes=limits.helper_bytes,
                    large=demo.takes_documents,
                ),
                Middleware(
                    EventShare,
                    blocks=demo,
                    proxies=settings.proxies,
                    limit=limits.queued_share(settings.concurrency),
                    # /calibrate's events (self-tests among them) wait for a slot of their own.
                    groups={"calibrate": (limits.calibrate_share(), limits.calibrate_events())},
                    group_of=demo.group_of,
                ),
                Middleware(
                    PublicRoutes,
                    queue_size=limits.queue_size,
                    cancelled=demo.cancels.add,
                    watched=demo.watch,
                ),
                Middleware(
                    uploads.UploadRoutes, ledger=demo.ledger, served=demo.serves, proxies=settings.proxies
                ),
            ]
        },
    }


def main() -> None:
    """Read the settings, then serve the app until stopped."""
    settings = Settings.from_env()
    configure_logging(settings.secrets)
    # The client's address is BRAG's to find (BRAG_TRUSTED_PROXIES): uvicorn, which Gradio starts
    # without this setting, would otherwise take it from X-Forwarded-For for any loopback peer.
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    demo = build(settings)
    demo.launch(**launch_options(settings, demo))


if __name__ == "__main__":
    main()
