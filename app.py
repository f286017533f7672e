"""BRAG as a Gradio app: a browser UI plus the ``/brag`` and ``/calibrate`` API endpoints.

    python app.py          # http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT)

Environment: ``HF_TOKEN`` (server secret for Inference Providers), ``BRAG_MODEL`` (default
model), ``BRAG_CONCURRENCY`` (requests run at once, default 16; the rest queue),
``BRAG_DATA_DIR`` (local corpora), ``BRAG_CORPUS_REPO`` (Hub dataset with the HippoRAG corpora).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import hashlib
import html
import json
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

import brag
import calibrate
import llms

log = logging.getLogger("brag.app")
HERE = Path(__file__).resolve().parent
DEMO = "Demo"
DEMO_CORPUS_PATH = HERE / "data" / "demo_corpus.json"
HIPPORAG_REPO = "osunlp/HippoRAG_2"
# Display name -> (folder under BRAG_DATA_DIR, local file names to try in order, Hub file name).
# The shared data holds HippoRAG's own 2Wiki corpus and faithful subsets for the other two.
CORPORA: dict[str, tuple[str, tuple[str, ...], str]] = {
    "HotpotQA": (
        "hotpotqa",
        ("hotpotqa_corpus.json", "hotpotqa_ircot500_corpus.json"),
        "hotpotqa_corpus.json",
    ),
    "2WikiMultihopQA": ("2wikimultihopqa", ("2wikimultihopqa_corpus.json",), "2wikimultihopqa_corpus.json"),
    "MuSiQue": ("musique", ("musique_corpus.json", "musique_migres200_corpus.json"), "musique_corpus.json"),
}
# The shipped calibration fitted on each corpus; pasted documents and Demo use HotpotQA's.
CALIBRATIONS = {
    "HotpotQA": HERE / "data" / "calibration.json",
    "2WikiMultihopQA": HERE / "data" / "calibration_2wikimultihopqa.json",
    "MuSiQue": HERE / "data" / "calibration_musique.json",
}
EXAMPLES = [
    ["Where was the architect of the Glass Tower born?", DEMO],
    ["Which political party used the idea coined by Friedrich Ratzel?", DEMO],
    ["In which city was the author of The Silent Orchard born?", DEMO],
    ["Into which sea does the river that flows through Marie Curie's birthplace flow?", DEMO],
]


def user_error(message: str) -> gr.Error:
    """An error the user reads; logged as one line, without a server-side stack trace."""
    log.warning("request failed: %s", message)
    return gr.Error(message, print_exception=False)


def concurrency() -> int:
    """``BRAG_CONCURRENCY`` (default 16): how many requests run at once."""
    raw = os.environ.get("BRAG_CONCURRENCY", "16")
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"BRAG_CONCURRENCY must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise SystemExit(f"BRAG_CONCURRENCY must be a positive integer, got {raw!r}")
    return value


# ------------------------------------------------------------------------------------------
# Corpora: named ones indexed once per process, pasted documents per request
# ------------------------------------------------------------------------------------------


def corpus_file(name: str) -> Path:
    """The corpus JSON: from BRAG_DATA_DIR when there, else downloaded once from the Hub."""
    if name == DEMO:
        return DEMO_CORPUS_PATH
    folder, local_names, hub_name = CORPORA[name]
    root = brag.data_dir()
    if root is not None:
        for candidate in (root / folder / f for f in local_names):
            if candidate.is_file():
                return candidate
    from huggingface_hub import hf_hub_download

    repo = os.environ.get("BRAG_CORPUS_REPO", HIPPORAG_REPO)
    try:
        return Path(hf_hub_download(repo_id=repo, filename=hub_name, repo_type="dataset"))
    except Exception as err:  # offline, repository gone, file renamed
        raise user_error(f"cannot download the {name} corpus ({hub_name} from {repo}): {err}") from None


class CorpusStore:
    """Named corpora, each read and indexed once and then shared by every request."""

    def __init__(self) -> None:
        self._corpora: dict[str, brag.Corpus] = {}
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in [DEMO, *CORPORA]}
        self._documents: OrderedDict[str, brag.Corpus] = OrderedDict()
        self._documents_lock = threading.Lock()

    def named(self, name: str) -> brag.Corpus:
        """A named corpus; the first request for it pays for reading and indexing."""
        with self._locks[name]:
            if name not in self._corpora:
                path = corpus_file(name)
                started = time.perf_counter()
                self._corpora[name] = brag.Corpus(path.read_text(encoding="utf-8"))
                log.info(
                    "indexed %s (%d passages) in %.1f s",
                    name,
                    len(self._corpora[name]),
                    time.perf_counter() - started,
                )
            return self._corpora[name]

    def documents(self, text: str) -> brag.Corpus:
        """Pasted documents: a JSON list, or one passage per line. Recent ones stay indexed."""
        key = hashlib.sha256(text.encode()).hexdigest()
        with self._documents_lock:
            if key in self._documents:
                self._documents.move_to_end(key)
                return self._documents[key]
        stripped = text.strip()
        if stripped.startswith(("[", "{")):
            corpus = brag.Corpus(stripped)
        else:
            corpus = brag.Corpus([line for line in stripped.splitlines() if line.strip()])
        with self._documents_lock:
            self._documents[key] = corpus
            while len(self._documents) > 32:
                self._documents.popitem(last=False)
        return corpus


STORE = CorpusStore()


def pick_corpus(corpus: str | None, documents: str | None) -> tuple[brag.Corpus, str]:
    """Pasted documents win over a named corpus; neither is an error."""
    if documents and documents.strip():
        return STORE.documents(documents), "your documents"
    name = (corpus or "").strip()
    if not name:
        raise user_error("No corpus: choose one or paste documents (one passage per line, or a JSON list).")
    if name not in CORPORA and name != DEMO:
        raise user_error(
            f"Unknown corpus {name!r}: use one of {', '.join([DEMO, *CORPORA])}, or paste documents."
        )
    return STORE.named(name), name


# ------------------------------------------------------------------------------------------
# Endpoints
# ------------------------------------------------------------------------------------------

ACTION_TEXT = {
    "R1": "R1: reading the top passages",
    "R2": "R2: second retrieval hop",
    "CB": "CB: closed-book samples",
}


class LLMPool:
    """Backends reused across requests, one per (model, token, provider).

    Building an HTTP client costs about 0.1 s (TLS set-up), and every backend is thread-safe, so
    concurrent requests share one.
    """

    def __init__(self, size: int = 64) -> None:
        self._pool: OrderedDict[tuple[str, str, str], llms.LLM] = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def get(self, model: str | None, hf_token: str | None, provider: str | None) -> llms.LLM:
        """The backend for this request, built on first use."""
        spec = (model or "").strip() or llms.default_model()
        token = (hf_token or "").strip() or None
        provider = (provider or "").strip() or "auto"
        key = (spec, hashlib.sha256((token or "").encode()).hexdigest(), provider)
        with self._lock:
            if key in self._pool:
                self._pool.move_to_end(key)
                return self._pool[key]
        try:
            backend = llms.make_llm(spec, token, provider)
        except (ValueError, llms.LLMError) as err:
            raise user_error(str(err)) from None
        with self._lock:
            backend = self._pool.setdefault(key, backend)
            while len(self._pool) > self.size:
                self._pool.popitem(last=False)
        return backend


LLMS = LLMPool()


def _failure(err: Exception) -> gr.Error:
    """The message a user sees for a failed request; never a stack trace, never the token."""
    if isinstance(err, brag.RunAborted):
        report = err.report
        done = report["totals"]["llm_calls"]
        best = report["answer"] or "none yet"
        return user_error(
            f"{err} — work done before the failure: {done} LLM call(s), best answer so far: {best}"
        )
    if isinstance(err, ValueError | llms.LLMError):
        return user_error(str(err))
    log.exception("unexpected error")
    return user_error(f"Internal error ({type(err).__name__}); the server is still up, please retry.")


def run_brag(
    question: str,
    corpus: str,
    documents: str,
    lam: float,
    model: str,
    hf_token: str,
    provider: str,
    calibration: str,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom)
) -> tuple[str, dict[str, Any]]:
    """Answer a question over a corpus; returns the answer and the full BRAG report."""
    if not isinstance(question, str) or not question.strip():
        raise user_error("The question is empty.")
    try:
        lam = float(lam)
    except (TypeError, ValueError):
        raise user_error(f"lam must be a number, got {lam!r}") from None
    try:
        progress(0.0, desc="Loading the corpus")
        chosen, label = pick_corpus(corpus, documents)
        if not (calibration or "").strip():
            calibration = CALIBRATIONS.get(label, brag.DEFAULT_CALIBRATION_PATH)
        controller = brag.BRAG(LLMS.get(model, hf_token, provider), calibration=calibration, lam=lam)

        def on_step(step: dict[str, Any]) -> None:
            if step["action"]:
                progress(
                    min(0.9, 0.25 * step["step"]), desc=f"Step {step['step']} · {ACTION_TEXT[step['action']]}"
                )

        answer, report = controller.run(question, chosen, on_step=on_step)
    except gr.Error:
        raise
    except Exception as err:
        raise _failure(err) from None
    report["corpus"] = label
    report["calibration"] = {
        k: controller.calibration.meta.get(k) for k in ("source", "model", "corpus", "date")
    }
    report["model"] = model or llms.default_model()
    totals = report["totals"]
    log.info(
        "answered: corpus=%s model=%s calls=%d tokens=%d %.2fs",
        label,
        report["model"],
        totals["llm_calls"],
        totals["prompt_tokens"] + totals["completion_tokens"],
        totals["wall_time_s"],
    )
    return answer, report


def run_calibrate(
    labelled_json: str,
    corpus: str,
    documents: str,
    model: str,
    hf_token: str,
    provider: str,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio's own idiom)
) -> str:
    """Fit a calibration for a model and corpus from at least 30 labelled questions (JSON out)."""
    if not isinstance(labelled_json, str) or not labelled_json.strip():
        raise user_error(
            f'No labelled questions: paste a JSON list of {{"question", "gold": [...]}} '
            f"objects ({calibrate.MIN_QUESTIONS} or more)."
        )
    try:
        items = calibrate.read_labelled(labelled_json)
        chosen, label = pick_corpus(corpus, documents)
        spec = (model or "").strip() or llms.default_model()
        progress(0.0, desc=f"Running R1, R2 and CB on {len(items)} questions")
        result = calibrate.calibrate(
            items,
            chosen,
            LLMS.get(model, hf_token, provider),
            on_progress=lambda done, total: progress(done / total, desc=f"Question {done} of {total}"),
            meta={
                "model": spec,
                "corpus": label,
                "note": f"fitted in the app on {len(items)} labelled questions",
            },
        )
    except gr.Error:
        raise
    except Exception as err:
        raise _failure(err) from None
    return json.dumps(result, indent=1)


# ------------------------------------------------------------------------------------------
# Presentation of a report
# ------------------------------------------------------------------------------------------


PALETTE = ["#4f46e5", "#059669", "#d97706", "#dc2626", "#0891b2", "#7c3aed"]


def posterior_svg(report: dict[str, Any], width: int = 560, height: int = 230) -> str:
    """A line chart of each candidate's posterior after every step (the residual dashed)."""
    steps = report.get("steps", [])
    if not steps:
        return "<p style='opacity:.6'>The posterior after each step appears here.</p>"
    names: list[str] = []
    for step in steps:
        for cand in step["posterior"]["candidates"]:
            if cand["answer"] not in names:
                names.append(cand["answer"])
    series = {name: [] for name in names[: len(PALETTE)]}
    residual = []
    for step in steps:
        probs = {c["answer"]: c["p"] for c in step["posterior"]["candidates"]}
        for name, points in series.items():
            points.append(probs.get(name, 0.0))
        residual.append(step["posterior"]["residual"])
    left, right, top, bottom = 44, 30, 10, 26
    plot_w, plot_h = width - left - right, height - top - bottom

    def xy(i: int, p: float) -> tuple[float, float]:
        return left + plot_w * i / max(len(steps) - 1, 1), top + plot_h * (1 - p)

    grey = 'fill="#6b7280" font-size="11"'
    parts = [f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="posterior per step">']
    for tick in (0, 0.25, 0.5, 0.75, 1):
        _, y = xy(0, tick)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" {grey}>{tick:.0%}</text>')
    for i, step in enumerate(steps):
        x, _ = xy(i, 0)
        label = f"{step['step']}·{step['action'] or 'stop'}"
        parts.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle" {grey}>{label}</text>')
    lines = [(name, points, PALETTE[k], "") for k, (name, points) in enumerate(series.items())]
    lines.append(("(none of these)", residual, "#9ca3af", ' stroke-dasharray="5 4"'))
    for name, points, color, dash in lines:
        coords = [xy(i, p) for i, p in enumerate(points)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        parts.append(
            f'<polyline class="series" points="{path}" fill="none" stroke="{color}" stroke-width="2.5"{dash}>'
            f"<title>{html.escape(name)}</title></polyline>"
        )
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in coords]
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="margin-right:12px"><span style="display:inline-block;width:10px;height:10px;'
        f'background:{color};border-radius:2px;margin-right:4px"></span>{html.escape(name[:40])}</span>'
        for name, _, color, _ in lines
    )
    return f'<div id="posterior-chart">{"".join(parts)}<div style="font-size:12px">{legend}</div></div>'


