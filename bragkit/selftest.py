"""Self-test questions: questions with known answers, written from a corpus's own passages.

A user's documents are not the benchmarks BRAG was calibrated on, and users rarely label
questions. So BRAG writes its own (docs/calibration.md, "Your documents"):

1. **Passages** drawn over the whole corpus: every document, every part of it (:func:`draw`).
2. **An answer span first**, chosen in the passage by its shape: an option, a variable, a
   path, a function, a number, a name (:func:`answer_spans`). A model asked for a question
   *and* its answer gives answers that are wrong, long or cut by a line break; a span taken
   from the text is the passage's own words.
3. **A question for that span**, from the generator model (the reader by default), in the
   passage's language, worded as a user would ask rather than copied (:func:`question_messages`).
4. **Checks**, each refusing a pair and counted in the :class:`Yield`: the question names the
   span, or is a near-duplicate of one kept; the question does not find its passage among the
   top ``FIND_WITHIN`` retrieved (it is too vague to be asked of the corpus); a read of the
   passage alone does not give the span back (the roundtrip of Alberti et al., 2019).

:func:`self_test` returns the kept pairs; ``fits.calibrate_corpus`` runs every action on
them and refits the model's shipped fit (``calibrate.self_test_fit``).
Every call goes through the LLM handed in (a cache, a budget) and the :class:`Budget` here
bounds tries, calls and seconds; ``should_stop`` cancels between calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import random
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import brag

# A question must find its passage this deep in the ranking to be asked of the corpus at all.
FIND_WITHIN = 20
# Two questions this similar (Jaccard of their words) ask the same thing.
NEAR_DUPLICATE = 0.6
MAX_SPAN_CHARS = 60
DRAW_POOL = 4  # positions looked at per passage drawn (a collection is never read whole)
PASSAGES_PER_TRY = 8  # passages drawn per try the budget allows: many have no answer of a known shape
SPANS_PER_PASSAGE = 2
ROUNDS = 3  # passes over the drawn passages, each with every passage's next span
RARE_SHARE = 0.02  # an answer's rarest word stands in at most this share of the passages
QUESTION_TOKENS = 48
# Candidate spans looked at in one passage: each costs a count over the passage, so a passage
# of nothing but identifiers must not cost its length squared.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class Budget:
    """What one self-test may spend: questions to keep, pairs to try, LLM calls, seconds."""

    questions: int = 30
    tries: int = 75
    calls: int = 160  # generation and roundtrip calls together
    seconds: float = 600.0
    prompt_chars: int = 3_000_000  # characters of every prompt sent, in all (:class:`Metered`)
    question_chars: int = 4_000  # a written question longer than this (as written or NFKC) is refused

    def __post_init__(self) -> None:
        if not (1 <= self.questions <= self.tries and self.calls >= 2 and self.seconds > 0):
            raise brag.InputError("self-test budget: 1 <= questions <= tries, calls >= 2, seconds > 0")
        if self.prompt_chars < 1 or self.question_chars < 1:
            raise brag.InputError("self-test budget: prompt_chars and question_chars must be positive")


@dataclass
class Yield:
    """How many pairs each check refused, and how many were kept, of those tried."""

    tried: int = 0  # questions asked of the generator
    no_span: int = 0  # passages passed over: no rare answer span of a known shape
    no_question: int = 0  # the generator wrote nothing usable
    names_answer: int = 0
    duplicate: int = 0
    vague: int = 0  # the question does not find its passage
    roundtrip: int = 0  # a read of the passage alone does not give the span back
    kept: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Its counts, and the share of tries kept."""
        return {**asdict(self), "rate": round(self.kept / self.tried, 4) if self.tried else 0.0}


@dataclass(frozen=True)
class Pair:
    """A kept question, its answer span, and the passage it was written from."""

    question: str
    answer: str
    passage: int
    source: str  # the passage's label (file and heading)


