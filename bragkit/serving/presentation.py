"""A report as the page shows it: headline, steps table, posterior chart, totals, calibration.

Pure functions of a report's data: the page's render event takes any caller's report.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import gradio as gr
import pandas as pd

import brag
from bragkit import llms


def action_text(label: str, actions: Sequence[brag.Action] = brag.ACTION_TABLE) -> str:
    """What the progress line says while an action runs, e.g. "R1: reading the top passages"."""
    try:
        return f"{label}: {brag.action_named(label, actions).does}"
    except brag.InputError:  # a run's action no longer in the table: its label alone
        return label


def model_label(model: Any) -> str:
    """The model a request names, or the default, as reports show it: credentials redacted."""
    spec = model.strip() if isinstance(model, str) else ""
    return llms.redact_url(spec or llms.default_model())


# What the page draws of a report at most. A server-made report stays far below both; a
# caller can send any report to the page's render event.
MAX_SHOWN_STEPS = 100


MAX_SHOWN_CANDIDATES = 50


def shown_steps(report: Any) -> list[dict[str, Any]]:
    """A report's steps as the page draws them, at most MAX_SHOWN_STEPS of MAX_SHOWN_CANDIDATES each."""
    steps = report.get("steps") if isinstance(report, dict) else None
    if not isinstance(steps, list):
        return []
    shown = []
    for step in steps[:MAX_SHOWN_STEPS]:
        posterior = dict(step["posterior"])
        posterior["candidates"] = list(posterior["candidates"][:MAX_SHOWN_CANDIDATES])
        shown.append({**step, "posterior": posterior})
    return shown


PALETTE = ["#4f46e5", "#059669", "#d97706", "#dc2626", "#0891b2", "#7c3aed"]


def posterior_svg(report: dict[str, Any], width: int = 560, height: int = 230) -> str:
    """A line chart of each candidate's posterior after every step (the residual dashed)."""
    steps = shown_steps(report)
    if not steps:
        return "<p style='opacity:.6'>The posterior after each step appears here.</p>"
    names: dict[str, None] = {}  # first seen first, found in constant time
    for step in steps:
        for cand in step["posterior"]["candidates"]:
            names.setdefault(str(cand["answer"]), None)
    series: dict[str, list[float]] = {name: [] for name in list(names)[: len(PALETTE)]}
    residual = []
    for step in steps:
        probs = {str(c["answer"]): float(c["p"]) for c in step["posterior"]["candidates"]}
        for name, points in series.items():
            points.append(probs.get(name, 0.0))
        residual.append(float(step["posterior"]["residual"]))
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
        label = html.escape(f"{step['step']}·{step['action'] or 'stop'}")
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


def step_columns(
    offered: Sequence[str] | None = None, actions: Sequence[brag.Action] = brag.ACTION_TABLE
) -> list[str]:
    """The steps table's columns, one per action ``offered`` (default: those fitted by default)."""
    labels = [a.label for a in actions if (a.label in offered if offered else a.fitted)]
    # Each action's column holds its expected gain per unit cost at that step.
    return ["Step", "P(error)", *labels, "Action", "What it read", "Answer", "Evidence", "Follow-up query"]


STEP_COLUMNS = step_columns()  # the table's columns before any report, and for a calibration's own


# Each column's share of the steps table's width, relative to the others (an action's: its own).
_COLUMN_SHARES = {"Step": 5, "P(error)": 7, "Action": 6, "What it read": 24, "Answer": 14, "Evidence": 14}
_ACTION_SHARE, _OTHER_SHARE = 7, 16


def step_column_widths(
    columns: Sequence[str] = STEP_COLUMNS, actions: Sequence[brag.Action] = brag.ACTION_TABLE
) -> list[str]:
    """The steps table's column widths, one per column, in percent."""
    labels = brag.action_labels(actions)
    shares = [_ACTION_SHARE if c in labels else _COLUMN_SHARES.get(c, _OTHER_SHARE) for c in columns]
    return [f"{100 * share / sum(shares):.1f}%" for share in shares]