def _saw(step: dict[str, Any]) -> str:
    seen = step.get("observation") or {}
    if not seen:
        return ""
    if "samples" in seen:
        return f"mode {seen['answer'] or 'NONE'!r} ({seen['agreement']}/{len(seen['samples'])} agree)"
    if seen.get("skipped"):
        return seen["skipped"]
    passages = seen.get("passages", [])
    if "new_passages" in seen:  # R2: what the second hop added
        passages = passages[len(passages) - len(seen["new_passages"]) :]
    titles = ", ".join(p["title"] or f"#{p['id']}" for p in passages)
    text = f"{seen.get('answer') or 'NONE'!r} · read {titles}"
    if seen.get("follow_up_query"):
        text += f" · next query: {seen['follow_up_query']}"
    return text


def steps_frame(report: dict[str, Any]) -> pd.DataFrame:
    """The steps table: action, information rates, what it saw, policy time."""
    rows = []
    for step in report.get("steps", []):
        rates = step["rates"]
        rows.append(
            {
                "step": step["step"],
                "action": step["action"] or "stop",
                "P_err": round(step["posterior"]["p_err"], 3),
                "D(R1)": round(rates["R1"], 3),
                "D(R2)": round(rates["R2"], 3),
                "D(CB)": round(rates["CB"], 3),
                "saw": _saw(step),
                "policy µs": step["policy_us"],
            }
        )
    return pd.DataFrame(rows)