@dataclass
class SelfTest:
    """The kept pairs, the filter's yield, and what writing them cost."""

    pairs: list[Pair]
    yield_: Yield
    generator: str
    language: str
    calls: int = 0
    seconds: float = 0.0
    stopped: str = ""  # why it ended before keeping enough: "budget", "time", "cancelled", "passages"
    pairs_tried: list[dict[str, Any]] = field(default_factory=list)  # every try and its verdict

    def summary(self) -> dict[str, Any]:
        """What a calibration records of it (``fitted_on``)."""
        return {
            "generator": self.generator,
            "language": self.language,
            "yield": self.yield_.as_dict(),
            "generation_calls": self.calls,
            "generation_seconds": round(self.seconds, 1),
            **({"stopped": self.stopped} if self.stopped else {}),
        }


# ------------------------------------------------------------------------------------------
# Passages and answer spans
# ------------------------------------------------------------------------------------------


def draw(corpus: brag.Retriever, n: int, seed: int = 0) -> list[int]:
    """``n`` passage ids spread over the corpus: documents in turn, each at evenly spaced parts.

    At most ``DRAW_POOL`` times ``n`` positions, evenly spaced over the whole corpus, are looked
    at (a large collection is never read whole); they are grouped by document
    (:meth:`brag.Passage.document`) in corpus order, each document gives passages at evenly
    spaced positions with a seeded offset, and documents take turns, so a corpus of many files
    is covered before any file is read twice.
    """
    rng = random.Random(seed)
    size = len(corpus)
    looked = min(size, DRAW_POOL * max(1, n))
    stride = size / looked if looked else 1.0
    start = rng.random() * stride if looked < size else 0.0
    groups: dict[str, list[int]] = {}
    for i in dict.fromkeys(min(size - 1, int(start + j * stride)) for j in range(looked)):
        groups.setdefault(corpus[i].document(i), []).append(i)
    per_doc = -(-n // max(1, len(groups)))
    spread: list[list[int]] = []
    for ids in groups.values():
        step = max(1.0, len(ids) / per_doc)
        offset = rng.random() * step
        picked = list(dict.fromkeys(ids[min(len(ids) - 1, int(offset + j * step))] for j in range(per_doc)))
        rng.shuffle(picked)
        spread.append(picked)
    rng.shuffle(spread)
    order = [ids[j] for j in range(per_doc) for ids in spread if j < len(ids)]
    return order[:n]


# Answer shapes. An option is the most specific, but a question for one is rarely answered
# with it word for word (a read names the setting, or another spelling), so options come last
# in the preference (bench/results/documents_fit.md has the yield of each shape); an option on a
# line of its own, with its description under it, still comes first (_defined_terms).
_OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*[A-Za-z0-9](?:=[\w./-]+)?")
_PATH = re.compile(r"(?<![\w/])(?:~|\.)?/(?:[\w.-]+/)*[\w.-]*\w|~/\.?[\w.-]+")
_FUNCTION = re.compile(r"\b[A-Za-z_][\w.]*\(\)")
_VARIABLE = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b|\b[A-Z]{4,}[0-9]*\b")  # or a constant
_IDENTIFIER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
_NAMED = re.compile(r"(?:(?<=\bnamed )|(?<=\bcalled ))\w[\w.-]*\w")  # a thing named so
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?![\w.]|[.,]\d)")
# A name in the middle of a sentence (a capitalised run after a lower-case word).
_NAME_SHAPE = re.compile(
    r"(?<=[a-z,] )[A-Z][a-z]+(?: (?:[A-Z][a-z]+|de|von|van|of))* [A-Z][a-z]+\b(?! [A-Z])"
)
_QUOTED = re.compile(r"[\"“‘`「『]([^\"”’`」』\n]{2,40})[\"”’`」』]")  # a quoted term
_SHAPES: tuple[re.Pattern[str], ...] = (
    _PATH,
    _FUNCTION,
    _VARIABLE,
    _IDENTIFIER,
    _NAMED,
    _NUMBER,
    _NAME_SHAPE,
    _QUOTED,
    _OPTION,
)
_DEFINED_SHAPES = (_OPTION, _PATH, _FUNCTION, _VARIABLE, _IDENTIFIER)  # a term on a line of its own
# Numbers that label the text rather than say something: years in a copyright line, section numbers.
_LABEL_LIKE = re.compile(r"^(?:19|20)\d\d$|^\d+\.\d+\.")
# A cross-reference names a page or a section: "Section 3.8 [Shell Scripts], page 91".
_REFERENCE = re.compile(r"(?:page|pages|p\.|section|chapter|seite|abschnitt|kapitel)\s*$", re.IGNORECASE)
_RUNNING_HEAD = re.compile(r"(?:Chapter|Kapitel|Chapitre|Appendix|Anhang) [\dA-Z]+: [^.]{0,60}? \d+\b")
# A sentence ends at a full stop and a space, or at a CJK full stop with or without one.
_SENTENCE = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])\s*|\n+")
MIN_SENTENCE_WORDS = 6  # a span is taken from a statement, not from a heading or a list entry
MAX_SENTENCE_CHARS = 400
_UNSPACED = re.compile(f"[{brag.UNSPACED_SCRIPTS}]")