def steps_frame(report: dict[str, Any], actions: Sequence[brag.Action] = brag.ACTION_TABLE) -> pd.DataFrame:
    """Each decision and why: P(error), each action's expected gain per call against λ, and what it saw.

    One column per action the run offered (``actions``: the rows its controller had). A score
    that beats λ is marked ✓; "—" means the action was not available at that step.
    """
    config = report.get("config") or {}
    offered = (config.get("actions") or {}).get("offered")
    columns = step_columns(offered if isinstance(offered, list) else None, actions)
    labels = brag.action_labels(actions)
    scored = [c for c in columns if c in labels]
    lam = config.get("lam", 0.0)
    rows = []
    for step in report.get("steps", []):
        scores = step.get("scores", {})
        cells = {
            a: (f"{scores[a]:.3f} ✓" if scores[a] > lam else f"{scores[a]:.3f}") if a in scores else "—"
            for a in scored
        }
        seen = step.get("observation") or {}
        action = step["action"] or "stop"
        if seen and step["action"] in labels:  # its kind says what it read and rested on
            kind = brag.action_named(step["action"], actions).kind
            read, answer, evidence = kind.cells(step["action"], seen)
        else:
            read = answer = "running…" if step["action"] and not report.get("finished", True) else ""
            evidence = ""
        if action == "stop":
            read = report.get("stop_reason", "")
            answer = NOT_FOUND_HEADLINE if not_found(report) else answer
        p_err = f"{step['posterior']['p_err']:.3f}"
        follow_up = seen.get("follow_up_query", "")
        rows.append([step["step"], p_err, *cells.values(), action, read, answer, evidence, follow_up])
    return pd.DataFrame(rows, columns=columns)


def totals_markdown(report: dict[str, Any]) -> str:
    """Calls, tokens and time as one line, and the cost in the unit actions were priced in."""
    t = report["totals"]
    cost = report.get("config", {}).get("cost") or {}
    unit = cost.get("unit", "calls")
    priced = sum((s.get("cost") or {}).get("priced", 0.0) for s in report.get("steps", []))
    in_unit = "" if unit == "calls" else f" · priced in {unit}: {priced:.4g}"
    estimated = " (estimated)" if t["tokens_estimated"] else ""
    cached = f" · {t['cached_calls']} from cache" if t["cached_calls"] else ""
    return (
        f"**{t['llm_calls']}** {plural(t['llm_calls'], 'LLM call', number=False)}{cached} · "
        f"**{t['prompt_tokens'] + t['completion_tokens']}** tokens "
        f"({t['prompt_tokens']} prompt + {t['completion_tokens']} completion){estimated} · "
        f"**{t['wall_time_s']:.2f} s** · controller {t['policy_us']:.0f} µs{in_unit} · "
        f"stop: {report['stop_reason']}"
    )


def plural(n: int, noun: str, number: bool = True) -> str:
    """``1 LLM call``, ``2 LLM calls`` (just the noun when ``number`` is False)."""
    word = noun if n == 1 else f"{noun}s"
    return f"{n} {word}" if number else word


def served(report: dict[str, Any]) -> dict[str, Any]:
    """What the server added to a report under its own key: corpus name, model, calibration, time."""
    found = report.get("server")
    return found if isinstance(found, dict) else {}


def progress_markdown(report: dict[str, Any]) -> str:
    """Where a run is: the step and action now running, the calls so far, the time so far."""
    steps, totals = report.get("steps", []), report.get("totals", {})
    elapsed = served(report).get("elapsed_s", totals.get("wall_time_s", 0.0))
    calls = totals.get("llm_calls", 0)
    if report.get("finished", True):
        return f"✔ Done: {plural(calls, 'LLM call')} in {elapsed:.1f} s."
    step = steps[-1]
    doing = f"**Running · step {step['step']} · {action_text(step['action'])}…**"
    return f"{doing} · {plural(calls, 'LLM call')} so far · {elapsed:.1f} s"


