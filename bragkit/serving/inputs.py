"""Each remote input, checked and read before any work.

Questions, prices, λ, calibrations, labelled questions, uploads and pasted documents. A path a
caller writes never names a place on this server, a kept fit is named by its pattern, and every
input is bounded by :class:`~serving.limits.Limits`; a refusal says what to fix. No Gradio here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import brag
import calibrate
from bragkit import documents as doc_files
from bragkit import llms
from bragkit.fits import FitStore
from bragkit.serving import parse_worker, uploads

from .callers import SessionUploads
from .limits import Limits, RequestRefused, refused, too_big


def check_question(question: Any, limits: Limits, what: str = "The question") -> str:
    """A non-empty question within the length limit, as written and in the form BRAG reads (NFKC)."""
    if not isinstance(question, str) or not question.strip():
        raise refused(f"{what} is empty.")
    size = max(len(question), doc_files.normalized_length(question, limits.question_chars))
    if size > limits.question_chars:
        raise too_big(what, size, limits.question_chars, "characters", "BRAG_MAX_QUESTION_CHARS")
    return question


MIN_PRICE = 1e-6  # dollars per million tokens


def check_cost(unit: Any, price_in: Any, price_out: Any) -> tuple[str, tuple[float, float] | None]:
    """The unit actions are priced in (empty: the default), with the two prices when it is usd."""
    unit = unit.strip() if isinstance(unit, str) and unit.strip() else brag.DEFAULT_COST_UNIT
    if unit not in brag.COST_UNITS:
        raise refused(f"cost must be one of {', '.join(brag.COST_UNITS)}.")
    if unit != "usd":
        return unit, None
    try:
        prices = (float(price_in), float(price_out))
    except (TypeError, ValueError):
        raise refused("cost usd needs the input and output prices, in dollars per million tokens.") from None
    # NaN fails too; a price is 0 or at least a millionth of a dollar, so a read never costs 0.
    if not all(p == 0 or MIN_PRICE <= p <= 10_000 for p in prices) or max(prices) <= 0:
        raise refused(
            "prices must be 0 or lie between 0.000001 and 10,000 dollars per million tokens, not both 0."
        )
    return unit, prices


def check_lam(lam: Any) -> float:
    """λ as a finite number in [0, 10]."""
    try:
        value = float(lam)
    except (TypeError, ValueError):
        raise refused("λ must be a number.") from None
    if not 0 <= value <= 10:  # NaN fails too
        raise refused("λ must lie between 0 and 10.")
    return value


def read_calibration(
    text: Any,
    corpus_label: str | None,
    model: str,
    shipped: Mapping[str, brag.Calibration],
    kept: FitStore,
    limits: Limits,
) -> brag.Calibration:
    """The calibration a request names: empty, a shipped name, a kept fit's name, or JSON.

    Empty is the one shipped for this model and corpus (``corpus_label`` None: the caller's
    documents), else the hand-set prior. Never a path:
    a kept fit's name is checked against its pattern before its file is opened.
    """
    text = (text or "").strip() if isinstance(text, str) else text
    if not text:
        return brag.shipped_calibration(model, corpus_label, shipped)
    if not isinstance(text, str):
        raise refused("calibration must be JSON text or the name of a calibration.")
    if text in shipped:
        return shipped[text]
    if kept.path(text) is not None:
        try:
            return kept.load(text)
        except brag.InputError as err:
            raise refused(str(err)) from None
    if not text.startswith("{"):
        raise refused(
            "calibration must be the JSON that /calibrate returns, the name it gave, or one of the "
            "shipped names: " + ", ".join(shipped)
        )
    size = len(text.encode())
    if size > limits.calibration_bytes:
        raise too_big(
            "The calibration", size, limits.calibration_bytes, "bytes", "BRAG_MAX_CALIBRATION_BYTES"
        )
    try:
        return brag.calibration_from_dict(brag.parse_json(text, "calibration"))
    except brag.InputError as err:
        raise refused(str(err)) from None


def read_labelled(text: Any, limits: Limits, self_test: bool = False) -> list[calibrate.Labelled]:
    """Questions, with or without gold, from JSON or JSON Lines text (never a path), within limits.

    With ``self_test`` they are added to a self-test's questions: none is fine, and those
    without gold are left out.
    """
    if self_test and (text is None or (isinstance(text, str) and not text.strip())):
        return []
    if not isinstance(text, str) or not text.strip():
        raise refused(
            f'No questions: paste a JSON list of {{"question", "gold": [...]}} objects or of '
            f"questions ({limits.labelled_min} to {limits.labelled_max})."
        )
    size = len(text.encode())
    if size > limits.labelled_bytes:
        raise too_big(
            "The labelled questions", size, limits.labelled_bytes, "bytes", "BRAG_MAX_LABELLED_BYTES"
        )
    if not text.strip().startswith(("[", "{")):
        raise refused(
            'questions must be a JSON list of {"question", "gold": [...]} objects or of questions, '
            "or JSON Lines."
        )
    try:
        items = calibrate.read_questions(text)
    except brag.InputError as err:
        raise refused(str(err)) from None
    minimum = 0 if self_test else limits.labelled_min
    if not minimum <= len(items) <= limits.labelled_max:
        raise refused(
            f"calibration needs at least {limits.labelled_min} and at most {limits.labelled_max} labelled "
            f"questions (BRAG_MIN_LABELLED / BRAG_MAX_LABELLED), got {len(items)}."
        )
    for number, item in enumerate(items, 1):
        check_question(item.question, limits, f"Question {number}")
        for gold in item.gold:
            size = max(len(gold), doc_files.normalized_length(gold, MAX_GOLD_CHARS))
            if size > MAX_GOLD_CHARS:
                raise refused(
                    f"Question {number}: a gold answer of {size:,} characters; answers are short "
                    f"(at most {MAX_GOLD_CHARS:,} characters)."
                )
    return items


# A reader's answer is cut at brag.MAX_ANSWER_CHARS; a gold answer far longer can never match it.
MAX_GOLD_CHARS = 1_000


def read_uploads(
    files: Any,
    limits: Limits,
    kept: SessionUploads | None = None,
    session: str = "",
    ledger: uploads.UploadLedger | None = None,
    *,
    folder: Path,
) -> tuple[list[tuple[str, bytes]], list[doc_files.Unreadable]]:
    """The uploaded files' names and bytes, each deleted from disk once read; and those not read.

    Only files stored in the upload ``folder`` (Gradio's) are read, or ones this session
    uploaded before (``kept``): a path a caller writes into a request never names a place on
    this server. A file over its size (``BRAG_MAX_FILE_BYTES``; a .zip, all the files') is not
    read and is named with why; the others are read.
    """
    if files is None or files == []:
        return [], []
    files = files if isinstance(files, list) else [files]
    if len(files) > limits.files:
        raise too_big("The upload", len(files), limits.files, "files", "BRAG_MAX_FILES")
    found = _uploaded(files, limits, kept, session, ledger, folder.resolve())
    read: list[tuple[str, bytes]] = []
    over: list[doc_files.Unreadable] = []
    try:
        total = 0
        for entry in found:
            name, size = (
                (entry.name, entry.stat().st_size) if isinstance(entry, Path) else (entry[0], len(entry[1]))
            )
            cap = limits.upload_file_bytes() if doc_files.is_archive(name) else limits.file_bytes
            if size > cap:
                setting = "BRAG_MAX_FILES_BYTES" if cap > limits.file_bytes else "BRAG_MAX_FILE_BYTES"
                reason = f"{size:,} bytes, over the limit of {cap:,} ({setting})"
                over.append(doc_files.Unreadable(doc_files.display_name(name), reason, too_large=True))
                continue
            total += size
            if total > limits.files_bytes:
                raise too_big("The files", total, limits.files_bytes, "bytes", "BRAG_MAX_FILES_BYTES")
            data = entry.read_bytes() if isinstance(entry, Path) else entry[1]
            if isinstance(entry, Path) and kept is not None:
                kept.remember(session, str(entry), name, data)
            read.append((name, data))
    finally:
        for entry in found:
            if isinstance(entry, Path):
                entry.unlink(missing_ok=True)
                if ledger is not None:
                    ledger.release(str(entry))
    return read, over


def _uploaded(
    files: list[Any],
    limits: Limits,
    kept: SessionUploads | None,
    session: str,
    ledger: uploads.UploadLedger | None,
    folder: Path,
) -> list[Path | tuple[str, bytes]]:
    """Each file of a files input: a path in the upload folder, or what this session kept of it."""
    found: list[Path | tuple[str, bytes]] = []
    for item in files:
        path = item.get("path") if isinstance(item, dict) else item
        resolved = Path(path).resolve() if isinstance(path, str) and path and "\0" not in path else None
        if resolved is not None and resolved.is_relative_to(folder) and resolved.is_file():
            found.append(resolved)
        elif resolved is not None and kept is not None and (again := kept.recall(session, str(resolved))):
            found.append(again)
        elif resolved is not None and ledger is not None and ledger.expired(str(resolved)):
            raise refused(
                f"An uploaded file waited more than {limits.upload_ttl:g} s for a question and was deleted "
                "(BRAG_UPLOAD_TTL_SECONDS): upload it again."
            )
        else:
            raise refused("Files must be uploaded with the request (a file input, or handle_file).")
    return found


def documents_from_files(
    files: list[tuple[str, bytes]],
    limits: Limits,
    readers: parse_worker.FileReaders,
    cancelled: Callable[[], bool] = lambda: False,
    caller: str = "",
    *,
    not_read: Sequence[doc_files.Unreadable] = (),
    on_file: Callable[[int, int, str], None] | None = None,
) -> tuple[list[Any], doc_files.Reading]:
    """Uploaded files cut into passages, read in a capped worker process; and what was read of them.

    A file that cannot be read is named with why (in the reading's ``failed``, after
    ``not_read``, those refused before) and the others are read; none readable is a clear
    error. ``on_file(number, total, label)`` before each file (a .zip's members each count).
    The reading is part of the request: it ends at the request's deadline, and when the caller
    (its address) has gone (``cancelled``).
    """
    left = llms.time_left(error=parse_worker.ReadingAbandoned)
    deadline = None if left is None else time.monotonic() + left
    try:
        reading = readers.read_each(
            files,
            limits.file_limits(),
            on_file=on_file,
            deadline=deadline,
            cancelled=cancelled,
            caller=caller,
        )
    except doc_files.DocumentError as err:
        raise refused(f"{err}.") from None
    reading.failed[:0] = not_read
    if not reading.read:
        raise none_read(reading.failed)
    passages = doc_files.as_passages(reading.rows)
    if len(passages) > limits.passages:
        raise too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    return passages, reading


NAMED_FAILURES = 5  # files a refusal names when none could be read


def none_read(failed: Sequence[doc_files.Unreadable]) -> RequestRefused:
    """The refusal when no file could be read: the first few with why, and how many more."""
    if not failed:
        return refused(
            f"No file could be read: none of them is a type BRAG reads ({doc_files.described_suffixes()})."
        )
    named = "; ".join(str(f) for f in failed[:NAMED_FAILURES])
    more = f"; and {len(failed) - NAMED_FAILURES:,} more" if len(failed) > NAMED_FAILURES else ""
    return refused(f"No file could be read: {named}{more}.")


def check_documents(documents: str, limits: Limits) -> list[Any]:
    """Pasted documents as passages: a JSON list, or one passage per line; within the limits."""
    size = len(documents.encode())
    if size > limits.documents_bytes:
        raise too_big("The documents", size, limits.documents_bytes, "bytes", "BRAG_MAX_DOCUMENTS_BYTES")
    stripped = documents.strip()
    if stripped.startswith(("[", "{")):
        passages = brag.parse_json(stripped, "documents")
        if not isinstance(passages, list):
            raise refused("documents: a JSON document must be a list of strings or of {title, text} objects.")
    else:
        passages = [line for line in stripped.splitlines() if line.strip()]
    if len(passages) > limits.passages:
        raise too_big("The documents", len(passages), limits.passages, "passages", "BRAG_MAX_PASSAGES")
    check_normalized(passages, limits.documents_bytes)
    return passages


def check_normalized(passages: list[Any], limit: int) -> None:
    """Pasted passages hold at most ``limit`` characters in the form BRAG reads (NFKC).

    Each character of the pasted text is at least a byte, so text within the byte limit holds
    at most that many characters as written; NFKC can make one character eighteen, and every
    later step (the index, the reads' checks) works on that form.
    """
    left = limit
    for item in passages:
        fields = [item] if isinstance(item, str) else list(item.values()) if isinstance(item, dict) else []
        for text in fields:
            if isinstance(text, str):
                left -= doc_files.normalized_length(text, max(left, 0))
        if left < 0:
            raise refused(
                f"The documents hold more than {limit:,} characters once normalised (Unicode NFKC, "
                "the form BRAG reads text in): some characters stand for many (BRAG_MAX_DOCUMENTS_BYTES)."
            )