def word_count(text: str) -> int:
    """Words in ``text``; in a script written without spaces, two characters count as one word.

    So a Japanese or Chinese sentence passes the same length checks as a German one.
    """
    spaced = len(text.split())
    unspaced = len(_UNSPACED.findall(text))
    return spaced if not unspaced else max(spaced, len(_UNSPACED.sub(" ", text).split()) + unspaced // 2)


# Languages that capitalise every noun: a capitalised run mid-sentence is a noun phrase there
# ("Reihe von Dateisystempfaden"), not a name, and a read rarely gives one back word for word.
_CAPITALISED_NOUNS = frozenset({"de"})


def _shapes_for(text: str) -> tuple[re.Pattern[str], ...]:
    """The answer shapes for a passage: without names where every noun is capitalised."""
    if brag.language_of(text[:2000]) in _CAPITALISED_NOUNS:
        return tuple(shape for shape in _SHAPES if shape is not _NAME_SHAPE)
    return _SHAPES


@dataclass(frozen=True)
class Span:
    """A candidate answer, and the sentence of the passage it stands in."""

    text: str
    sentence: str

    def cloze(self) -> str:
        """The sentence with the answer blanked out: what the generator turns into a question."""
        return self.sentence.replace(self.text, "____", 1)


def is_listing(text: str) -> bool:
    """Whether a passage is a table of contents or an index: leader dots, or mostly numbers."""
    tokens = text.split()
    numbers = sum(token.rstrip(".,;").isdigit() for token in tokens)
    return text.count(". . .") >= 3 or (len(tokens) >= 20 and numbers >= 0.2 * len(tokens))


def answer_spans(text: str, title: str = "", check: Callable[[], None] = lambda: None) -> list[Span]:
    """Short answer spans in ``text``, best first, each with its sentence.

    A span must stand once in the passage (so the question has one answer there), in a
    sentence of at least ``MIN_SENTENCE_WORDS`` words (headings and index entries are not
    statements; a PDF's line breaks are gone by then), not be a page or section reference, a
    bracketed title or a word cut by a hyphen, nor part of the title (a question about the
    heading is answered by the heading), and be at most ``MAX_SPAN_CHARS`` long. A table of
    contents or an index gives none. Terms a reference defines on a line of their own come first
    (:func:`_defined_terms`); then shapes in the order of ``_SHAPES``, within one earlier in the
    passage first.

    The work is linear in the passage: at most ``MAX_CANDIDATES`` distinct candidates are
    counted, each once; ``check()`` is called as it goes (it raises to stop the work).
    """
    if is_listing(text):
        return []
    seen = _Occurrences(text, title.casefold(), check)
    found: dict[str, Span] = {}
    try:
        _defined_terms(text, seen, found)
        sentences = [
            " ".join(part.split())
            for part in _SENTENCE.split(text)
            if word_count(part) >= MIN_SENTENCE_WORDS and len(part) <= MAX_SENTENCE_CHARS
        ]
        for pattern in _shapes_for(text):
            for number, sentence in enumerate(sentences):
                if number % 64 == 0:
                    check()
                if _RUNNING_HEAD.search(sentence):  # a PDF page's running head holds its page number
                    sentence = _RUNNING_HEAD.sub(" ", sentence)
                for match in pattern.finditer(sentence):
                    span = (match.group(1) if match.groups() else match.group(0)).strip(" .,;:")
                    if _is_reference(sentence, match.start(), match.end()) or span in found:
                        continue
                    if seen.usable(span):
                        found[span] = Span(span, sentence)
    except _EnoughCandidates:
        pass
    return list(found.values())


class _EnoughCandidates(Exception):
    """A passage has given ``MAX_CANDIDATES`` candidates: the rest are not looked at."""


class _Occurrences:
    """The candidate spans of one passage, judged against it.

    The passage is flattened once and each candidate counted once, at most ``MAX_CANDIDATES``.
    """

    def __init__(self, text: str, folded_title: str, check: Callable[[], None]) -> None:
        self.flat, self.folded_title, self.check = " ".join(text.split()), folded_title, check
        self.counts: dict[str, int] = {}

    def usable(self, span: str) -> bool:
        """Whether ``span`` is a short answer that stands once in the passage and not in its title."""
        if not 2 <= len(span) <= MAX_SPAN_CHARS or _LABEL_LIKE.search(span):
            return False
        if span.casefold() in self.folded_title:
            return False
        if not brag.normalize_answer(span) or brag.is_no_answer(span):
            return False
        if span not in self.counts:
            if len(self.counts) >= MAX_CANDIDATES:
                raise _EnoughCandidates
            self.check()
            self.counts[span] = self.flat.count(span)
        return self.counts[span] == 1


def _defined_terms(text: str, seen: _Occurrences, found: dict[str, Span]) -> None:
    """Terms a reference defines on a line of their own, each with the sentence under it, into ``found``.

    Option and setting lists put the term alone on a line ("--smarthome", "set afterends") and
    describe it on the next; the description is the sentence the question is asked from, with
    the term in front of it ("____: Make the Home key smarter.").
    """
    lines = [" ".join(line.split()) for line in text.splitlines()]
    for number, (term, described) in enumerate(itertools.pairwise(lines)):
        if number % 64 == 0:
            seen.check()
        words = term.split()
        if not 1 <= len(words) <= 3 or word_count(described) < MIN_SENTENCE_WORDS:
            continue
        shaped = next((m.group(0) for p in _DEFINED_SHAPES if (m := p.search(term))), None)
        if shaped is not None and shaped not in found and seen.usable(shaped):
            sentence = described.split(". ")[0].rstrip(".")
            found[shaped] = Span(shaped, f"{term}: {sentence[:MAX_SENTENCE_CHARS]}.")


def _is_reference(line: str, start: int, end: int) -> bool:
    """A page or section reference, a bracketed title, a heading's number, or a word cut by a hyphen."""
    before, after = line[max(0, start - 12) : start], line[end : end + 3]
    if _REFERENCE.search(before) or before.endswith("[") or after.startswith(("]", "-", "- ")):
        return True
    return bool(re.fullmatch(r"\d+(?:\.\d+)+", line[start:end])) and after[1:2].isupper()


# ------------------------------------------------------------------------------------------
# The generator's prompt, and the checks
# ------------------------------------------------------------------------------------------

# The generator sees the sentence with its answer blanked out, and neither the passage nor the
# answer: a small model shown a passage asks about something else in it, and one shown the
# answer puts it in the question. A sentence is a short prompt, too.
_QUESTION_INSTRUCTIONS = (
    "You turn a fill-in-the-blank sentence from a manual into a question whose answer is what "
    "fills the blank (____). Write one short question, as a user of the manual would ask it, in "
    "your own words rather than the sentence's. Name what it is about (the program, command, "
    "option or setting), so that it can be understood without the sentence."
)
_QUESTION_EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        "With --tries=number, wget retries a failed download; the default is to retry ____ times.",
        "Question: How many times does wget retry a failed download by default?",
    ),
    (
        "Options are also taken from the environment variable ____, which less reads when it starts.",
        "Question: Which environment variable can hold default options for less?",
    ),
    ("Lake Orla lies in ____ and covers 12 square kilometres.", "Question: In which country is Lake Orla?"),
)