def totals_markdown(report: dict[str, Any]) -> str:
    """Calls, tokens and time as one line."""
    t = report["totals"]
    estimated = " (estimated)" if t["tokens_estimated"] else ""
    cached = f" · {t['cached_calls']} from cache" if t["cached_calls"] else ""
    return (
        f"**{t['llm_calls']}** LLM calls{cached} · **{t['prompt_tokens'] + t['completion_tokens']}** tokens "
        f"({t['prompt_tokens']} prompt + {t['completion_tokens']} completion){estimated} · "
        f"**{t['wall_time_s']:.2f} s** · controller {t['policy_us']:.0f} µs · stop: {report['stop_reason']}"
    )


def render(answer: str, report: dict[str, Any] | None) -> tuple[str, str, pd.DataFrame, str]:
    """What the UI shows for a finished run."""
    if not report:
        return "", posterior_svg({}), pd.DataFrame(), ""
    p_right = 1 - report["p_err"]
    headline = (
        f"## {answer}\n\nP(correct) ≈ {p_right:.0%} · corpus: {report.get('corpus', '')}"
        if answer
        else "## No answer found\n\nNo action returned an answer the controller could vote for."
    )
    return headline, posterior_svg(report), steps_frame(report), totals_markdown(report)


# ------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------

CSS = """
#answer h2 { font-size: 2rem; margin: 0.2rem 0; }
#answer { min-height: 5rem; }
"""