# Every ASCII punctuation character: CommonMark shows a backslash-escaped one as itself.
_MARKUP = re.compile(r"([!-/:-@\[-`{-~])")


# The most of any one text the page shows: a report it renders can come from any caller.
MAX_SHOWN_CHARS = 1_000


def as_text(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text from a document, a file name or a model, for a Markdown component: shown as written.

    Every ASCII punctuation character is backslash-escaped and line breaks become spaces, so no
    tag, link, image, heading, emphasis or autolink can form from it; past ``limit``
    characters it is cut.
    """
    text = str(value)[: 4 * limit]  # the cut comes after the spaces fold, so first a rough one
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return _MARKUP.sub(r"\\\1", text)


NOT_FOUND_HEADLINE = brag.NOT_FOUND[:1].upper() + brag.NOT_FOUND[1:]


def not_found(report: Any) -> bool:
    """Whether a finished report says the documents do not hold the answer."""
    return (
        isinstance(report, dict)
        and report.get("finished", True)
        and report.get("found_in_documents") is False
    )


def stated_answer(answer: str, report: Any) -> str:
    """The answer as /brag gives it: "Not in your documents" first when the run says so.

    What follows it is the run's best candidate, named as a guess; the report keeps the
    candidate itself in ``answer`` and says ``found_in_documents: false``.
    """
    if not not_found(report):
        return answer
    return f"{NOT_FOUND_HEADLINE}. A guess, not from them: {answer}" if answer else f"{NOT_FOUND_HEADLINE}."


def trust_line(report: dict[str, Any]) -> str:
    """How far to trust the answer (``report["confidence"]``): in bold when it is a guess."""
    confidence = report.get("confidence") or {}
    summary = str(confidence.get("summary") or f"P(correct) ≈ {1 - float(report['p_err']):.0%}")
    summary = as_text(summary[:1].upper() + summary[1:])
    return f"**{summary}**" if confidence.get("guess") else summary


# Files not read that the page names one by one; the report lists more, and counts them all.
MAX_SHOWN_FAILURES = 10


def files_markdown(report: dict[str, Any]) -> str:
    """What was read of the uploaded files: how many, and each one not read with why (a few)."""
    files = served(report).get("files")
    if not isinstance(files, dict):
        return ""
    try:
        read, passages = int(files.get("read", 0)), int(files.get("passages", 0))
        count, skipped = int(files.get("not_read_count", 0)), int(files.get("skipped_count", 0))
    except (TypeError, ValueError):
        return ""
    line = f"**Files:** {read:,} read ({plural(passages, 'passage')})"
    line += f" · **{count:,} not read**" if count else ""
    types = files.get("skipped_types")
    if skipped and isinstance(types, dict):
        kinds = ", ".join(f"{as_text(kind, 20)} {as_text(n, 10)}" for kind, n in list(types.items())[:10])
        line += f" · {skipped:,} skipped, of types BRAG does not read ({kinds})"
    failures = files.get("not_read")
    failures = (
        [f for f in failures[:MAX_SHOWN_FAILURES] if isinstance(f, dict)]
        if isinstance(failures, list)
        else []
    )
    lines = [f"- {as_text(f.get('file', ''), 250)}: {as_text(f.get('reason', ''), 300)}" for f in failures]
    if count > len(lines):
        lines.append(f"- and {count - len(lines):,} more (the raw report names up to 50)")
    return "\n".join([line, *lines]) if lines else line


def render(answer: str, report: dict[str, Any] | None) -> tuple[Any, ...]:
    """What the page shows for a report, while the run goes on and when it is done."""
    if not report or not isinstance(report, dict):
        return "", "", posterior_svg({}), gr.update(visible=False), ""
    report = {**report, "steps": shown_steps(report)}
    finished = report.get("finished", True)
    read = list(
        dict.fromkeys(
            label
            for step in report["steps"]
            for label in brag.passage_labels((step.get("observation") or {}).get("passages", []))
        )
    )
    calibration = served(report).get("calibration") or (report.get("config") or {}).get("calibration") or {}
    status = calibration.get("status", "") if isinstance(calibration, dict) else ""
    shown = as_text(answer, brag.MAX_ANSWER_CHARS) if isinstance(answer, str) else ""
    if not finished:
        headline = f"### Best so far: {shown}" if shown else "### Working…"
    elif not_found(report):
        guess = report.get("answer")
        guess = as_text(guess, brag.MAX_ANSWER_CHARS) if isinstance(guess, str) and guess else ""
        corpus = as_text(served(report).get("corpus", ""))
        headline = f"## {NOT_FOUND_HEADLINE}\n\n"
        headline += f"A guess, not from them: {guess}\n\n" if guess else ""
        headline += f"{trust_line(report)} · corpus: {corpus}"
    elif shown:
        corpus = as_text(served(report).get("corpus", ""))
        headline = f"## {shown}\n\n{trust_line(report)} · corpus: {corpus}"
        source = (report.get("confidence") or {}).get("source")
        if source:
            headline += f"\n\n> {as_text(source['quote'])}\n>\n> — *{as_text(source['passage'])}*"
    else:
        headline = "## No answer found\n\nNo action returned an answer the controller could vote for."
    if finished:
        headline += f"\n\nRead: {', '.join(map(as_text, read)) if read else 'no passage'}"
        headline += f"\n\nCalibration: {as_text(status)}" if status else ""
    files = files_markdown(report)
    headline += f"\n\n{files}" if files else ""
    totals = totals_markdown(report) if finished else ""
    table = gr.update(value=steps_frame(report), visible=True)
    return progress_markdown(report), headline, posterior_svg(report), table, totals


def starting() -> tuple[Any, ...]:
    """Clear the last run's outputs the moment a new one starts, so nothing stale stays up."""
    return (
        "**Starting** · loading the corpus and the model…",
        "",
        posterior_svg({}),
        gr.update(visible=False),
        "",
    )


def failed() -> str:
    """The progress line after a failed run (the error itself shows as a message)."""
    return "✖ The run failed (the message says why); the last run's results were cleared."


def fitted_on_text(calibration: Mapping[str, Any]) -> str:
    """Which kind of fit a calibration is, on how many questions."""
    fitted_on = calibration.get("fitted_on") or {}
    n, labelled = fitted_on.get("questions"), fitted_on.get("labelled")
    if fitted_on.get("kind") == "mixed":
        return f"a mixed fit on {n} questions, {labelled} with gold answers (EM over the others)"
    if fitted_on.get("kind") == "unlabelled":
        return f"an unlabelled fit on {n} questions (EM)"
    if fitted_on.get("kind") == "self-test":
        checked = fitted_on.get("checked")
        said = brag.self_test_text(fitted_on)
        return f"{said} ({as_text(checked)})" if isinstance(checked, str) and checked else said
    return f"a labelled fit on {calibration.get('n_questions', n)} questions"


def calibration_frame(text: str) -> pd.DataFrame:
    """A fitted calibration per action and agreement level: q, ρ with its 95 % interval, and D."""
    from scipy.stats import beta

    cal = brag.load_calibration(json.loads(text))
    rates = cal.rates()
    rows = []

    def row(name: str, level: str, q: float, a: float, b: float, rate: float, share: str = "") -> None:
        low, high = beta.ppf([0.025, 0.975], a, b)
        rows.append(
            [name, level, f"{q:.2f}", share, f"{a / (a + b):.2f}", f"{low:.2f} – {high:.2f}", f"{rate:.3f}"]
        )

    for action in cal.offered():  # each kind says what its calibration tells apart
        for case in action.kind.cases(action.label, cal.actions[action.label], cal.eta, rates):
            share = f"{case.share:.2f}" if case.share is not None else ""
            row(action.label, case.name, case.q, case.beta.a, case.beta.b, case.rate, share)
    columns = ["Action", "Case", "q (answers)", "share", "ρ (right)", "ρ 95 % interval", "information rate D"]
    return pd.DataFrame(rows, columns=columns)