def _question_turn(cloze: str) -> str:
    return f"Sentence: {cloze}"


def question_messages(passage: brag.Passage, span: Span) -> list[dict[str, str]]:
    """The generator's prompt: worked examples, then the passage's source and the blanked sentence.

    For a passage in another language, the question is asked for in that language.
    """
    language = brag.language_of(passage.shown())
    named = brag.LANGUAGE_NAMES.get(language, "the language of the sentence")
    said = "" if language == "en" else f" Write the question in {named}, the language of the sentence."
    messages = [{"role": "system", "content": _QUESTION_INSTRUCTIONS + said}]
    for cloze, reply in _QUESTION_EXAMPLES:
        messages += [
            {"role": "user", "content": _question_turn(cloze)},
            {"role": "assistant", "content": reply},
        ]
    return [*messages, {"role": "user", "content": _question_turn(span.cloze())}]


_LABELLED = re.compile(r"([^:：]{1,24})[:：](.*)")  # "Question: …", "質問：…"
# How a generator labels its question, in the languages a self-test asks in.
_QUESTION_LABELS = frozenset(
    (
        "question",
        "frage",
        "question posée",
        "pregunta",
        "domanda",
        "pergunta",
        "vraag",
        "问题",
        "問題",
        "質問",
        "질문",
    )
)