def build() -> gr.Blocks:
    """The Gradio Blocks app."""
    with gr.Blocks(title="BRAG · cost-aware question answering") as demo:
        gr.Markdown(
            "# BRAG · cost-aware question answering\n"
            "A Bayesian controller decides which LLM calls are worth making: read the top passages "
            "(R1), take a second retrieval hop (R2), or sample closed-book answers (CB), and stops "
            "when another call is worth less than its price λ."
        )
        with gr.Tab("Ask"):
            with gr.Row():
                with gr.Column(scale=2):
                    question = gr.Textbox(
                        label="Question", placeholder="Ask a question about the corpus", lines=2
                    )
                    with gr.Row():
                        corpus = gr.Dropdown(
                            [DEMO, *CORPORA, ""],
                            value=DEMO,
                            label="Corpus",
                            info="or leave empty and paste your own documents",
                        )
                        lam = gr.Slider(0.0, 0.5, value=0.05, step=0.005, label="λ (price of one LLM call)")
                    documents = gr.Textbox(
                        label="Your documents (optional: one passage per line, or a JSON list)", lines=4
                    )
                    with gr.Row():
                        model = gr.Textbox(
                            label="Model",
                            placeholder=f"default: {llms.default_model()}",
                            info="HF model id, an OpenAI-compatible URL, or 'local'",
                        )
                        hf_token = gr.Textbox(label="HF token", type="password", placeholder="optional")
                        provider = gr.Textbox(label="Provider", value="auto")
                    with gr.Accordion("Advanced: calibration", open=False):
                        calibration = gr.Textbox(label="Calibration JSON (empty: the shipped one)", lines=4)
                    ask = gr.Button("Ask", variant="primary")
                    gr.Examples(EXAMPLES, inputs=[question, corpus])
                with gr.Column(scale=3):
                    answer_md = gr.Markdown(elem_id="answer")
                    totals = gr.Markdown()
                    gr.Markdown("**How the belief moved** (posterior after each step)")
                    chart = gr.HTML(posterior_svg({}))
                    steps = gr.Dataframe(label="Steps", wrap=True)
                    with gr.Accordion("Raw report", open=False):
                        report = gr.JSON(label="Report")
            answer = gr.Textbox(visible=False)
            inputs = [question, corpus, documents, lam, model, hf_token, provider, calibration]
            event = ask.click(run_brag, inputs, [answer, report], api_name="brag")
            question.submit(run_brag, inputs, [answer, report], api_visibility="private").then(
                render, [answer, report], [answer_md, chart, steps, totals], api_visibility="private"
            )
            event.then(render, [answer, report], [answer_md, chart, steps, totals], api_visibility="private")
        with gr.Tab("Calibrate"):
            gr.Markdown(
                "Fit the controller's reliabilities for your model and corpus from at least 30 labelled "
                "questions, then paste the result into *Advanced: calibration*."
            )
            labelled = gr.Textbox(
                label='Labelled questions: [{"question": ..., "gold": [...]}, ...]', lines=6
            )
            with gr.Row():
                cal_corpus = gr.Dropdown([DEMO, *CORPORA, ""], value=DEMO, label="Corpus")
                cal_documents = gr.Textbox(label="Your documents (optional)", lines=2)
            with gr.Row():
                cal_model = gr.Textbox(label="Model", placeholder=f"default: {llms.default_model()}")
                cal_token = gr.Textbox(label="HF token", type="password")
                cal_provider = gr.Textbox(label="Provider", value="auto")
            fit = gr.Button("Calibrate", variant="primary")
            cal_out = gr.Code(label="Calibration JSON", language="json")
            fit.click(
                run_calibrate,
                [labelled, cal_corpus, cal_documents, cal_model, cal_token, cal_provider],
                cal_out,
                api_name="calibrate",
            )
    demo.queue(default_concurrency_limit=concurrency())
    return demo


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    build().launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        theme=gr.themes.Soft(),
        css=CSS,
        show_error=True,
    )