def parse_question(text: str, max_chars: int = Budget.question_chars) -> str:
    """The question in a generator's reply: its ``Question:`` line, else its first line ending in ?.

    None ("") when that question is longer than ``max_chars``, as written or in the form BRAG
    reads (NFKC): a written question obeys the limits a caller's question does.
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in lines:
        labelled = _LABELLED.match(line)
        if labelled and labelled.group(1).strip().casefold() in _QUESTION_LABELS:
            line = labelled.group(2).strip()
        if line.endswith(("?", "？")) and 3 <= word_count(line) <= 40:
            question = " ".join(line.split())
            fits = len(question) <= max_chars and len(unicodedata.normalize("NFKC", question)) <= max_chars
            return question if fits else ""
    return ""


def names_answer(question: str, span: str) -> bool:
    """Whether the question holds the span (by words, so "--quiet" is found in "the quiet flag")."""
    asked = f" {brag.normalize_answer(question)} "
    return f" {brag.normalize_answer(span)} " in asked


def _words(text: str) -> frozenset[str]:
    return frozenset(brag.tokenize(text))


def is_near_duplicate(question: str, kept: Sequence[str]) -> bool:
    """Whether ``question`` shares at least ``NEAR_DUPLICATE`` of its words with a kept one."""
    mine = _words(question)
    for other in kept:
        theirs = _words(other)
        if mine and theirs and len(mine & theirs) / len(mine | theirs) >= NEAR_DUPLICATE:
            return True
    return False


def focused_read_options(seed: int = brag.BRAG.seed) -> dict[str, Any]:
    """The options of a controller's read (``BRAG``'s defaults): a roundtrip sends exactly these."""
    return {
        "n": 1,
        "temperature": 0.0,
        "max_tokens": brag.BRAG.max_tokens,
        "stop": brag.READ_STOP,
        "seed": seed,
    }


def roundtrip(
    reader: brag.LLM, question: str, passage: brag.Passage, span: str, seed: int = brag.BRAG.seed
) -> tuple[bool, str]:
    """Whether a read of the passage alone answers ``question`` with ``span``, and its answer.

    The request is the focused read's of that passage (its prompt and options): when the
    question's retrieval ranks its own passage first, the focused read's observation is this
    reply (:class:`Remembered`), not a second call.
    """
    question = " ".join(question.split())  # as the controller reads it
    send = getattr(reader, "complete_and_keep", reader.complete)  # kept for the focused read
    reply = send(brag.read_messages(question, [passage]), **focused_read_options(seed))
    answer, _ = brag.parse_reading(reply.texts[0] if reply.texts else "")
    return brag.is_correct(answer, [span]), answer


# ------------------------------------------------------------------------------------------
# The self-test
# ------------------------------------------------------------------------------------------


class Cancelled(RuntimeError):
    """The caller asked the self-test to stop."""


class OutOfBudget(Exception):
    """One of a self-test's bounds ran out; the message names it: budget, time, prompt characters, turn."""


@dataclass
class Meter:
    """What a self-test has spent against its bounds: seconds and prompt characters.

    One meter is shared by every model a self-test calls (:class:`Metered`), so its bounds
    hold for everything it does, writing questions and running actions on them alike.
    """

    seconds: float
    prompt_chars: int
    should_stop: Callable[[], bool] | None = None
    started: float = field(default_factory=lambda: time.monotonic())
    chars: int = 0
    # Whether its turn is over (others wait for the lane): it ends as when time runs out.
    should_yield: Callable[[], bool] | None = None

    def check(self) -> None:
        """:class:`Cancelled` once ``should_stop()`` says so; :class:`OutOfBudget` once time or turn is over.

        Its turn is over once ``should_yield()`` says so (others wait for the lane).
        """
        if self.should_stop is not None and self.should_stop():
            raise Cancelled("self-test cancelled")
        if time.monotonic() - self.started > self.seconds:
            raise OutOfBudget("time")
        if self.should_yield is not None and self.should_yield():
            raise OutOfBudget("turn")

    def charge(self, messages: Sequence[dict[str, Any]]) -> None:
        """Count one call's prompt, after :meth:`check`; :class:`OutOfBudget` past the characters allowed."""
        self.check()
        chars = sum(len(str(message.get("content") or "")) for message in messages)
        if self.chars + chars > self.prompt_chars:
            raise OutOfBudget("prompt characters")
        self.chars += chars


class Metered:
    """An LLM held to a :class:`Meter`: each call first asks the stop, the clock and the characters left."""

    def __init__(self, llm: brag.LLM, meter: Meter) -> None:
        self.llm, self.meter = llm, meter
        self.name = brag.llm_name(llm)  # the same model: its calibration and cached responses

    def complete(self, messages: list[dict[str, str]], **options: Any) -> brag.Completion:
        """The inner model's completion, once the meter allows the call."""
        self.meter.charge(messages)
        return self.llm.complete(messages, **options)

    def complete_and_keep(self, messages: list[dict[str, str]], **options: Any) -> brag.Completion:
        """A roundtrip's call, once the meter allows it: kept if the inner model keeps replies."""
        self.meter.charge(messages)
        return getattr(self.llm, "complete_and_keep", self.llm.complete)(messages, **options)


class Remembered:
    """An LLM that answers a focused read from the roundtrip that sent the same request.

    A roundtrip and the focused read of the same passage on the same question are one request:
    :meth:`complete_and_keep` (the roundtrip's) keeps its reply, and :meth:`complete` answers
    that request once from it (``cached``, with the seconds the call took), costing no call and
    no prompt characters. Only those replies are kept, by digest, each forgotten once used, at
    most ``limit`` and none longer than a read keeps, so a self-test's memory stays bounded
    whatever a model sends.
    """

    def __init__(self, llm: brag.LLM, limit: int = 1024) -> None:
        self.llm, self.limit = llm, limit
        self.name = brag.llm_name(llm)  # the same model: its calibration and cached responses
        self.replies: dict[str, brag.Completion] = {}

    @staticmethod
    def _key(messages: list[dict[str, str]], options: dict[str, Any]) -> str:
        request = json.dumps([messages, options], sort_keys=True, default=str)
        return hashlib.sha256(request.encode("utf-8", "surrogatepass")).hexdigest()

    def complete(self, messages: list[dict[str, str]], **options: Any) -> brag.Completion:
        """The kept reply to this exact request (then forgotten), else the inner model's."""
        kept = self.replies.pop(self._key(messages, options), None)
        if kept is not None:
            return dataclasses.replace(kept, cached=True)
        return self.llm.complete(messages, **options)

    def complete_and_keep(self, messages: list[dict[str, str]], **options: Any) -> brag.Completion:
        """The inner model's reply, kept for the same request once, if it is small enough."""
        started = time.monotonic()
        reply = self.llm.complete(messages, **options)
        if reply.seconds is None:  # a hit still says what the call took (costs in seconds)
            reply = dataclasses.replace(reply, seconds=time.monotonic() - started)
        pieces = (piece for tokens in reply.logprobs or () for piece, _ in tokens)
        size = sum(len(text) for text in reply.texts) + sum(len(piece) for piece in pieces)
        if size <= 2 * brag.MAX_REPLY_CHARS and len(self.replies) < self.limit:
            self.replies[self._key(messages, options)] = reply
        return reply


def self_test(
    corpus: brag.Retriever,
    reader: brag.LLM,
    *,
    generator: brag.LLM | None = None,
    budget: Budget = Budget(),
    seed: int = 0,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SelfTest:
    """Write up to ``budget.questions`` checked questions from ``corpus``.

    ``generator`` writes the questions (default: the ``reader``); the reader makes the
    roundtrip check, as it will answer them. Ends when enough are kept, or the budget's tries,
    calls, seconds or prompt characters run out, or ``should_stop()`` says so (asked before every
    call, every passage and inside the span finder): what was kept so far is returned, with
    ``stopped`` saying why.
    """
    if len(corpus) == 0:
        raise brag.InputError("self-test: the corpus has no passages")
    meter = Meter(budget.seconds, budget.prompt_chars, should_stop)
    writer = Metered(generator or reader, meter)
    reader = Metered(reader, meter)
    sample = " ".join(corpus[i].shown() for i in draw(corpus, 20, seed))
    result = SelfTest([], Yield(), brag.llm_name(writer), brag.language_of(sample[:20_000]))

    def spend() -> None:
        meter.check()
        if result.calls >= budget.calls:
            raise OutOfBudget("budget")
        result.calls += 1

    passages = draw(corpus, min(len(corpus), PASSAGES_PER_TRY * budget.tries), seed)
    asked: dict[int, set[str]] = {}  # the spans each passage has been asked about
    spans: dict[int, list[Span]] = {}  # each passage's rare spans, found once for every round
    try:
        # A small corpus runs out of passages first: each later round asks about the next span
        # of every passage that has one, in the same order.
        for _ in range(ROUNDS):
            for passage_id in passages:
                if len(result.pairs) >= budget.questions:
                    break
                if result.yield_.tried >= budget.tries:
                    raise OutOfBudget("budget")
                meter.check()
                if passage_id not in spans:
                    spans[passage_id] = _rare_spans(corpus, passage_id, meter.check)
                try_ = _Try(corpus, passage_id, reader, writer, spend, result, budget.question_chars)
                verdict = try_.passage(spans[passage_id], asked.setdefault(passage_id, set()))
                if on_progress is not None and verdict not in ("no_span", "done"):
                    on_progress(len(result.pairs), budget.questions, verdict)
        if len(result.pairs) < budget.questions:
            result.stopped = "passages"
    except OutOfBudget as out:
        result.stopped = str(out)
    except Cancelled:
        result.stopped = "cancelled"
    result.seconds = time.monotonic() - meter.started
    result.yield_.kept = len(result.pairs)
    return result


def _rare(corpus: brag.Retriever, span: str) -> bool:
    """Whether a span's rarest word stands in few passages: a common one makes the question ambiguous."""
    tokens = brag.tokenize(span, getattr(corpus, "analyzer", None))
    limit = max(RARE_SHARE, 2 / max(1, len(corpus)))
    return bool(tokens) and min(corpus.document_share(t) for t in tokens) <= limit


def _rare_spans(corpus: brag.Retriever, passage_id: int, check: Callable[[], None]) -> list[Span]:
    """A passage's answer spans whose words are rare in the corpus, best first."""
    passage = corpus[passage_id]
    return [
        span for span in answer_spans(passage.shown_body(), passage.title, check) if _rare(corpus, span.text)
    ]


@dataclass(frozen=True)
class _Try:
    """One passage's turn in a round: what it needs to write, check and count questions."""

    corpus: brag.Retriever
    passage_id: int
    reader: brag.LLM
    writer: brag.LLM
    spend: Callable[[], None]
    result: SelfTest
    question_chars: int

    def passage(self, spans: list[Span], asked: set[str]) -> str:
        """Its spans not yet ``asked`` in turn until a question for one is worth checking.

        A question that names its answer, or no question at all, says the span was hard to ask
        for, so the passage's next span gets a try (``SPANS_PER_PASSAGE`` in all). The verdict,
        or "done" when every span of the passage has been asked about.
        """
        if not spans:
            if not asked:  # counted once, in the first round
                asked.add("")
                self.result.yield_.no_span += 1
                passage = self.corpus[self.passage_id]
                self.result.pairs_tried.append(
                    {"passage": self.passage_id, "source": passage.label(), "verdict": "no_span"}
                )
            return "no_span"
        verdict = "done"
        for span in [span for span in spans if span.text not in asked][:SPANS_PER_PASSAGE]:
            asked.add(span.text)
            verdict = self.span(span)
            if verdict not in ("names_answer", "no_question"):
                break
        return verdict

    def span(self, span: Span) -> str:
        """Ask for a question whose answer is ``span``, check it, count the verdict in the yield."""
        corpus, passage_id, result = self.corpus, self.passage_id, self.result
        passage = corpus[passage_id]
        result.yield_.tried += 1
        self.spend()
        reply = self.writer.complete(
            question_messages(passage, span), max_tokens=QUESTION_TOKENS, stop=["\n\n"]
        )
        question = parse_question(reply.texts[0] if reply.texts else "", self.question_chars)
        tried = {"passage": passage_id, "source": passage.label(), "answer": span.text, "question": question}
        verdict = _check(corpus, passage_id, question, span.text, result.pairs)
        if verdict == "ok":
            self.spend()
            right, tried["read"] = roundtrip(self.reader, question, passage, span.text)
            verdict = "kept" if right else "roundtrip"
        if verdict == "kept":
            result.pairs.append(Pair(question, span.text, passage_id, passage.label()))
        else:
            setattr(result.yield_, verdict, getattr(result.yield_, verdict) + 1)
        result.pairs_tried.append({**tried, "verdict": verdict})
        return verdict


def _check(corpus: brag.Retriever, passage_id: int, question: str, span: str, kept: Sequence[Pair]) -> str:
    """The first check the question fails, or "ok" (the roundtrip comes after, as it costs a call)."""
    if not question:
        return "no_question"
    if names_answer(question, span):
        return "names_answer"
    if is_near_duplicate(question, [p.question for p in kept]) or any(
        brag.same_answer(p.answer, span) for p in kept
    ):
        return "duplicate"
    if passage_id not in [i for i, score in corpus.retrieve(question, FIND_WITHIN).hits if score > 0]:
        return "vague"
    return "ok"
