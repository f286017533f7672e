"""BRAG: cost-aware question answering over passages with a closed-form Bayesian controller.

The controller keeps a posterior over candidate answers and picks, between LLM calls, the
action whose next vote is expected to lower P(error) the most per unit cost; it stops when that
gain is worth less than its price ``lam``. It never calls the LLM itself: the actions do.

Sections, each using only those above it (type annotations aside): errors and the LLM
protocol; files (JSON input, the cache); text analysis; answers; posterior; dedup; corpus;
evidence; gate; calibration entries; policy (rates, lookahead, choice); prompts; actions (the
vote kinds ``Read``, ``Hop``, ``Samples`` and ``ACTION_TABLE``); calibration; pricing and the
policy's tables; runner. The command line is ``bragkit/cli.py``. Three entry points:

- ``BRAG(llm).run(question, corpus)`` (runner): ``BRAG.stream`` -> ``_Run.loop``, which
  decides (``_Run._decide``) and acts (``_Run._act``) one step at a time;
- ``Corpus(passages).retrieve(query, k)`` (corpus): BM25, optional dense fusion and dedup;
- ``load_calibration(source)`` (calibration): the reliabilities the controller runs on.

    from brag import BRAG, Corpus
    answer, report = BRAG(llm).run(question, Corpus(passages))

``llm`` is any object with the :class:`LLM` protocol; backends live outside this module.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import string
import sys
import time
import unicodedata
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import bm25s
import numpy as np
from bm25s import stopwords as bm25s_stopwords

# The public API, by section (in the order the sections come): what users import (the
# controller, corpora, calibrations, reports, errors) and what extenders need (the protocols, the
# rows' types and kinds, the evidence list). Everything else is reachable as ``brag.<name>`` for
# calibrate.py, bragkit, tests and benchmarks, but is not promised.
__all__ = [  # noqa: RUF022
    # Errors, and the LLM protocol
    "InputError",
    "CalibrationError",
    "LLM",
    "Completion",
    "llm_name",
    # Files
    "cache_dir",
    # Text analysis
    "Analyzer",
    "language_of",
    "tokenize",
    # Answers
    "exact_match",
    "is_correct",
    "normalize_answer",
    "same_answer",
    "token_f1",
    # Dedup
    "DedupConfig",
    "Embedder",
    "HashingEmbedder",
    "IngestionResult",
    "dedup_ingestion",
    "dedup_ranked",
    # Corpus
    "BM25_VARIANTS",
    "Corpus",
    "Passage",
    "Retrieval",
    "Retriever",
    "ScoringRetriever",
    "cached_corpus",
    "check_retriever",
    "parse_passages",
    # Evidence
    "EVIDENCE",
    "EvidenceFeature",
    "ReadFacts",
    "SeenPassage",
    "Window",
    "evidence_names",
    "read_evidence",
    # Gate
    "Gate",
    "GateSignal",
    "window_signals",
    # Calibration entries
    "ActionPrior",
    "ActionCost",
    "EvidenceCurve",
    # Prompts
    "READ_STOP",
    "closed_book_messages",
    "read_messages",
    # Actions
    "ACTION_TABLE",
    "Action",
    "NextHop",
    "Observation",
    "PolicyState",
    "Reading",
    "StepContext",
    "WindowContext",
    "VoteKind",
    "VoteFacts",
    "VoteType",
    "Read",
    "Hop",
    "Samples",
    "SampledRead",
    "READ",
    "HOP",
    "SAMPLES",
    "SAMPLED_READ",
    "action_labels",
    "action_named",
    "check_actions",
    # Calibration
    "Calibration",
    "FoundModel",
    "calibration_status",
    "ReaderTerms",
    "load_calibration",
    "shipped_calibration",
    "shipped_calibrations",
    "DOCUMENTS",
    "NOT_FOUND",
    # Pricing and the policy's tables
    "COST_UNITS",
    "DEFAULT_COST_UNIT",
    # Runner
    "BRAG",
    "Report",
    "Step",
    "DEFAULT_HOPS",
    "GUESS_BELOW",
    "RunAborted",
]
_HERE = Path(__file__).resolve().parent
# A hand-set prior for a capable reader: every model without a calibration of its own gets it.
PRIOR_CALIBRATION_PATH = _HERE / "data" / "calibration_prior.json"
# Calibrations fitted for particular models, one file per (model, corpus).
CALIBRATIONS_DIR = _HERE / "data" / "calibrations"
_log = logging.getLogger("brag")


# ------------------------------------------------------------------------------------------
# Errors, and the LLM protocol
# ------------------------------------------------------------------------------------------


class InputError(ValueError):
    """Bad input to BRAG: a question, a corpus, a calibration, a setting; the message says what to fix.

    What BRAG raises for its caller's input (``RunAborted`` carries an LLM call's failure):

        ValueError
        └── InputError            a question, passages, a corpus, JSON, a setting
            └── CalibrationError  a calibration, by the field that is wrong

    The app shows these messages (and the backends' ``bragkit.llms.LLMError``) to the caller; any other
    exception is a fault of its own, whose text stays in the server's log.
    """


class CalibrationError(InputError):
    """A calibration BRAG cannot use; the message names the field."""


@dataclass(frozen=True)
class Completion:
    """What one LLM request returned: ``n`` texts and the token usage of the whole request."""

    texts: list[str]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False  # served from a response cache (it was a real call when made)
    estimated: bool = False  # token counts estimated because the server reported none
    requests: int = 1  # HTTP requests (or local generations) behind this call
    seconds: float | None = None  # wall time of the call when it was made; None if unknown
    # Per text, each generated token as (text piece, natural-log probability); None when the
    # backend gave none. The pieces of one text join into its start (a stop string cuts the rest).
    logprobs: list[list[tuple[str, float]]] | None = None


@runtime_checkable
class LLM(Protocol):
    """The one method BRAG needs from a language model backend, and the model's name.

    ``name`` picks the model's shipped calibration, says whether a calibration was fitted for
    it, and keys its cached responses; a backend without one goes by its class name
    (:func:`llm_name`).
    """

    name: str

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        max_tokens: int = 64,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> Completion:
        """Return ``n`` completions of the chat ``messages`` as one request."""
        ...


def llm_name(llm: Any) -> str:
    """``llm.name``, or the class name of a backend that has none (the one fallback, everywhere)."""
    name = getattr(llm, "name", None)
    return name if isinstance(name, str) and name else type(llm).__name__


# ------------------------------------------------------------------------------------------
# Files: JSON input and the cache
# ------------------------------------------------------------------------------------------


def _shown(value: Any, width: int = 40) -> str:
    """A value as an error message may echo it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def parse_json(text: str, what: str) -> Any:
    """``json.loads`` whose error names ``what`` and the place of the fault."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(
            f"{what}: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from None
    except RecursionError:
        raise InputError(f"{what}: the JSON is nested too deeply") from None


def read_json(source: Any, what: str) -> Any:
    """Data from a JSON string, a file path, or already-parsed data (returned as it is)."""
    looks_like_json = isinstance(source, str) and source.lstrip().startswith(("{", "["))
    if isinstance(source, os.PathLike) or (isinstance(source, str) and not looks_like_json):
        path = Path(source)
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as err:
            raise InputError(f"{what}: cannot read {path}: {err.strerror}") from None
        if path.suffix == ".jsonl":
            source = "[" + ",".join(line for line in source.splitlines() if line.strip()) + "]"
    return parse_json(source, what) if isinstance(source, str) else source


def cache_dir() -> Path:
    """Where BRAG keeps files it builds once: ``BRAG_CACHE_DIR``, else ``~/.cache/brag``."""
    configured = os.environ.get("BRAG_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "brag"


# ------------------------------------------------------------------------------------------
# Text analysis: scripts, languages, tokens (one path for BM25, the gate, dedup and answers)
# ------------------------------------------------------------------------------------------


# Scripts written without spaces between words. A run of them is matched by overlapping
# character bigrams, as Lucene's CJK analyser does: no dictionary, no model, any language.
UNSPACED_SCRIPTS = (
    "\u0e00-\u0eff"  # Thai, Lao
    "\u1000-\u1049\u104c-\u109f"  # Myanmar, not its two full stops
    "\u1100-\u11ff"  # Hangul jamo
    "\u1780-\u17d3\u17db-\u17ff"  # Khmer, not its punctuation
    "\u3005-\u3007"  # 々 〆 〇
    "\u3040-\u309f\u30a1-\u30fa\u30fc-\u30ff"  # hiragana, katakana with ー, not ・ or ゠
    "\u3130-\u318f"  # Hangul compatibility jamo
    "\u31f0-\u31ff"  # katakana phonetic extensions
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # Han
    "\uac00-\ud7af"  # Hangul syllables
    "\U00020000-\U0003134f"  # Han extensions
)
_UNSPACED = re.compile(f"[{UNSPACED_SCRIPTS}]+")
_UNSPACED_PIECES = re.compile(f"([{UNSPACED_SCRIPTS}]+)")


def _combining_marks() -> str:
    """The combining marks as a character-class body: vowel signs and viramas belong to words.

    Those of the Basic Multilingual Plane, every living script's: a class with ranges past it
    makes every match several times slower.
    """
    marks = [c for c in range(0x10000) if unicodedata.category(chr(c))[0] == "M"]
    ranges, start = [], marks[0]
    for previous, current in itertools.pairwise([*marks, -1]):
        if current != previous + 1:
            ranges.append(
                re.escape(chr(start)) + ("-" + re.escape(chr(previous)) if previous > start else "")
            )
            start = current
    return "".join(ranges)


# Letters, digits and the marks on them; "_" is a separator ("snake_case" is two words).
_WORD = re.compile(f"[\\w{_combining_marks()}]+")


def _folded(words: Iterable[str]) -> frozenset[str]:
    return frozenset(unicodedata.normalize("NFKC", w).casefold() for w in words)


# Stop words of the languages written with spaces that BRAG knows (bm25s's lists). English keeps
# its short list, which BM25 was tuned with; the longer one only helps tell English apart.
STOPWORDS: dict[str, frozenset[str]] = {
    "en": _folded(bm25s_stopwords.STOPWORDS_EN),
    "da": _folded(bm25s_stopwords.STOPWORDS_DANISH),
    "de": _folded(bm25s_stopwords.STOPWORDS_GERMAN),
    "es": _folded(bm25s_stopwords.STOPWORDS_SPANISH),
    "fr": _folded(bm25s_stopwords.STOPWORDS_FRENCH),
    "it": _folded(bm25s_stopwords.STOPWORDS_ITALIAN),
    "nl": _folded(bm25s_stopwords.STOPWORDS_DUTCH),
    "no": _folded(bm25s_stopwords.STOPWORDS_NORWEGIAN),
    "pt": _folded(bm25s_stopwords.STOPWORDS_PORTUGUESE),
    "ru": _folded(bm25s_stopwords.STOPWORDS_RUSSIAN),
    "sv": _folded(bm25s_stopwords.STOPWORDS_SWEDISH),
    "tr": _folded(bm25s_stopwords.STOPWORDS_TURKISH),
}


LANGUAGE_NAMES = {
    "en": "English",
    "da": "Danish",
    "de": "German",
    "es": "Spanish",
    "fr": "French",
    "it": "Italian",
    "nl": "Dutch",
    "no": "Norwegian",
    "pt": "Portuguese",
    "ru": "Russian",
    "sv": "Swedish",
    "tr": "Turkish",
    "ja": "Japanese",
    "ko": "Korean",
    "th": "Thai",
    "zh": "Chinese",
}


# Which languages list each word as a stop word (English by its longer list).
_STOP_LANGUAGES: dict[str, tuple[str, ...]] = {}
for _language, _words in {**STOPWORDS, "en": _folded(bm25s_stopwords.STOPWORDS_EN_PLUS)}.items():
    for _word in _words:
        _STOP_LANGUAGES[_word] = (*_STOP_LANGUAGES.get(_word, ()), _language)
del _language, _words, _word


# How a corpus in Latin script has always been read: runs of letters and digits, whatever the
# script, so such a corpus keeps every token (and every ranking) it had.
_PLAIN_WORD = re.compile(r"[^\W_]+")


def words(text: str, by_script: bool = True) -> list[str]:
    """The units BM25 matches, before stop words: NFKC, case-folded, diacritics kept.

    ``by_script``: words of scripts written with spaces keep their marks (so "हिन्दी" stays
    whole), and runs of Han, kana, hangul, Thai, Lao, Khmer and Myanmar become overlapping
    character bigrams (a single character alone): "東京タワーは1958年" gives 東京 京タ タワ ワー
    ーは, 1958, 年. Without it, runs of letters and digits, the way :class:`Analyzer` reads a
    corpus in Latin script.
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    if not by_script:
        return _PLAIN_WORD.findall(text)
    units: list[str] = []
    for i, piece in enumerate(_UNSPACED_PIECES.split(text.replace("_", " "))):
        if i % 2:  # a run of a script written without spaces: its bigrams, or the one character
            units += [piece[j : j + 2] for j in range(len(piece) - 1)] if len(piece) > 1 else [piece]
        elif piece:
            units += _WORD.findall(piece)
    return units


def _stopword_signs(units: Iterable[str]) -> tuple[Counter[str], int]:
    """Stop words per language other than English, and English's, among ``units``.

    A word that is a stop word in English too ("in", "was") is no sign of another language,
    and a language shows only with two different stop words ("dog" alone is Danish).
    """
    hits = Counter(unit for unit in units if unit in _STOP_LANGUAGES)
    signs: Counter[str] = Counter()
    distinct: Counter[str] = Counter()
    english = 0
    for unit, count in hits.items():
        languages = _STOP_LANGUAGES[unit]
        if "en" in languages:
            english += count if len(languages) == 1 else 0
            continue
        for language in languages:
            signs[language] += count
            distinct[language] += 1
    return Counter({language: n for language, n in signs.items() if distinct[language] >= 2}), english


def stopword_language(units: Sequence[str]) -> str:
    """The language whose stop words ``units`` use most; English unless another clearly leads.

    Another language needs more than twice English's signs, so an English text quoting a
    foreign title ("Della Santa E Del Fico Fiorone") stays English.
    """
    signs, english = _stopword_signs(units)
    ranked = signs.most_common(1)  # ties: the first listed in STOPWORDS
    return ranked[0][0] if ranked and ranked[0][1] > 2 * english else "en"


# What an analysis is called where it is recorded (a saved corpus, a Milvus collection): a new
# name whenever ``words`` or ``Analyzer.tokens`` would give other tokens for the same text.
ANALYSIS = "unicode-words+bigrams/1"


_LETTER = re.compile(r"[^\W\d_]")
_NON_LATIN_LETTER = re.compile(r"[^\W\d_\u0000-\u024f]")


def _mainly_non_latin(text: str) -> bool:
    if text.isascii():
        return False
    # Counted by what a substitution removes: no list of one-character strings per letter.
    letters, non_latin = (len(text) - len(pattern.sub("", text)) for pattern in (_LETTER, _NON_LATIN_LETTER))
    return 2 * non_latin >= letters > 0


@dataclass(frozen=True)
class Analyzer:
    """How a corpus turns text into BM25 tokens: the same for its passages and every query.

    ``language``: whose stop words go (a key of ``STOPWORDS``; any other language loses none).
    ``by_script``: see :func:`words`. ``Analyzer.of(texts)`` picks both for a corpus: by-script
    analysis once any passage is mainly written in a script other than Latin (an English corpus
    quoting a Japanese title is read as it always was), and the stop words of the language that
    an even sample of the passages uses most.
    """

    language: str = "en"
    by_script: bool = True

    def tokens(self, text: str) -> list[str]:
        """``text``'s BM25 tokens."""
        return self.tokens_of(words(text, self.by_script))

    @property
    def name(self) -> str:
        """The analysis as recorded: ``ANALYSIS:scripts:ja`` or ``ANALYSIS:words:en``."""
        return f"{ANALYSIS}:{'scripts' if self.by_script else 'words'}:{self.language}"

    @classmethod
    def named(cls, name: str) -> Analyzer:
        """The analyzer a recorded ``name`` stands for; ValueError for another analysis."""
        parts = name.rsplit(":", 2)
        version, mode, language = parts if len(parts) == 3 else ("", "", "")
        if version != ANALYSIS or mode not in ("scripts", "words") or not language:
            raise InputError(f"analysis {name!r} is not this BRAG's ({ANALYSIS})")
        return cls(language, mode == "scripts")

    @classmethod
    def of(cls, texts: Sequence[str], sample: int = 1000) -> Analyzer:
        """The analyzer for a corpus of ``texts``."""
        return cls.chosen(texts, sample)[0]

    @classmethod
    def chosen(cls, texts: Sequence[str], sample: int = 1000) -> tuple[Analyzer, dict[int, list[str]]]:
        """The analyzer for ``texts``, and the :func:`words` of the texts it sampled, by position.

        An index reuses those words, so no text is analysed twice.
        """
        by_script = any(_mainly_non_latin(text) for text in texts)
        step = max(1, len(texts) // sample)
        sampled = {i: words(texts[i], by_script) for i in range(0, len(texts), step)}
        language = stopword_language([u for units in sampled.values() for u in units])
        return cls(language, by_script), sampled

    def tokens_of(self, units: list[str]) -> list[str]:
        """The BM25 tokens of a text whose :func:`words` (as this analyzer reads) are ``units``."""
        return _without_stop_words(units, self.language)


def tokenize(text: str, analyzer: Analyzer | None = None) -> list[str]:
    """BM25 tokens: :func:`words` without stop words.

    ``analyzer`` is a corpus's (so a query and the passages lose the same words); without
    one, the text is read by script and loses its own language's stop words.
    """
    if analyzer is not None:
        return analyzer.tokens(text)
    units = words(text)
    return _without_stop_words(units, stopword_language(units))


def _without_stop_words(units: list[str], language: str) -> list[str]:
    stop = STOPWORDS.get(language, frozenset())
    return list(itertools.filterfalse(stop.__contains__, units))


def _analyzer_of(retriever: Any) -> Analyzer | None:
    """How a retriever reads text, when it says (``Corpus`` and ``MilvusCorpus`` do)."""
    return getattr(retriever, "analyzer", None)


# The script a text is written in tells its language where one language owns the script.
_SCRIPT_LANGUAGES = (
    (re.compile("[\u3040-\u30ff\u31f0-\u31ff]"), "ja"),  # kana: Japanese, even beside Han
    (re.compile("[\u1100-\u11ff\u3130-\u318f\uac00-\ud7af]"), "ko"),
    (re.compile("[\u0e00-\u0e7f]"), "th"),
    (re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f]"), "zh"),
)
_SCRIPT_NAMED = frozenset(language for _, language in _SCRIPT_LANGUAGES)


def language_of(text: str) -> str:
    """An ISO 639-1 code for ``text``'s language, ``""`` when BRAG cannot tell which.

    By script for Japanese, Korean, Thai and Chinese; by stop words for the languages of
    ``STOPWORDS``, when one leads the others ("der" is German and Danish: no lead); English for
    Latin text with no sign of another language and, if accented, some sign of English.
    """
    norm = unicodedata.normalize("NFKC", text).casefold()
    for script, language in _SCRIPT_LANGUAGES:
        if script.search(norm):
            return language
    signs, english = _stopword_signs(_WORD.findall(norm.replace("_", " ")))
    ranked = signs.most_common(2)
    if ranked and ranked[0][1] > 2 * english:
        return ranked[0][0] if len(ranked) == 1 or ranked[0][1] > ranked[1][1] else ""
    letters = [c for c in norm if c.isalpha()]
    latin = sum(1 for c in letters if c < "\u0250")
    if english == 0 and any("\u00c0" <= c < "\u0250" for c in letters):
        return ""  # accented Latin and not one English stop word ("Vad gör kommandot ls?")
    return "en" if not letters or 2 * latin >= len(letters) else ""


# ------------------------------------------------------------------------------------------
# Answers: normalisation, comparison, parsing
# ------------------------------------------------------------------------------------------


_ARTICLES = re.compile(r"\b(a|an|the)\b")


# What normalize_answer drops: ASCII punctuation and symbols, and the punctuation of every script
# (Unicode's planes 0 and 1 hold all of it), as a str.translate table: one pass in C.
_NO_PUNCTUATION = dict.fromkeys(
    [ord(c) for c in string.punctuation + "‘’“”–—…"]
    + [c for c in range(0x20000) if unicodedata.category(chr(c))[0] == "P"]
)


_NO_ANSWER = frozenset(
    {
        "",
        "none",
        "unknown",
        "no answer",
        "n a",
        "na",
        "not known",
        "not given",
        "not mentioned",
        "not stated",
        "not available",
        "no information",
        "cannot be determined",
        "cannot determine",
        "i dont know",
        "insufficient information",
        "not enough information",
    }
)


_NO_ANSWER_PREFIXES = ("none ", "unknown ", "i dont know", "not enough information", "no answer")


# "None" and "unknown" in the languages a reader may answer in; compared after normalize_answer.
_NO_ANSWER_WORDS = ("なし", "不明", "わかりません", "无", "無", "没有", "不知道", "未知", "없음", "모름")
_NO_ANSWER_WORDS += ("keine", "unbekannt", "aucune", "inconnu", "ninguna", "desconocido", "nessuna")
_NO_ANSWER_WORDS += ("sconosciuto", "nenhuma", "desconhecido", "ingen", "okänd", "geen", "onbekend")


def _spaced_out(run: re.Match[str]) -> str:
    return " " + " ".join(run.group()) + " "


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation and articles, collapse white space.

    Full-width forms fold (NFKC), punctuation of every script goes (「」、。 too), and each
    character of a script written without spaces stands alone, so the token F1 of Japanese or
    Chinese answers is their character F1, as CMRC scores Chinese.
    """
    text = unicodedata.normalize("NFKC", text).lower().translate(_NO_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    text = _UNSPACED.sub(_spaced_out, text)
    return " ".join(text.split())


def is_no_answer(text: str) -> bool:
    """``NONE``, "unknown" and empty answers are no vote.

    "Unknown" also in Japanese, Chinese, Korean and some European languages.
    """
    norm = normalize_answer(text)
    return norm in _NO_ANSWER or norm.startswith(_NO_ANSWER_PREFIXES) or norm in _NO_ANSWERS_ELSEWHERE


_NO_ANSWERS_ELSEWHERE = frozenset(normalize_answer(word) for word in _NO_ANSWER_WORDS)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two answers."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def same_answer(a: str, b: str, f1_threshold: float = 0.8) -> bool:
    """True when two answers name the same thing ("the Nazi Party" / "Nazi party").

    Exact match after normalisation, token F1 >= ``f1_threshold``, or containment where the
    shorter answer holds at least half the tokens of the longer ("Obama" / "Barack Obama").
    """
    na, nb = normalize_answer(a), normalize_answer(b)
    if not na or not nb:
        return False
    if na == nb:
        return True
    ta, tb = na.split(), nb.split()
    short, long_ = (ta, tb) if len(ta) <= len(tb) else (tb, ta)
    if 2 * len(short) >= len(long_) and set(short) <= set(long_):
        return True
    return token_f1(na, nb) >= f1_threshold


def exact_match(prediction: str, golds: Iterable[str]) -> bool:
    """Normalised exact match with any gold answer."""
    norm = normalize_answer(prediction)
    return bool(norm) and any(norm == normalize_answer(g) for g in golds)


def is_correct(answer: str, gold: Iterable[str], f1_threshold: float = 0.8) -> bool:
    """Normalised exact match with any gold answer, or token F1 >= ``f1_threshold``."""
    gold = list(gold)
    if not answer or not gold:
        return False
    return exact_match(answer, gold) or max(token_f1(answer, g) for g in gold) >= f1_threshold


# "Answer" as readers write it in other languages, which a prompt in English does not rule out.
_ANSWER_LABELS = "答え|回答|解答|答案|答|답변|antwort|réponse|respuesta|risposta|resposta|svar|antwoord|ответ"


_LABEL = re.compile(
    r"^\s*(?:\*\*)?\s*(final answer|answer|follow[- ]?up(?: search)?(?: query)?|search query|"
    rf"next query|query|{_ANSWER_LABELS})\s*(?:\*\*)?\s*[:：-]\s*(?:\*\*)?",
    re.IGNORECASE,
)


_ANSWER_PREFIX = re.compile(r"^(?:the answer is|answer is|it is|it was)\s+", re.IGNORECASE)


# A full stop after three lower-case letters or digits, before a capital or the end: "St. Louis"
# and "J. R. R. Tolkien" stay whole.
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]]{3})[.!?](?=\s+[A-Z\"“]|\s*$)")


_YES_NO = re.compile(r"^(yes|no)\b[\s,.;:!-]", re.IGNORECASE)


# A sentence of a script written without spaces ends at its own full stop, whatever follows.
_WIDE_SENTENCE_END = re.compile("[。．！？]")


_QUOTE_MARKS = "\"'“”‘’「」『』"


# Bounds on what a reply can put in the posterior, the report and the UI: the model is asked
# for a few words, so anything longer is a runaway or a hostile endpoint.
MAX_REPLY_CHARS = 2_000


MAX_ANSWER_CHARS = 200


MAX_QUERY_CHARS = 300


def _clean_answer(text: str, max_words: int = 20) -> str:
    """Reduce a reply to its short answer.

    Keeps the first sentence, a bare "yes"/"no" when it opens an explanation, and strips quotes,
    markup, a leading "The answer is" and a trailing full stop.
    """
    text = text.strip().strip("*` " + _QUOTE_MARKS).strip()
    text = _ANSWER_PREFIX.sub("", text)
    text = _SENTENCE_END.split(text, maxsplit=1)[0]
    text = _WIDE_SENTENCE_END.split(text, maxsplit=1)[0]
    yes_no = _YES_NO.match(text + " ")
    if yes_no:
        return yes_no.group(1).capitalize()
    text = text.rstrip(".").strip().strip(_QUOTE_MARKS).strip()
    return " ".join(text.split()[:max_words])[:MAX_ANSWER_CHARS]


def parse_reading(text: str) -> tuple[str, str]:
    """Parse an R1/R2 reply into ``(answer, follow_up_query)``; either may be empty.

    Accepts the requested ``Answer: ... / Follow-up query: ...`` format, labels in any case or
    order, markdown bold, and a bare answer on the first line when the model ignored the format.
    """
    answer, query, unlabeled = "", "", []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        match = _LABEL.match(line)
        if match is None:
            unlabeled.append(line)
            continue
        value = line[match.end() :].strip()
        if match.group(1).lower() in ("answer", "final answer") or re.fullmatch(
            _ANSWER_LABELS, match.group(1).lower()
        ):
            answer = answer or value
        else:
            query = query or value
    if not answer and unlabeled:
        answer = unlabeled[0]
    return _clean_answer(answer), query.strip().strip("\"'“” ").strip()[:MAX_QUERY_CHARS]


@dataclass
class _Candidates:
    """Distinct answers seen so far; near-identical strings share one index.

    A candidate is shown in a form some read found word for word in a passage, once one did
    ("SPELL" rather than a first read's "SPELL, --speller"), so the answer is what the documents say.
    """

    texts: list[str] = field(default_factory=list)
    found_in_passage: list[bool] = field(default_factory=list)

    def find(self, answer: str) -> int | None:
        """The index of the candidate ``answer`` names, if any."""
        return next((i for i, text in enumerate(self.texts) if same_answer(answer, text)), None)

    def index(self, answer: str, in_passage: bool = False) -> int:
        """The index of the candidate ``answer`` names, added when new (``in_passage``: a passage has it)."""
        found = self.find(answer)
        if found is None:
            self.texts.append(answer)
            self.found_in_passage.append(in_passage)
            return len(self.texts) - 1
        if in_passage and not self.found_in_passage[found]:
            self.texts[found], self.found_in_passage[found] = answer, True
        return found


def closed_book_mode(samples: Sequence[str]) -> tuple[str, int]:
    """The mode of the closed-book samples (no-answers excluded) and its agreement level g.

    Each sample is parsed like a read's reply, so a chat model's "Answer: Paris" and a
    completion model's "Paris" are the same candidate.
    """
    answers = [parse_reading(s)[0] for s in samples]
    answers = [a for a in answers if not is_no_answer(a)]
    if not answers:
        return "", 0
    groups = _Candidates()
    counts = Counter(groups.index(a) for a in answers)
    best = max(counts, key=lambda i: (counts[i], -i))  # ties: the earliest answer
    return groups.texts[best], counts[best]


# ------------------------------------------------------------------------------------------
# Posterior over candidates
# ------------------------------------------------------------------------------------------


# A vote's own reliability stays inside these: no evidence makes one read certain, or worthless.
RELIABILITY_BOUNDS = (0.02, 0.98)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def bounded_reliability(rho: float) -> float:
    """``rho`` kept inside ``RELIABILITY_BOUNDS``."""
    low, high = RELIABILITY_BOUNDS
    return min(max(rho, low), high)


# The Beta a + b a hand-set or fitted reliability is stored with (calibrate.py fits to it too).
PRIOR_CONCENTRATION = 10.0


def _prior_beta(mean: float) -> tuple[float, float]:
    return mean * PRIOR_CONCENTRATION, (1 - mean) * PRIOR_CONCENTRATION


class Vote(NamedTuple):
    """One observation for candidate ``candidate`` from a source of type ``source`` (R1, R2, CB_g).

    ``reliability``: the vote's own rho, when its evidence sets it (an evidence curve); None:
    its type's.
    """

    source: str
    candidate: int
    reliability: float | None = None


def _lnbeta(x: float, y: float) -> float:
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


# How votes turn into a posterior: "floored" is the default (docs/method.md); "spec" is
# SPEC section 1 as written, kept so the two can be compared on the same data.
_RULES = ("floored", "spec")


def uninformative_reliability(eta: float) -> float:
    """rho_0 = eta / (1 + eta): the reliability at which a vote is as likely right as a repeated wrong."""
    return eta / (1.0 + eta)


class VoteModel:
    """How each vote moves the posterior; ``w_0 = 1 / eta`` is the residual's weight.

    ``floored`` (default): with L_t = rho_t / ((1 - rho_t) eta) the likelihood ratio of a vote
    of type t (rho_t its calibrated mean reliability), a candidate's weight is the product of
    the L_t of its votes that favour it (L_t >= 1), or, while none does, the largest L_t among
    its votes. One vote gives P = rho_t, as in SPEC, and no further vote ever lowers it.

    ``spec``: SPEC's ``log w_i = sum_t [lnB(a_t + n_ti, b_t + N_t - n_ti) - lnB(a_t, b_t + N_t)]
    - n_i ln eta``, per-query reliabilities integrated out; ``table[t][N][n]`` is the bracket for
    N votes of type t of which n went to the candidate (``-n ln eta`` included).
    """

    def __init__(
        self,
        priors: Mapping[str, tuple[float, float]],
        eta: float,
        max_votes: int = 8,
        rule: str = "floored",
    ) -> None:
        if not 0 < eta < 1:
            raise InputError(f"eta must lie in (0, 1), got {eta!r}")
        if rule not in _RULES:
            raise InputError(f"rule must be one of {_RULES}, got {rule!r}")
        self.priors, self.rule = dict(priors), rule
        self.ln_eta = math.log(eta)
        # floored: the log likelihood ratio of one vote of each type.
        self.log_ratio = {t: math.log(a / b) - self.ln_eta for t, (a, b) in self.priors.items()}
        self.table = {}
        if rule == "spec":
            self.table = {t: [self._row(t, big_n) for big_n in range(max_votes + 1)] for t in self.priors}

    def log_ratio_of(self, vote: Vote) -> float:
        """The log likelihood ratio of one vote (floored): its own reliability's, else its type's."""
        if vote.reliability is None:
            return self.log_ratio[vote.source]
        rho = bounded_reliability(vote.reliability)
        return math.log(rho / (1 - rho)) - self.ln_eta

    def _row(self, source: str, big_n: int, beta: tuple[float, float] | None = None) -> list[float]:
        a, b = beta or self.priors[source]
        base = _lnbeta(a, b + big_n)
        return [_lnbeta(a + n, b + big_n - n) - base - n * self.ln_eta for n in range(big_n + 1)]

    def row(self, source: str, big_n: int, beta: tuple[float, float] | None = None) -> list[float]:
        """SPEC's tabulated terms for N = ``big_n`` votes of type ``source`` (or of Beta ``beta``)."""
        rows = self.table.get(source, []) if beta is None else []
        return rows[big_n] if big_n < len(rows) else self._row(source, big_n, beta)

    def beliefs(self) -> Beliefs:
        """An empty posterior state to add votes to."""
        return Beliefs(self)


class Beliefs:
    """Posterior state of one question, updated in place as votes arrive.

    Keeping the log weights up to date makes each update and each read a few list operations
    instead of a pass over all votes. (Under ``spec`` a vote of type t changes N_t, so it moves
    the weight of every candidate holding a vote of type t.)
    """

    def __init__(self, model: VoteModel) -> None:
        self.model = model
        self.log_w: list[float] = []
        self.counts: dict[str, dict[int, int]] = {}  # type -> candidate -> votes
        # floored: per candidate, the summed log ratio of its favouring votes (None while it has
        # none) and the largest log ratio among the others.
        self.favour: list[float | None] = []
        self.weakest_best: list[float] = []

    def weight_after(self, cand: int, log_ratio: float) -> float:
        """The log weight ``cand`` would have after one more vote with ``log_ratio`` (floored)."""
        if cand >= len(self.favour):  # a new candidate: the vote's own ratio
            return log_ratio
        favour = self.favour[cand]
        if log_ratio >= 0:
            return (favour or 0.0) + log_ratio
        return favour if favour is not None else max(self.weakest_best[cand], log_ratio)

    def add(self, vote: Vote) -> None:
        """Record one vote.

        Under ``spec`` a vote with its own reliability is a type of its own, Beta(rho c, (1 - rho) c)
        at ``PRIOR_CONCENTRATION`` c.
        """
        source, cand, own = vote
        beta = None
        if own is not None:
            rho = bounded_reliability(own)
            source, beta = f"{source}@{rho:.6f}", _prior_beta(rho)
        log_w = self.log_w
        while len(log_w) <= cand:
            log_w.append(0.0)
        counts = self.counts.setdefault(source, {})
        n = counts.get(cand, 0)
        if self.model.rule == "floored":
            ratio = self.model.log_ratio_of(vote)
            log_w[cand] = self.weight_after(cand, ratio)
            while len(self.favour) <= cand:
                self.favour.append(None)
                self.weakest_best.append(-math.inf)
            if ratio >= 0:
                self.favour[cand] = (self.favour[cand] or 0.0) + ratio
            else:
                self.weakest_best[cand] = max(self.weakest_best[cand], ratio)
        else:
            big_n = sum(counts.values())
            old, new = self.model.row(source, big_n, beta), self.model.row(source, big_n + 1, beta)
            for i, m in counts.items():
                log_w[i] += new[m] - old[m]
            log_w[cand] += new[n + 1] - new[n]
        counts[cand] = n + 1

    def probabilities(self, n_candidates: int | None = None) -> tuple[list[float], float]:
        """Posterior of each candidate (padded to ``n_candidates``) and of the residual."""
        log_w = self.log_w
        if n_candidates is not None and n_candidates > len(log_w):
            log_w = log_w + [0.0] * (n_candidates - len(log_w))
        if not self.counts:
            return [0.0] * len(log_w), 1.0
        log_w0 = -self.model.ln_eta
        top = max(log_w)
        if top < log_w0:
            top = log_w0
        exp = math.exp
        w0 = exp(log_w0 - top)
        z = w0
        weights = []
        for x in log_w:
            w = exp(x - top)
            weights.append(w)
            z += w
        inv = 1.0 / z
        return [w * inv for w in weights], w0 * inv


def posterior(
    votes: Sequence[Vote],
    n_candidates: int,
    priors: Mapping[str, tuple[float, float]],
    eta: float,
    rule: str = "floored",
) -> tuple[list[float], float]:
    """Posterior of each candidate and of the residual (none of them); see :class:`VoteModel`."""
    beliefs = VoteModel(priors, eta, max_votes=0, rule=rule).beliefs()
    for vote in votes:
        beliefs.add(vote)
    return beliefs.probabilities(n_candidates)


def error_probability(probs: Sequence[float]) -> float:
    """P_err = 1 - max_i P_i (1 with no candidate)."""
    return 1.0 - max(probs, default=0.0)


# ------------------------------------------------------------------------------------------
# Dedup: embeddings and near-duplicate removal (SPEC section 2)
# ------------------------------------------------------------------------------------------


@runtime_checkable
class Embedder(Protocol):
    """Texts in, one L2-normalised float32 row per text out."""

    name: str

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` as an (n, dim) array of unit rows."""
        ...


def unit_rows(matrix: Any) -> np.ndarray:
    """Rows scaled to unit length as float32 (all-zero rows stay zero): what an Embedder returns."""
    matrix = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms == 0, 1, norms)


@dataclass(frozen=True)
class HashingEmbedder:
    """A model-free embedder: hashed word 1-2-grams and character 3-5-grams.

    Each n-gram goes to one of ``dim`` buckets by CRC-32 (its top bit picks the sign), and the
    counts are L2-normalised, so paraphrases sharing words and word pieces land close.
    """

    dim: int = 2048
    name: str = "hashing"

    def _features(self, text: str) -> list[str]:
        units = words(text)  # BM25's units: for text without spaces, its character bigrams
        grams = units + [f"{a} {b}" for a, b in itertools.pairwise(units)]
        padded = (
            " "
            + " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).casefold().replace("_", " ")))
            + " "
        )
        grams += [padded[i : i + n] for n in (3, 4, 5) for i in range(len(padded) - n + 1)]
        return grams

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Hashed n-gram counts per text, unit length."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            hashes = np.fromiter((zlib.crc32(g.encode()) for g in self._features(text)), dtype=np.uint32)
            if len(hashes):
                signs = np.where(hashes & 0x80000000, -1.0, 1.0)
                out[row] = np.bincount(hashes % self.dim, weights=signs, minlength=self.dim)
        return unit_rows(out)


@dataclass(frozen=True)
class DedupConfig:
    """Every threshold of the two-phase dedup (defaults from SPEC section 2)."""

    ingestion_enabled: bool = True
    similarity_threshold: float = 0.90
    salience_threshold: float = 0.05
    salience_boost: bool = True
    boost_per_near_duplicate: float = 0.15
    max_salience: float = 1.0
    boost_mode: str = "logarithmic"  # or "linear"
    log_base: float = 2.0
    retrieval_enabled: bool = True
    retrieval_similarity_threshold: float = 0.90
    min_relevance_score: float | None = None  # as a fraction of the top result's score
    warn_ingestion_ratio: float = 0.50
    warn_retrieval_ratio: float = 0.30
    warn_boost: float = 0.60
    block_size: int = 1024  # rows per block of the exact pairwise similarity search

    def __post_init__(self) -> None:
        if self.boost_mode not in ("linear", "logarithmic"):
            raise InputError(f"dedup: boost_mode must be 'linear' or 'logarithmic', got {self.boost_mode!r}")
        for name in ("similarity_threshold", "retrieval_similarity_threshold", "salience_threshold"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise InputError(f"dedup: {name} must lie in [-1, 1], got {getattr(self, name)!r}")
        if self.log_base <= 1 or self.block_size < 1:
            raise InputError("dedup: log_base must exceed 1 and block_size be positive")

    def boost(self, near_duplicates: int) -> float:
        """Salience added to a segment that absorbed ``near_duplicates`` others."""
        if not self.salience_boost or near_duplicates == 0:
            return 0.0
        if self.boost_mode == "linear":
            return self.boost_per_near_duplicate * near_duplicates
        return self.boost_per_near_duplicate * math.log(1 + near_duplicates, self.log_base)

    @classmethod
    def from_json(cls, source: Any) -> DedupConfig:
        """Read the ``Deduplication`` JSON section (``Ingestion`` / ``Retrieval``).

        An object holding it (``{"DocSummarizer": {"Deduplication": ...}}``) works too; missing
        keys keep their defaults.
        """
        data = read_json(source, "dedup")
        while isinstance(data, Mapping) and "Ingestion" not in data and "Retrieval" not in data:
            inner = [v for v in data.values() if isinstance(v, Mapping)]
            if len(inner) != 1:
                raise InputError("dedup: no 'Deduplication' section with 'Ingestion' or 'Retrieval'")
            data = inner[0]
        if not isinstance(data, Mapping):
            raise InputError("dedup: expected a JSON object")
        ing, ret = data.get("Ingestion", {}), data.get("Retrieval", {})
        names = {
            "ingestion_enabled": (ing, "Enabled"),
            "similarity_threshold": (ing, "SimilarityThreshold"),
            "salience_threshold": (ing, "SalienceThreshold"),
            "salience_boost": (ing, "EnableSalienceBoost"),
            "boost_per_near_duplicate": (ing, "BoostPerNearDuplicate"),
            "max_salience": (ing, "MaxSalienceBoost"),
            "boost_mode": (ing, "BoostDecayMode"),
            "log_base": (ing, "LogBase"),
            "retrieval_enabled": (ret, "Enabled"),
            "retrieval_similarity_threshold": (ret, "SimilarityThreshold"),
            "min_relevance_score": (ret, "MinRelevanceScore"),
        }
        values = {field: section[key] for field, (section, key) in names.items() if key in section}
        if isinstance(values.get("boost_mode"), str):
            values["boost_mode"] = values["boost_mode"].lower()
        return cls(**values)


@dataclass(frozen=True)
class IngestionResult:
    """Phase 1 outcome: what stayed, what went and why, and the salience after boosts."""

    kept: list[int]
    below_salience: list[int]
    exact_duplicates: dict[int, int]  # removed -> the kept segment it copies
    near_duplicates: dict[int, int]  # removed -> the kept segment that absorbed it
    boosts: dict[int, float]  # kept segment -> salience added
    salience: dict[int, float]  # kept segment -> final salience

    @property
    def ratio(self) -> float:
        """Share of the input segments removed."""
        removed = len(self.below_salience) + len(self.exact_duplicates) + len(self.near_duplicates)
        total = len(self.kept) + removed
        return 1 - len(self.kept) / total if total else 0.0


def dedup_ingestion(
    passages: Sequence[Passage],
    embeddings: np.ndarray | None,
    config: DedupConfig = DedupConfig(),
) -> IngestionResult:
    """Phase 1, within each document: drop near and exact duplicates, boost what absorbs them.

    Salience filter, stable sort by salience, then keep a segment unless it copies (content
    hash: dropped, no boost) or nearly matches (cosine at or above the threshold: dropped, boost
    to the most similar kept one) a segment kept before it.

    Exact: every pair inside a document is compared, in blocks of ``config.block_size`` rows so
    a 10,000-segment document needs about ``block_size`` x 10,000 floats at a time.
    """
    below = [i for i, p in enumerate(passages) if p.salience < config.salience_threshold]
    documents: dict[str, list[int]] = {}
    kept: list[int] = []
    for i, p in enumerate(passages):
        if p.salience < config.salience_threshold:
            continue
        if p.title or p.doc_id:
            documents.setdefault(p.document(i), []).append(i)
        else:
            kept.append(i)  # an untitled passage is a document alone: nothing in it to dedup
    exact: dict[int, int] = {}
    near: dict[int, int] = {}
    absorbed: Counter[int] = Counter()
    for members in documents.values():
        order = sorted(members, key=lambda i: -passages[i].salience)  # stable: ties keep input order
        keep = np.zeros(len(order), dtype=bool)
        first_copy: dict[str, int] = {}
        vectors = embeddings[order] if embeddings is not None else None
        for start in range(0, len(order), config.block_size):
            stop = min(start + config.block_size, len(order))
            sims = vectors[start:stop] @ vectors[:stop].T if vectors is not None else None
            for j in range(start, stop):
                segment = order[j]
                digest = hashlib.sha256(passages[segment].render().encode()).hexdigest()
                if digest in first_copy:
                    exact[segment] = order[first_copy[digest]]
                    continue
                if sims is not None:
                    row = sims[j - start, :j]
                    hits = np.flatnonzero(keep[:j] & (row >= config.similarity_threshold))
                    if len(hits):
                        target = int(hits[np.argmax(row[hits])])  # the most similar kept segment
                        near[segment] = order[target]
                        absorbed[order[target]] += 1
                        continue
                keep[j] = True
                first_copy[digest] = j
        kept += [order[j] for j in np.flatnonzero(keep)]
    kept.sort()
    boosts = {i: config.boost(absorbed[i]) for i in kept if absorbed[i]}
    salience = {i: min(config.max_salience, passages[i].salience + boosts.get(i, 0.0)) for i in kept}
    return IngestionResult(kept, below, exact, near, boosts, salience)


def dedup_ranked(
    ranked: Sequence[tuple[int, float]],
    vectors: Mapping[int, np.ndarray] | None,
    config: DedupConfig = DedupConfig(),
    k: int | None = None,
) -> tuple[list[tuple[int, float]], list[int]]:
    """Phase 2, across documents: drop ranked results that repeat a better-ranked one.

    Walk the ranking, skip a result whose cosine with a result already kept reaches the
    threshold, drop those under ``min_relevance_score`` (relative to the top score), cut to
    ``k``. Returns (kept, in rank order; removed duplicates).
    """
    floor = None
    if config.min_relevance_score is not None and ranked:
        floor = config.min_relevance_score * ranked[0][1]
    kept: list[tuple[int, float]] = []
    kept_vectors: list[np.ndarray] = []
    removed: list[int] = []
    for pid, score in ranked:
        if floor is not None and score < floor:
            continue
        vector = vectors.get(pid) if vectors is not None else None
        if vector is not None and kept_vectors:
            if float(np.max(np.stack(kept_vectors) @ vector)) >= config.retrieval_similarity_threshold:
                removed.append(pid)
                continue
        kept.append((pid, score))
        if vector is not None:
            kept_vectors.append(vector)
        if k is not None and len(kept) == k:
            break
    return kept, removed


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = 60) -> dict[int, float]:
    """RRF: each id scores sum over rankings of 1 / (k + rank), rank from 1."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            fused[item] = fused.get(item, 0.0) + 1.0 / (k + rank)
    return fused


# ------------------------------------------------------------------------------------------
# Corpus: passages, JSON input, BM25 retrieval, the Retriever protocol
# ------------------------------------------------------------------------------------------


# Named BM25 scoring variants as (term-frequency method, idf method) in bm25s' terms.
# "okapi" scores exactly like rank_bm25.BM25Okapi(epsilon=0): ATIRE's (k1+1) tf saturation
# with Robertson's idf, whose negative values are floored at zero.
BM25_VARIANTS: dict[str, tuple[str, str]] = {
    "okapi": ("atire", "robertson"),
    "robertson": ("robertson", "robertson"),
    "lucene": ("lucene", "lucene"),
    "atire": ("atire", "atire"),
    "bm25l": ("bm25l", "bm25l"),
    "bm25+": ("bm25+", "bm25+"),
}


# A passage longer than this is cut in a prompt (retrieval still reads all of it), so a read of
# k passages stays the size a read of k passages should be, whatever a caller pasted.
MAX_PROMPT_PASSAGE_CHARS = 10_000


@dataclass(frozen=True)
class Passage:
    r"""A passage as the LLM sees it: ``title\ntext`` (just ``text`` when untitled)."""

    title: str
    text: str
    doc_id: str = ""  # groups the segments of one document for ingestion dedup
    salience: float = 1.0

    def render(self) -> str:
        """The passage whole: its title, then its text."""
        return f"{self.title}\n{self.text}" if self.title else self.text

    def shown(self) -> str:
        """The passage as a read's prompt holds it: :meth:`render`, cut at ``MAX_PROMPT_PASSAGE_CHARS``.

        Everything a read's answer is checked against (its span, support, quote, the gate's
        coverage) is this text: what the model saw, and a bound on the work a passage costs.
        """
        text = self.render()
        return text if len(text) <= MAX_PROMPT_PASSAGE_CHARS else text[:MAX_PROMPT_PASSAGE_CHARS] + " …"

    def shown_body(self) -> str:
        """:meth:`shown` without the title: the text a quote is taken from."""
        return self.shown()[len(self.title) + 1 :] if self.title else self.shown()

    def label(self, words: int = 6) -> str:
        """How a person can tell it apart: its title, else its first few words."""
        if self.title:
            return self.title
        head = self.text.split()
        return " ".join(head[:words]) + ("…" if len(head) > words else "")

    def document(self, position: int) -> str:
        """Its document: the given id, else the title; an untitled passage is a document alone."""
        return self.doc_id or (f"title:{self.title}" if self.title else f"passage:{position}")


# A title is a label (a file and heading path, an article's name): longer ones are cut here, so
# a title cannot blow up a prompt, a report or the page.
MAX_TITLE_CHARS = 300


def _short_title(title: str) -> str:
    return title if len(title) <= MAX_TITLE_CHARS else title[: MAX_TITLE_CHARS - 1].rstrip() + "…"


def parse_passages(passages: Any) -> list[Passage | None]:
    """Read strings, ``{title, text}`` dicts, or a JSON string of either; None marks an empty one.

    Titles longer than ``MAX_TITLE_CHARS`` are cut.
    """
    if isinstance(passages, str):
        passages = parse_json(passages, "passages")
    if isinstance(passages, dict) or not isinstance(passages, Sequence):
        raise InputError(
            "passages: expected a list of strings or of {title, text} objects, "
            f"got {type(passages).__name__}"
        )
    parsed: list[Passage | None] = []
    for i, item in enumerate(passages):
        doc_id, salience = "", 1.0
        if isinstance(item, Passage):
            if len(item.title) > MAX_TITLE_CHARS:
                item = replace(item, title=_short_title(item.title))
            parsed.append(item if item.text or item.title else None)
            continue
        if isinstance(item, str):
            title, text = "", item
        elif isinstance(item, Mapping):
            title, text = item.get("title", ""), item.get("text", item.get("contents"))
            if text is None or not isinstance(title, str) or not isinstance(text, str):
                raise InputError(f"passages[{i}]: expected string fields 'title' and 'text'")
            doc_id = str(item.get("doc_id", ""))
            salience = item.get("salience", 1.0)
            if isinstance(salience, bool) or not isinstance(salience, (int, float)) or not 0 <= salience <= 1:
                raise InputError(
                    f"passages[{i}]: salience must be a number in [0, 1], got {_shown(salience)}"
                )
        else:
            raise InputError(
                f"passages[{i}]: expected a string or a {{title, text}} object, got {type(item).__name__}"
            )
        title, text = _short_title(title.strip()), text.strip()
        parsed.append(Passage(title, text, doc_id, float(salience)) if text or title else None)
    return parsed


@dataclass(frozen=True)
class Retrieval:
    """One search: the window, what post-ranking dedup removed, and the share removed."""

    hits: list[tuple[int, float]]
    removed: list[int]
    considered: int
    bm25: np.ndarray | None = None  # every kept passage's score, kept for the gate's signals
    dense: np.ndarray | None = None
    query: str = ""  # what it searched for (the runner records it when a retriever does not)

    @property
    def dedup_ratio(self) -> float:
        """Share of the considered results that were cross-document duplicates."""
        return len(self.removed) / self.considered if self.considered else 0.0


def _progress(items: Sequence[Any], show: bool, what: str) -> Iterable[Any]:
    """``items``, with a line of progress on stderr at most once a second when asked.

    Written here, not by tqdm: bm25s does not bring it, and brag needs only its three packages.
    """
    return _counted(items, what) if show else items


def _counted(items: Sequence[Any], what: str) -> Iterator[Any]:
    shown = 0.0
    for done, item in enumerate(items, 1):
        if time.monotonic() - shown >= 1.0 or done == len(items):
            end = "\n" if done == len(items) else ""
            print(f"\r{what}: {done:,} of {len(items):,} passages", end=end, file=sys.stderr, flush=True)
            shown = time.monotonic()
        yield item


# bm25s's scoring, per variant, on whole arrays at once: inverse document frequency of each
# token from its document frequency df among n documents, and the term-frequency component of
# each (document, token) pair (tests/test_corpus.py checks both against bm25s's own index).
_IDF: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "robertson": lambda df, n: np.log(np.maximum((n - df + 0.5) / (df + 0.5), 1.0)),
    "lucene": lambda df, n: np.log(1 + (n - df + 0.5) / (df + 0.5)),
    "atire": lambda df, n: np.log(n / df),
    "bm25l": lambda df, n: np.log((n + 1) / (df + 0.5)),
    "bm25+": lambda df, n: np.log((n + 1) / df),
}


def _tfc(method: str, tf: Any, length: Any, average: float, k1: float, b: float, delta: float) -> Any:
    norm = 1 - b + b * length / average
    if method in ("robertson", "lucene"):
        return tf / (k1 * norm + tf)
    if method == "atire":
        return tf * (k1 + 1) / (tf + k1 * norm)
    if method == "bm25l":
        c = tf / norm
        return (k1 + 1) * (c + delta) / (k1 + c + delta)
    return (k1 + 1) * tf / (k1 * norm + tf) + delta  # bm25+


def bm25_index(
    ids: np.ndarray, lengths: np.ndarray, vocab: dict[str, int], variant: str, k1: float, b: float
) -> bm25s.BM25:
    """A bm25s index built from token ids with numpy alone, for any number of passages.

    ``ids`` holds every passage's token ids one passage after another, ``lengths`` how many each
    has. It gives the same scores as ``bm25s.BM25.index``, which walks the passages in Python
    and keeps every passage's tokens as Python lists (about 10 GB for a million passages).
    """
    method, idf_method = BM25_VARIANTS[variant]
    bm25 = bm25s.BM25(k1=k1, b=b, method=method, idf_method=idf_method)
    n_docs, n_vocab = len(lengths), len(vocab)
    pairs, tf = _counted_pairs(ids, lengths, n_vocab)
    # Arrays as long as the pairs dominate the memory: narrow ones, each freed once used.
    pair_doc, pair_token = (part.astype(np.int32) for part in np.divmod(pairs, n_vocab))
    del pairs
    df = np.bincount(pair_token, minlength=n_vocab)
    average = float(lengths.mean())
    idf = _IDF[idf_method](df.astype(np.float64), n_docs)
    tfc = _tfc(method, tf.astype(np.float64), lengths[pair_doc], average, k1, b, bm25.delta)
    del tf
    scores = (idf[pair_token] * tfc).astype(np.float32)
    del tfc
    bm25.nonoccurrence_array = None
    if method in bm25.methods_requiring_nonoccurrence:
        # A token's score in a passage without it, as bm25s computes it (at the average length).
        absent = (idf * _tfc(method, 0.0, average, average, k1, b, bm25.delta)).astype(np.float32)
        scores -= absent[pair_token]
        bm25.nonoccurrence_array = absent
    order = np.argsort(pair_token, kind="stable")  # token-major, passages ascending within a token
    indptr = np.zeros(n_vocab + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    bm25.scores = {
        "data": scores[order],
        "indices": pair_doc[order],
        "indptr": indptr,
        "num_docs": n_docs,
    }
    bm25.vocab_dict = vocab
    bm25.unique_token_ids_set = set(vocab.values())
    return bm25


def _counted_pairs(ids: np.ndarray, lengths: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Each distinct (passage, token) as ``passage * n_vocab + token``, ascending, and its count.

    ``np.unique`` would sort a copy and keep index arrays beside it; sorting the one key array
    in place keeps the peak near one array of the token count.
    """
    keys = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    keys *= n_vocab
    keys += ids
    keys.sort()
    first = np.empty(len(keys), dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    return keys[starts], np.diff(np.append(starts, len(keys)))


def _scoring_tokens(bm25: bm25s.BM25) -> np.ndarray:
    """Mark, per token id, whether the token adds to any passage's score.

    A term in over half the passages has Robertson idf 0; skipping it at query time leaves every
    score unchanged and saves summing its long posting list.
    """
    data, indptr = bm25.scores["data"], bm25.scores["indptr"]
    has_score = np.zeros(len(indptr) - 1, dtype=bool)
    nonempty = np.flatnonzero(np.diff(indptr) > 0)
    if len(nonempty):
        has_score[nonempty] = np.maximum.reduceat(data, indptr[nonempty]) > 0
    return has_score


@runtime_checkable
class Retriever(Protocol):
    """What BRAG needs from a passage index. :class:`Corpus` is one; a search service is another.

    ``retrieve`` ranks passages for a query (``Retrieval.hits``: ids and scores, best first; a
    retriever that cannot score every passage leaves ``Retrieval.bm25`` as None). The gate
    reads the top scores, how rare a term is (``document_share``) and the passages' text.
    A retriever may also say how it reads text with an ``analyzer`` attribute (an
    :class:`Analyzer`): the gate's terms and the follow-up query's words are then its tokens.
    """

    def retrieve(self, query: str, k: int = 5) -> Retrieval:
        """The top ``k`` passages for ``query``."""
        ...

    def __getitem__(self, passage_id: int) -> Passage:
        """A passage by the id ``retrieve`` gave."""
        ...

    def __len__(self) -> int:
        """How many passages there are."""
        ...

    def document_share(self, token: str) -> float:
        """The share of passages that hold ``token``."""
        ...

    def novel(self, candidates: Sequence[int], read: Sequence[int]) -> list[int]:
        """The candidates that repeat none of the passages already read."""
        ...

    def stats(self) -> dict[str, Any]:
        """Figures for reports (passages, dedup ratios)."""
        ...

    def fingerprint(self) -> str:
        """A digest of what retrieval depends on: a calibration's progress resumes only over the same."""
        ...


@runtime_checkable
class ScoringRetriever(Retriever, Protocol):
    """A retriever that can score every passage, not only its top hits (:class:`Corpus` can).

    Optional: the gate then reads the whole score distribution (height, spread) and, with dense
    vectors, how far the dense ranking departs from the BM25 one.
    """

    def scores(self, query: str) -> np.ndarray:
        """The BM25 score of every passage for ``query``, in id order."""
        ...

    def dense_scores(self, query: str) -> np.ndarray | None:
        """The dense similarity of every passage to ``query``; None without dense vectors."""
        ...


def check_retriever(corpus: Any) -> None:
    """ValueError naming what ``corpus`` lacks of :class:`Retriever`; nothing when it is one."""
    if isinstance(corpus, Retriever):
        return
    wanted = [
        name for name in vars(Retriever) if name in ("__getitem__", "__len__") or not name.startswith("_")
    ]
    missing = [name for name in wanted if not callable(getattr(corpus, name, None))]
    raise InputError(
        f"corpus must be a brag.Corpus or another Retriever, got {type(corpus).__name__}"
        + (f" (it lacks {', '.join(missing)})" if missing else "")
    )


class _Passages:
    """The kept passages by row: in memory, or read on demand from a memory-mapped file.

    On disk: ``texts.npy`` holds every passage's title, text and document id as UTF-8 bytes, one
    after another, and ``offsets.npy`` where each starts (row i: title, text, doc id, end).
    """

    def __init__(self, passages: Sequence[Passage], salience: np.ndarray) -> None:
        self._list: Sequence[Passage] | None = passages
        self._blob: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self.salience = salience

    @classmethod
    def mapped(cls, directory: Path, salience: np.ndarray) -> _Passages:
        store = cls([], salience)
        store._list = None
        store._blob = np.load(directory / "texts.npy", mmap_mode="r")
        store._offsets = np.load(directory / "offsets.npy", mmap_mode="r")
        return store

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else len(self._offsets)

    def __getitem__(self, row: int) -> Passage:
        if self._list is not None:
            return self._list[row]
        title, text, doc, end = (int(x) for x in self._offsets[row])
        raw = self._blob[title:end].tobytes()
        text_at, doc_at = text - title, doc - title
        return Passage(
            raw[:text_at].decode(),
            raw[text_at:doc_at].decode(),
            raw[doc_at:].decode(),
            float(self.salience[row]),
        )

    def save(self, directory: Path) -> None:
        """Write ``texts.npy`` (the bytes) and ``offsets.npy``."""
        offsets = np.zeros((len(self), 4), dtype=np.int64)
        parts, at = [], 0
        for row in range(len(self)):
            p = self[row]
            encoded = [p.title.encode(), p.text.encode(), p.doc_id.encode()]
            offsets[row, :3] = at, at + len(encoded[0]), at + len(encoded[0]) + len(encoded[1])
            at += sum(map(len, encoded))
            offsets[row, 3] = at
            parts += encoded
        np.save(directory / "texts.npy", np.frombuffer(b"".join(parts), dtype=np.uint8))
        np.save(directory / "offsets.npy", offsets)


_CORPUS_FORMAT = 3


@dataclass(frozen=True)
class _Settings:
    """How a corpus scores and dedups: what ``save`` records and ``load`` restores."""

    variant: str
    k1: float
    b: float
    rrf_k: int
    dedup: DedupConfig
    embedder: Embedder | None


@dataclass
class _Index:
    """A corpus's searchable state, built from passages or read from a saved folder."""

    ids: np.ndarray  # each kept passage's position in the input, ascending
    salience: np.ndarray
    store: _Passages
    embeddings: np.ndarray | None
    bm25: bm25s.BM25
    scoring: np.ndarray
    df: np.ndarray
    vocab: dict[str, int]
    dropped: int  # empty passages
    ingestion: IngestionResult | None  # None: read from ingestion_file on first use
    analyzer: Analyzer  # how the passages and every query become tokens
    ingestion_file: Path | None = None


def _build_index(
    parsed: list[Passage | None],
    variant: str,
    k1: float,
    b: float,
    embedder: Embedder | None,
    dedup: DedupConfig,
    show_progress: bool,
) -> _Index:
    """Drop empty passages, dedup at ingestion, embed, and index what is kept with BM25."""
    present = [i for i, p in enumerate(parsed) if p is not None]
    if not present:
        raise InputError("corpus is empty: no passage has any text")
    segments = [p for p in parsed if p is not None]
    vectors = embedder.embed([p.render() for p in segments]) if embedder is not None else None
    if dedup.ingestion_enabled:
        result = dedup_ingestion(segments, vectors, dedup)
    else:
        every = list(range(len(segments)))
        result = IngestionResult(every, [], {}, {}, {}, {i: segments[i].salience for i in every})
    kept = result.kept
    if not kept:
        raise InputError("corpus is empty: every passage is below the salience threshold")
    salience = np.array([result.salience[j] for j in kept], dtype=np.float32)
    store = _Passages([segments[j] for j in kept], salience)
    embeddings = None if vectors is None else vectors[kept]
    if embeddings is not None:
        embeddings.setflags(write=False)  # embeddings are never modified after ingestion
    analyzer, sampled = Analyzer.chosen([p.render() for p in store._list or []])
    bm25, vocab = _bm25_of(store, analyzer, variant, k1, b, show_progress, sampled)
    return _Index(
        ids=np.array([present[j] for j in kept], dtype=np.int64),  # ascending: input order
        salience=salience,
        store=store,
        embeddings=embeddings,
        bm25=bm25,
        scoring=_scoring_tokens(bm25),
        df=np.diff(bm25.scores["indptr"]),
        vocab=vocab,
        dropped=len(parsed) - len(present),
        ingestion=_remap(result, present),
        analyzer=analyzer,
    )


class _Vocabulary(dict[str, int]):
    """Token ids in order of first sight; a lookup of a new token adds it (no Python per known token)."""

    def __missing__(self, token: str) -> int:
        self[token] = number = len(self)
        return number


def _bm25_of(
    store: _Passages,
    analyzer: Analyzer,
    variant: str,
    k1: float,
    b: float,
    show_progress: bool,
    sampled: dict[int, list[str]] | None = None,
) -> tuple[bm25s.BM25, dict[str, int]]:
    """The BM25 index of the kept passages, and its vocabulary.

    ``sampled``: the words of the passages the analyzer was chosen from, by row (used once).
    """
    vocab = _Vocabulary()
    ids, lengths = array("i"), array("q")
    sampled = sampled if sampled is not None else {}
    for row, passage in enumerate(_progress(store._list or [], show_progress, "tokenizing")):
        units = sampled.pop(row, None)
        tokens = analyzer.tokens(passage.render()) if units is None else analyzer.tokens_of(units)
        lengths.append(len(tokens))
        ids.extend(map(vocab.__getitem__, tokens))
    if not vocab:
        raise InputError("corpus has nothing to search: no passage holds a word (letters or digits)")
    token_ids, counts = np.frombuffer(ids, dtype=np.int32), np.frombuffer(lengths, dtype=np.int64)
    return bm25_index(token_ids, counts, vocab, variant, k1, b), dict(vocab)


class Corpus:
    """Passages with a BM25 index (bm25s) and ``search(query, k) -> [(passage_id, score)]``.

    ``passage_id`` is the passage's position in the input. Empty passages are dropped (counted in
    ``dropped``) and ingestion dedup removes duplicates within a document (``ingestion``); ids
    of what is kept still point into the caller's list. With an ``embedder``, every kept passage
    is embedded once and ``search`` ranks by Reciprocal Rank Fusion of BM25, dense similarity and,
    when near duplicates boosted some passages, salience; then post-ranking dedup drops results
    that repeat a better-ranked one. Without one, BM25 alone ranks and only exact copies go.
    """

    def __init__(
        self,
        passages: Any,
        *,
        variant: str = "okapi",
        k1: float = 1.5,
        b: float = 0.75,
        embedder: Embedder | None = None,
        dedup: DedupConfig | None = None,
        rrf_k: int = 60,
        show_progress: bool = False,
    ) -> None:
        if variant not in BM25_VARIANTS:
            raise InputError(f"variant: unknown BM25 variant {variant!r}; use one of {list(BM25_VARIANTS)}")
        dedup = dedup or DedupConfig()
        parsed = parse_passages(passages)
        index = _build_index(parsed, variant, k1, b, embedder, dedup, show_progress)
        self._open(index, _Settings(variant, k1, b, rrf_k, dedup, embedder))
        self._log_ingestion(len(parsed) - index.dropped)

    def _open(self, index: _Index, settings: _Settings, name: str = "") -> None:
        """Every attribute a corpus has, set in this one place (``__init__`` and ``load`` come here)."""
        self.variant, self.k1, self.b, self.rrf_k = settings.variant, settings.k1, settings.b, settings.rrf_k
        self.dedup, self.embedder, self.name = settings.dedup, settings.embedder, name
        self.dropped = index.dropped
        self.ids, self.salience, self.embeddings = index.ids, index.salience, index.embeddings
        self._store, self._bm25, self._scoring = index.store, index.bm25, index.scoring
        self._df, self._vocab, self.analyzer = index.df, index.vocab, index.analyzer
        self._ingestion, self._ingestion_file = index.ingestion, index.ingestion_file
        self._fingerprint: str | None = None
        self._terms: list[str] | None = None  # the vocabulary in order, once a prefix is looked up

    def document_share(self, token: str) -> float:
        """Share of the passages that contain ``token`` (0 when none does)."""
        token_id = self._vocab.get(token)
        return float(self._df[token_id]) / len(self.ids) if token_id is not None else 0.0

    def holds_prefix(self, prefix: str) -> bool:
        """Whether some passage holds a token that starts with ``prefix`` (another form of a word)."""
        if self._terms is None:
            self._terms = sorted(t for t, i in self._vocab.items() if i < len(self._df) and self._df[i])
        at = bisect.bisect_left(self._terms, prefix)
        return at < len(self._terms) and self._terms[at].startswith(prefix)

    def _row_of(self, passage_id: int) -> int:
        row = int(np.searchsorted(self.ids, passage_id))
        if row >= len(self.ids) or self.ids[row] != passage_id:
            raise KeyError(passage_id)
        return row

    def _log_ingestion(self, before: int) -> None:
        ing = self.ingestion
        _log.info("Deduplication: %d → %d segments", before, len(ing.kept))
        if ing.ratio > self.dedup.warn_ingestion_ratio:
            _log.warning(
                "Ingestion dedup removed %.0f%% of the segments: boilerplate or automated text?",
                100 * ing.ratio,
            )
        if ing.boosts and max(ing.boosts.values()) > self.dedup.warn_boost:
            _log.warning(
                "A salience boost of %.2f exceeds %.2f: check the concept is not spam",
                max(ing.boosts.values()),
                self.dedup.warn_boost,
            )

    def stats(self) -> dict[str, Any]:
        """Corpus-level dedup metrics for reports."""
        boosts = list(self.ingestion.boosts.values())
        return {
            "passages": len(self.ids),
            "dropped_empty": self.dropped,
            "dedup_ratio_ingestion": round(self.ingestion.ratio, 6),
            "avg_salience_boost": round(sum(boosts) / len(boosts), 6) if boosts else 0.0,
            "max_salience_boost": round(max(boosts), 6) if boosts else 0.0,
            "embedder": self.embedder.name if self.embedder is not None else None,
            "analysis": self.analyzer.name,
        }

    def fingerprint(self) -> str:
        """SHA-256 of what retrieval depends on: the kept passages, their ids, the analysis and BM25."""
        if self._fingerprint is None:
            settings = [self.variant, self.k1, self.b, self.rrf_k, self.analyzer.name]
            digest = hashlib.sha256(json.dumps(settings).encode())
            for row, i in enumerate(self.ids):
                digest.update(f"\0{i}\0{self._store[row].render()}".encode())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def memory_bytes(self) -> int:
        """An estimate of the memory the corpus holds: index arrays, vocabulary, passages, vectors."""
        arrays = sum(a.nbytes for a in self._bm25.scores.values() if isinstance(a, np.ndarray))
        arrays += self._df.nbytes + self.salience.nbytes + self._scoring.nbytes
        if self.embeddings is not None:
            arrays += self.embeddings.nbytes
        # CPython: a str is about 50 bytes plus its characters; a Passage and its dict entries ~250.
        text = sum(len(self._store[row].title) + len(self._store[row].text) + 350 for row in range(len(self)))
        vocabulary = 120 * len(self._vocab)
        return int(arrays + text + vocabulary + self.ids.nbytes)

    def __len__(self) -> int:
        """Number of kept passages."""
        return len(self.ids)

    def __getitem__(self, passage_id: int) -> Passage:
        return self._store[self._row_of(passage_id)]

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every kept passage (in the order of ``ids``) for ``query``."""
        scoring = self._scoring
        tokens = self.analyzer.tokens(query)
        token_ids = [i for i in (self._vocab.get(t) for t in tokens) if i is not None and scoring[i]]
        if not token_ids:
            return np.zeros(len(self.ids), dtype=np.float32)
        return self._bm25.get_scores_from_ids(token_ids)

    def dense_scores(self, query: str) -> np.ndarray | None:
        """Cosine similarity of every kept passage to ``query``; None without dense vectors."""
        if self.embeddings is None or self.embedder is None:
            return None
        return self.embeddings @ self.embedder.embed([query])[0]

    def search(self, query: str, k: int = 5) -> list[tuple[int, float]]:
        """Top-``k`` passages, best first; equal scores keep input order.

        Zero-score passages fill the window when fewer than ``k`` match, so a small document
        set is always read in full.
        """
        return self.retrieve(query, k).hits

    def retrieve(self, query: str, k: int = 5) -> Retrieval:
        """``search`` with what post-ranking dedup removed on the way."""
        k = min(k, len(self.ids))
        if k <= 0:
            return Retrieval([], [], 0)
        bm25 = self.scores(query)
        dense = self.dense_scores(query)
        if dense is None:
            ranked = _top(bm25, k)
        else:
            pool = max(4 * k, 50)  # deep enough that dedup still leaves k
            lists = [[j for j in _top(bm25, pool) if bm25[j] > 0], _top(dense, pool)]
            if self.ingestion.boosts:
                lists.append(_top(self.salience, pool))
            fused = reciprocal_rank_fusion(lists, self.rrf_k)
            best = len(lists) / (self.rrf_k + 1)  # first in every list: fused score 1.0
            ranked = sorted(fused, key=lambda j: (-fused[j], j))
            scores = {j: fused[j] / best for j in ranked}
            vectors = None
            if self.dedup.retrieval_enabled:
                vectors = {j: self.embeddings[j] for j in ranked}
            hits, removed = dedup_ranked([(j, scores[j]) for j in ranked], vectors, self.dedup, k)
            if removed:
                _log.info(
                    "Post-ranking deduplication: %d → %d (removed %d cross-doc duplicates)",
                    len(hits) + len(removed),
                    len(hits),
                    len(removed),
                )
            result = Retrieval(
                [(int(self.ids[j]), float(s)) for j, s in hits],
                [int(self.ids[j]) for j in removed],
                len(hits) + len(removed),
                bm25,
                dense,
            )
            if result.dedup_ratio > self.dedup.warn_retrieval_ratio:
                _log.warning(
                    "Post-ranking dedup removed %.0f%%: a broad query or a corpus of near copies",
                    100 * result.dedup_ratio,
                )
            return result
        hits = [(int(self.ids[j]), float(bm25[j])) for j in ranked]
        if self.dedup.min_relevance_score is not None:
            hits, _ = dedup_ranked(hits, None, self.dedup, k)
        return Retrieval(hits, [], len(hits), bm25)

    def novel(self, candidates: Sequence[int], read: Sequence[int]) -> list[int]:
        """Keep the candidates that repeat none of the passages already ``read``.

        A second hop must bring new evidence. Without embeddings, or with retrieval dedup off,
        every candidate passes.
        """
        if self.embeddings is None or not self.dedup.retrieval_enabled or not read:
            return list(candidates)
        seen = self.embeddings[[self._row_of(i) for i in read]]
        threshold = self.dedup.retrieval_similarity_threshold
        return [i for i in candidates if float(np.max(seen @ self.embeddings[self._row_of(i)])) < threshold]

    def save(self, directory: str | os.PathLike[str], name: str = "") -> None:
        """Write the corpus and its index to ``directory``, so ``load`` needs no indexing.

        Every array is a ``.npy`` file that ``load`` memory-maps: a saved corpus opens in about
        the time it takes to read its vocabulary, whatever its size.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        ing = self.ingestion
        meta = {
            "format": _CORPUS_FORMAT,
            "name": name,
            "passages": len(self),
            "variant": self.variant,
            "k1": self.k1,
            "b": self.b,
            "rrf_k": self.rrf_k,
            "dropped": self.dropped,
            "embedder": self.embedder.name if self.embedder is not None else None,
            "dedup": asdict(self.dedup),
            "analysis": self.analyzer.name,
        }
        np.save(path / "ids.npy", np.asarray(self.ids, dtype=np.int64))
        np.save(path / "salience.npy", self.salience)
        np.save(path / "scoring.npy", self._scoring)
        np.save(path / "df.npy", self._df)
        self._store.save(path)
        if self.embeddings is not None:
            np.save(path / "embeddings.npy", self.embeddings)
        np.savez(
            path / "ingestion.npz",
            kept=np.asarray(ing.kept, dtype=np.int64),
            below=np.asarray(ing.below_salience, dtype=np.int64),
            exact=np.asarray(list(ing.exact_duplicates.items()), dtype=np.int64).reshape(-1, 2),
            near=np.asarray(list(ing.near_duplicates.items()), dtype=np.int64).reshape(-1, 2),
            boosts=np.asarray(list(ing.boosts.items()), dtype=np.float64).reshape(-1, 2),
        )
        self._bm25.save(path / "bm25", show_progress=False)
        # Written last: a folder without it is not a saved corpus (an interrupted save).
        (path / "brag_corpus.json").write_text(json.dumps(meta), encoding="utf-8")

    @staticmethod
    def saved_name(directory: str | os.PathLike[str]) -> str:
        """The name a folder written by ``save`` records (else the folder's); ValueError if not one."""
        path = Path(directory)
        try:
            meta = json.loads((path / "brag_corpus.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"{path}: not a saved BRAG corpus ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != _CORPUS_FORMAT:
            raise InputError(f"{path}: not a saved BRAG corpus of format {_CORPUS_FORMAT}: index it again")
        return meta.get("name") or path.resolve().name

    @classmethod
    def load(cls, directory: str | os.PathLike[str], embedder: Embedder | None = None) -> Corpus:
        """Open a corpus written by ``save``, its arrays memory-mapped; pass the same embedder."""
        path = Path(directory)
        try:
            meta = json.loads((path / "brag_corpus.json").read_text(encoding="utf-8"))
            if meta.get("format") != _CORPUS_FORMAT:
                raise InputError(f"format {meta.get('format')!r}, expected {_CORPUS_FORMAT}: index it again")
            # A save without one was analysed as a Latin-script English corpus is now.
            analyzer = Analyzer.named(meta.get("analysis", f"{ANALYSIS}:words:en"))
            ids = np.load(path / "ids.npy", mmap_mode="r")
            salience = np.load(path / "salience.npy", mmap_mode="r")
            scoring = np.load(path / "scoring.npy", mmap_mode="r")
            df = np.load(path / "df.npy", mmap_mode="r")
            store = _Passages.mapped(path, salience)
            bm25 = bm25s.BM25.load(path / "bm25", mmap=True)
            embeddings = np.load(path / "embeddings.npy", mmap_mode="r") if meta["embedder"] else None
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
            raise InputError(f"{path}: not a saved BRAG corpus ({err})") from None
        saved_with = meta["embedder"]
        if (embedder.name if embedder is not None else None) != saved_with:
            raise InputError(f"{path}: saved with embedder {saved_with!r}; pass the same one to load it")
        index = _Index(
            ids,
            salience,
            store,
            embeddings,
            bm25,
            scoring,
            df,
            bm25.vocab_dict,
            meta["dropped"],
            None,
            analyzer,
        )
        index.ingestion_file = path / "ingestion.npz"
        dedup = DedupConfig(**meta["dedup"])
        settings = _Settings(meta["variant"], meta["k1"], meta["b"], meta["rrf_k"], dedup, embedder)
        corpus = cls.__new__(cls)  # the saved state stands in for __init__'s build
        corpus._open(index, settings, meta.get("name", ""))
        return corpus

    @property
    def ingestion(self) -> IngestionResult:
        """What ingestion dedup kept and removed (read from disk on first use after ``load``)."""
        if self._ingestion is None:
            assert self._ingestion_file is not None  # a loaded corpus reads it from its folder
            with np.load(self._ingestion_file) as saved:
                self._ingestion = IngestionResult(
                    saved["kept"].tolist(),
                    saved["below"].tolist(),
                    {int(a): int(b) for a, b in saved["exact"]},
                    {int(a): int(b) for a, b in saved["near"]},
                    {int(a): float(b) for a, b in saved["boosts"]},
                    {int(i): float(v) for i, v in zip(self.ids, self.salience, strict=True)},
                )
        return self._ingestion


def cached_corpus(
    path: str | os.PathLike[str], name: str = "", cache: Path | None = None, **settings: Any
) -> Corpus:
    """The corpus in a JSON file, indexed once and kept under ``cache`` (``BRAG_CACHE_DIR``).

    The saved index is keyed by the file's SHA-256 and the BM25 settings, so a changed file or
    setting is indexed again; every later call memory-maps it instead of indexing. Two processes
    indexing at once each write a folder of their own, and the first renamed into place wins.
    """
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 22):
            digest.update(chunk)
    key = json.dumps({"variant": "okapi", "k1": 1.5, "b": 0.75, **settings}, sort_keys=True, default=_setting)
    slug = re.sub(r"[^a-z0-9]+", "-", (name or path.stem).lower()).strip("-") or "corpus"
    folder = (cache or cache_dir()) / "corpora" / f"{slug}-{digest.hexdigest()[:16]}-{_digest(key)[:8]}"
    embedder = settings.get("embedder")
    try:
        return Corpus.load(folder, embedder)
    except ValueError:
        pass  # not indexed yet, or a save that never finished
    corpus = Corpus(read_json(path, str(path)), **settings)
    scratch = folder.with_name(f"{folder.name}.{os.getpid()}.{time.time_ns()}.partial")
    corpus.save(scratch, name=name)
    try:
        scratch.rename(folder)
    except OSError:  # another process got there first: use its copy
        shutil.rmtree(scratch, ignore_errors=True)
    return Corpus.load(folder, embedder)


def _setting(value: Any) -> Any:
    """A setting as a cache key holds it: a dataclass (a DedupConfig) by its fields, an embedder by name."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(getattr(value, "name", None), str):
        return f"embedder {value.name}"
    raise TypeError(f"cached_corpus: {value!r} is no setting a cache can be keyed by")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _top(scores: np.ndarray, k: int) -> list[int]:
    """Row indices of the ``k`` highest scores, best first; equal scores keep input order."""
    k = min(k, len(scores))
    if k <= 0:
        return []
    # The k-th largest score; numpy selects the k-th smallest of the negation ~10x faster.
    cut = -np.partition(-scores, k - 1)[k - 1]
    above = np.flatnonzero(scores > cut)
    tied = np.flatnonzero(scores == cut)[: k - len(above)]
    pool = np.concatenate([above, tied])
    return [int(j) for j in pool[np.lexsort((pool, -scores[pool]))]]


def _remap(result: IngestionResult, ids: Sequence[int]) -> IngestionResult:
    """The same result with positions among non-empty passages turned into input ids."""
    return IngestionResult(
        [ids[j] for j in result.kept],
        [ids[j] for j in result.below_salience],
        {ids[a]: ids[b] for a, b in result.exact_duplicates.items()},
        {ids[a]: ids[b] for a, b in result.near_duplicates.items()},
        {ids[a]: v for a, v in result.boosts.items()},
        {ids[a]: v for a, v in result.salience.items()},
    )


# ------------------------------------------------------------------------------------------
# Evidence: what a read holds (its window) and what its answer shows, at no extra LLM call
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeenPassage:
    """A passage a window holds: its id, title and label, and its retrieval score (by id).

    ``lead``: how far its score led the next passage's in the retrieval that scored it, as a
    share of its own (0 unless it ranked first there): a near tie at the top is where a read of
    the top passage alone misses.
    """

    id: int
    title: str
    label: str
    score: float | None  # BM25-scale, from the retrieval that found it; None if none ranked it
    lead: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """As a report lists it (the score goes in the observation's ``scores``)."""
        return {"id": self.id, "title": self.title, "label": self.label}


@dataclass(frozen=True)
class Window:
    """What one read's prompt holds, built once by its kind and read by everything after.

    ``passages`` in prompt order, each scored by id when the window was built (a passage read
    before by the score it was read with, any other by ``found``, the retrieval that put it in
    the window); ``new``: those no read had held then; ``removed``: what dedup dropped from it;
    ``signals``: its before-call evidence features (``EVIDENCE``), which the lookahead prices the
    read by and its vote's evidence carries; ``gate``: the gate's signals and verdict, once
    judged (None: no gate, or not gated). The gate, the step, the evidence, the lookahead and a
    hop's observation all read this one value.
    """

    passages: tuple[SeenPassage, ...]
    found: Retrieval = field(compare=False)  # its score arrays compare by no single truth value
    new: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    signals: Mapping[str, float] = field(default_factory=dict)
    gate: Mapping[str, Any] | None = None

    @property
    def ids(self) -> list[int]:
        """Its passages' ids, in prompt order."""
        return [p.id for p in self.passages]

    @property
    def query(self) -> str:
        """What the retrieval behind it searched for."""
        return self.found.query

    @property
    def weak(self) -> bool:
        """Whether the gate called it weak."""
        return bool(self.gate and self.gate.get("weak"))


_NO_WORD_BEFORE = f"(?<![^\\W{UNSPACED_SCRIPTS}])"  # no letter or digit, but Han, kana…
_NO_WORD_AFTER = f"(?![^\\W{UNSPACED_SCRIPTS}])"


def _answer_pattern(answer: str) -> re.Pattern[str] | None:
    """The answer's words as a case-blind pattern that matches whole words across any spacing.

    Characters of scripts written without spaces are no word for a boundary: 内藤多仲 stands
    in 設計者は内藤多仲です, 1958 in 1958年.
    """
    said = answer.split()
    if not said:
        return None
    before = "" if _UNSPACED.match(answer.lstrip()) else _NO_WORD_BEFORE
    after = "" if _UNSPACED.match(answer.rstrip()[-1]) else _NO_WORD_AFTER
    return re.compile(before + r"\s+".join(map(re.escape, said)) + after, re.IGNORECASE)


def _find_answer(answer: str, text: str, folded: str | None = None) -> tuple[str, re.Match[str]] | None:
    """Where ``text`` holds ``answer`` word for word, and the text the match is in.

    As written, else after NFKC on both sides (full-width ＡＢＣ１２３, half-width kana);
    ``folded``: the text's NFKC form, when the caller keeps it.
    """
    folded = unicodedata.normalize("NFKC", text) if folded is None else folded
    pairs = [(answer, text), (unicodedata.normalize("NFKC", answer), folded)]
    for said, within in dict.fromkeys(pairs):  # the folded pair only if it differs
        pattern = _answer_pattern(said)
        found = pattern.search(within) if pattern is not None else None
        if found is not None:
            return within, found
    return None


def answer_logprobs(answer: str, tokens: Sequence[tuple[str, float]]) -> list[float]:
    """The log-probabilities of the tokens that spell ``answer`` where the reply first writes it.

    ``tokens`` are a reply's (piece, log-probability) pairs; [] when the reply does not hold the
    answer as written (a cleaned-up answer, say), so no probability is made up.
    """
    text = "".join(piece for piece, _ in tokens)
    pattern = _answer_pattern(answer)
    found = pattern.search(text) if pattern is not None else None
    if found is None:
        return []
    start, end = found.span()
    picked, position = [], 0
    for piece, logprob in tokens:
        if position < end and position + len(piece) > start:
            picked.append(logprob)
        position += len(piece)
    return picked


# Japanese kana-only bigrams are grammar (どこ, すか), a bigram across a change of script
# (定フ, ルは) spans a word boundary a paraphrase moves, and these Chinese bigrams ask a question
# (什么, 哪里): a manual's statements rarely hold them, whatever it is about. Languages that
# separate words lose their question words as stop words already.
_KANA_ONLY = re.compile(r"[\u3040-\u309f\u30fc]+")
_SCRIPT_OF = (
    (re.compile(r"[\u3040-\u309f]"), "hiragana"),
    (re.compile(r"[\u30a0-\u30ff]"), "katakana"),
    (re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"), "han"),
)
# A bigram holding one of these asks (什么, 哪里, 在哪, 怎么, 多少 ...): its words are the question's.
_CHINESE_QUESTION_CHARACTERS = re.compile("[什哪吗呢怎几么谁]")
_CHINESE_QUESTION_WORDS = frozenset(("如何", "多少", "是否"))


# The question words of languages written with spaces that their stop lists leave out (bm25s's
# keep "como" but not "cómo"): a question asks with them whatever it is about, so they are never
# an absent term or a named thing. They are no stop words for BM25, which indexes as it did.
_QUESTION_WORDS = frozenset(
    _folded(
        "cómo qué cuál cuáles dónde adónde cuándo cuánto cuánta cuántos cuántas quién quiénes "  # es
        "quali cosa perché quale quanta quante "  # it
        "comment quel quels quelle quelles où quand combien pourquoi lequel laquelle lesquels "  # fr
        "quais onde porquê quantos quantas "  # pt
        "wann wer warum wieviel wieviele weshalb wozu woher wohin "  # de
        "hoe wanneer waarom welke wie waar hoeveel".split()  # nl
    )
)


def _grammar(term: str) -> bool:
    """Whether a term of a question is its grammar rather than what it is about."""
    asks = (
        term in _CHINESE_QUESTION_WORDS
        or _CHINESE_QUESTION_CHARACTERS.search(term)
        or term in _QUESTION_WORDS
    )
    if _KANA_ONLY.fullmatch(term) or asks or term in _STOP_LANGUAGES:
        return True  # a stop word of any language ("who", "welche"), whatever the corpus drops
    scripts = {next((name for script, name in _SCRIPT_OF if script.match(c)), "") for c in term}
    return len(term) == 2 and "" not in scripts and len(scripts) == 2


@dataclass(frozen=True)
class ReadFacts:
    """What an evidence feature is computed from: a read's question, window and passages, and its reply.

    Before the call (a feature known from the window alone) ``answer`` is ""; ``tokens``: the
    reply's (piece, log-probability) pairs, None when the backend gave none; ``samples``: a
    sampled read's m replies (``()`` for any other read).
    """

    question: str
    window: Window
    passages: Sequence[Passage]  # the window's, as the prompt holds them
    answer: str = ""
    tokens: Sequence[tuple[str, float]] | None = None
    samples: Sequence[str] = ()
    analyzer: Analyzer | None = None  # the corpus's, for features that match its terms

    @property
    def yes_no(self) -> bool:
        """A yes/no answer: a passage or a question can say "yes" or "no" about anything."""
        return normalize_answer(self.answer) in ("yes", "no")

    @property
    def answer_tokens(self) -> list[float]:
        """The log-probabilities of the tokens that spell the answer (:func:`answer_logprobs`)."""
        return answer_logprobs(self.answer, self.tokens) if self.tokens and self.answer else []


def _answer_p(read: ReadFacts) -> float | None:
    picked = read.answer_tokens
    return math.exp(sum(picked) / len(picked)) if picked else None


def _answer_p_min(read: ReadFacts) -> float | None:
    picked = read.answer_tokens
    return math.exp(min(picked)) if picked else None


def _span(read: ReadFacts) -> float | None:
    if not read.answer or read.yes_no:
        return None
    rank = next((i for i, p in enumerate(read.passages, 1) if _find_answer(read.answer, p.shown())), None)
    return 1.0 / rank if rank else 0.0


def _in_question(read: ReadFacts) -> float | None:
    if not read.answer or read.yes_no:
        return None
    return float(_find_answer(read.answer, read.question) is not None)


def _question_share(read: ReadFacts) -> float | None:
    if not read.answer or read.yes_no:
        return None
    said = {w.casefold() for w in words(read.answer)}
    asked = {w.casefold() for w in words(read.question)}
    return len(said & asked) / len(said) if said else None


def _margin(read: ReadFacts) -> float:
    return read.window.passages[0].lead if read.window.passages else 0.0


def _top_coverage(read: ReadFacts) -> float:
    terms = {t for t in tokenize(read.question, read.analyzer) if not _grammar(t)}
    if not terms or not read.passages:
        return 0.0
    return len(terms & set(tokenize(read.passages[0].shown(), read.analyzer))) / len(terms)


def _agreement(read: ReadFacts) -> float | None:
    if not read.samples or not read.answer:
        return None
    return closed_book_mode(read.samples)[1] / len(read.samples)


class EvidenceFeature(NamedTuple):
    """One thing a read's vote carries about its own answer: its name and how it is computed.

    ``value`` gives None where it cannot be known (no answer; a backend without
    log-probabilities). ``before_call``: known from the window alone, so the lookahead prices a
    read by it before the read is made (it then ignores the reply).
    """

    name: str
    value: Callable[[ReadFacts], float | None]
    before_call: bool = False


# Every evidence feature, in the order evidence lists them: the one list to add one to, read
# where it is used (evidence_names). Each read's observation carries them, calibration records
# them with each outcome and fits a read's evidence curve on those its votes have (a refit too,
# a new one among them), and a calibration whose fits never saw one says so
# (Calibration.unweighed_features).
EVIDENCE: tuple[EvidenceFeature, ...] = (
    EvidenceFeature("answer_p", _answer_p),  # the answer's tokens' probability (geometric mean)
    EvidenceFeature("answer_p_min", _answer_p_min),  # its least likely token's
    EvidenceFeature("span", _span),  # 1 / rank of the first passage that holds it word for word, else 0
    EvidenceFeature("in_question", _in_question),  # 1 when the question holds it (a choice offered)
    EvidenceFeature("question_share", _question_share),  # its words' share the question holds
    EvidenceFeature("margin", _margin, before_call=True),  # the window's first passage's lead
    EvidenceFeature("top_coverage", _top_coverage, before_call=True),  # question terms it holds
    EvidenceFeature("agreement", _agreement),  # a sampled read's share of samples giving its answer
)


def evidence_names(before_call: bool | None = None) -> tuple[str, ...]:
    """The names of ``EVIDENCE``'s features as it is now: all, or those known before a call or not."""
    return tuple(f.name for f in EVIDENCE if before_call is None or f.before_call is before_call)


def window_evidence(read: ReadFacts) -> dict[str, float]:
    """A window's before-call features (``read``'s answer unused), as :attr:`Window.signals` holds them."""
    return {f.name: round(float(f.value(read)), 4) for f in EVIDENCE if f.before_call}


def read_evidence(
    answer: str,
    question: str,
    passages: Sequence[Passage],
    tokens: Sequence[tuple[str, float]] | None = None,
    *,
    window: Window | None = None,
    samples: Sequence[str] = (),
) -> dict[str, float | None]:
    """Every evidence feature of a read's answer (``EVIDENCE``), rounded; None where unknown.

    The before-call ones are its ``window``'s signals (None without a window).
    """
    read = ReadFacts(question, window or Window((), Retrieval([], [], 0)), passages, answer, tokens, samples)
    evidence: dict[str, float | None] = {}
    for feature in EVIDENCE:
        value = read.window.signals.get(feature.name) if feature.before_call else feature.value(read)
        evidence[feature.name] = None if value is None else round(value, 4)
    return evidence


def span_rank(evidence: Mapping[str, Any]) -> int | None:
    """The rank (from 1) in its window of the first passage holding the answer word for word; None: none."""
    span = evidence.get("span")
    return round(1 / span) if isinstance(span, (int, float)) and span > 0 else None


def resting_passages(window: Window, evidence: Mapping[str, Any]) -> tuple[int, ...]:
    """The passages of ``window`` a read's answer rests on: the first that holds it, else every one."""
    rank = span_rank(evidence)
    if rank is not None and rank <= len(window.passages):
        return (window.passages[rank - 1].id,)
    return tuple(p.id for p in window.passages)


def evidence_text(evidence: Mapping[str, float | None]) -> str:
    """The evidence in words, e.g. ``answer p 0.83 · span of passage 1``."""
    parts = []
    if evidence.get("answer_p") is not None:
        parts.append(f"answer p {evidence['answer_p']:.2f}")
    span = evidence.get("span")
    if span is not None:
        parts.append(f"span of passage {span_rank(evidence)}" if span else "not in any passage read")
    if evidence.get("in_question"):
        parts.append("named in the question")
    return " · ".join(parts)


# ------------------------------------------------------------------------------------------
# Gate: cheap signals of a weak retrieval window, no LLM (SPEC section 3)
# ------------------------------------------------------------------------------------------


_NUMBER = re.compile(r"\d")
MAX_TERM_LOOKUPS = 32  # above the 24 distinct terms of the longest benchmark question


def _salient_terms(question: str, corpus: Retriever, rare_share: float = 0.01) -> set[str]:
    """Terms a window must mention to hold the evidence for ``question``.

    Named entities (capitalised words after the first), numbers, and rare terms: found in at
    most ``rare_share`` of the passages (or in one, in a small corpus).
    """
    analyzer = _analyzer_of(corpus)
    said = question.split()
    spans = " ".join(w for w in said[1:] if w[:1].isupper() or _NUMBER.search(w))
    named = set(tokenize(spans, analyzer))
    if not len(corpus):
        return named  # nothing to be rare in (an empty collection)
    # A term no passage contains cannot be covered by any window, so it says nothing.
    floor = max(1.0, rare_share * len(corpus)) / len(corpus)
    # Each share can be a query to the retriever (Milvus counts it): a question's first
    # MAX_TERM_LOOKUPS distinct terms are looked up, however long it is.
    terms = list(dict.fromkeys(tokenize(question, analyzer)))[:MAX_TERM_LOOKUPS]
    rare = {t for t in terms if 0 < corpus.document_share(t) <= floor}
    return named | rare


# A word of at least STEM_LETTERS letters is held when a passage holds a word that begins like it,
# all but its last STEM_ENDING letters: "configura" by "configurare", "sostituisce" by
# "sostituire", "updates" by "updated". No dictionary and no stemmer: any language whose words
# change their endings (Italian, Spanish, French, German, English...); names stay whole.
STEM_LETTERS, STEM_ENDING, STEM_MIN = 7, 3, 5


def held_term(term: str, corpus: Retriever) -> bool:
    """Whether a passage holds ``term``, or, for a long word, another form of it (``holds_prefix``)."""
    if corpus.document_share(term) > 0:
        return True
    prefixes = getattr(corpus, "holds_prefix", None)  # a retriever that can look up a word's start
    if prefixes is None or len(term) < STEM_LETTERS or not term.isalpha() or _UNSPACED.search(term):
        return False
    return bool(prefixes(term[: max(STEM_MIN, len(term) - STEM_ENDING)]))


def absent_share(question: str, corpus: Retriever) -> float:
    """The share of the question's distinct terms (its first ``MAX_TERM_LOOKUPS``) no passage holds.

    A question about something the documents never name asks for what they cannot answer,
    whatever a read of the nearest passage says (a ``FoundModel`` signal). A word's other forms
    count as held (:func:`held_term`), so an inflected verb of the question is no absent term.
    """
    terms = [t for t in dict.fromkeys(tokenize(question, _analyzer_of(corpus))) if not _grammar(t)]
    terms = terms[:MAX_TERM_LOOKUPS]
    if not terms or not len(corpus):
        return 0.0
    return sum(not held_term(t, corpus) for t in terms) / len(terms)


def topk_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Share of the top-k of ``a`` that is also in the top-k of ``b``."""
    return len(set(_top(a, k)) & set(_top(b, k))) / max(1, min(k, len(a)))


def window_signals(
    question: str, corpus: Retriever, window: Sequence[int], k: int, found: Retrieval | None = None
) -> dict[str, float]:
    """The gate's signals for one window; a signal that cannot be computed is absent.

    ``found``, the retrieval for ``question``, lends its scores so nothing is scored twice. A
    retriever that scores only its top hits gives the height and spread signals from those.
    """
    scorer = corpus if isinstance(corpus, ScoringRetriever) else None
    bm25 = found.bm25 if found is not None else None
    if bm25 is None and scorer is not None:
        bm25 = scorer.scores(question)
    if bm25 is not None:
        top = bm25[_top(bm25, max(k, 2))]
    else:
        top = np.array(sorted((score for _, score in (found.hits if found else [])), reverse=True) or [0.0])
    signals = {
        "max_score": float(top[0]),
        "top_gap": float(top[0] - top[1]) if len(top) > 1 else 0.0,
        "score_variance": float(np.var(top[:k])),
    }
    terms = _salient_terms(question, corpus)
    signals["salient_terms"] = float(len(terms))  # more named things, more passages needed
    if terms:
        analyzer = _analyzer_of(corpus)
        read = [set(tokenize(corpus[i].shown(), analyzer)) for i in window]
        signals["evidence_coverage"] = len(terms & set().union(*read)) / len(terms)
        top1 = read[0] if read else set()
        signals["top1_coverage"] = len(terms & top1) / len(terms)
    dense = found.dense if found is not None else None
    if dense is None and scorer is not None and bm25 is not None:
        dense = scorer.dense_scores(question)
    if dense is not None and bm25 is not None:
        signals["dense_max_score"] = float(dense.max())
        signals["dense_score_variance"] = float(np.var(dense[_top(dense, k)]))
        signals["retriever_divergence"] = 1.0 - topk_overlap(bm25, dense, k)
    return signals


@dataclass(frozen=True)
class GateSignal:
    """One kept signal: oriented so lower means weaker; it fires at or below ``threshold``."""

    name: str
    orientation: float  # +1 when weak windows have low raw values, -1 when they have high ones
    threshold: float
    auc: float


@dataclass(frozen=True)
class Gate:
    """Fires (the window is likely missing a passage) when any kept signal fires."""

    signals: tuple[GateSignal, ...]
    k: int = 5

    def fires(self, signals: Mapping[str, float]) -> bool | None:
        """The verdict for a window's signals; None when none of the gate's signals is present."""
        verdicts = [s.orientation * signals[s.name] <= s.threshold for s in self.signals if s.name in signals]
        return any(verdicts) if verdicts else None

    def judge(self, window: Window, corpus: Retriever) -> Window:
        """``window`` with its gate signals and the verdict on them (:attr:`Window.gate`)."""
        signals = window_signals(window.query, corpus, window.ids, self.k, window.found)
        rounded = {name: round(value, 6) for name, value in signals.items()}
        return replace(window, gate={"signals": rounded, "weak": self.fires(signals)})


# ------------------------------------------------------------------------------------------
# Calibration entries: what a calibration holds for each action, and how it is read
# ------------------------------------------------------------------------------------------


class _BetaMean:
    """Anything with a reliability Beta(a, b)."""

    a: float
    b: float

    @property
    def mean(self) -> float:
        """Mean reliability a / (a + b)."""
        return self.a / (self.a + self.b)


@dataclass(frozen=True)
class Level(_BetaMean):
    """A CB agreement level g: how often it occurs (pi) and its reliability Beta(a, b)."""

    g: int
    pi: float
    a: float
    b: float


@dataclass(frozen=True)
class Branch(_BetaMean):
    """One outcome of a second-hop read, relative to the answers read before it.

    ``same``: it repeats an earlier read's answer; ``new``: it names another. Its share ``pi``
    (among answers given after an earlier answer) and its reliability Beta(a, b), whose mean is
    set so a vote's likelihood ratio is the calibrated one (for ``same``: how much more often a
    repeat follows a right earlier answer than a wrong one).
    """

    pi: float
    a: float
    b: float


@dataclass(frozen=True)
class EvidenceLevel(_BetaMean):
    """One level of a read's votes: its name, its share of votes (pi), its reliability Beta(a, b)."""

    name: str  # "hi" or "lo"
    pi: float
    a: float
    b: float


@dataclass(frozen=True)
class EvidenceSplit:
    """A read's votes in two levels by a score of their evidence, each level its own reliability.

    The score is ``intercept + sum(weight * feature)`` over ``weights`` (one feature with weight
    1, or a logistic combination of several, as calibration chose). A vote whose score is at
    least ``threshold`` lands in ``hi``, else in ``lo``; a vote lacking any weighted feature
    keeps the action's flat reliability. ``auc``: the score's AUROC for a right answer on
    held-out calibration questions; ``name`` says what the score is.
    """

    name: str
    weights: tuple[tuple[str, float], ...]
    intercept: float
    threshold: float
    hi: EvidenceLevel
    lo: EvidenceLevel
    auc: float
    features: tuple[str, ...] = ()  # what its fit looked at (older files: what it weighs)

    @property
    def levels(self) -> tuple[EvidenceLevel, EvidenceLevel]:
        """Both levels, ``hi`` first."""
        return self.hi, self.lo

    def score(self, evidence: Mapping[str, float | None]) -> float | None:
        """The vote's score; None when it lacks a feature the score needs."""
        total = self.intercept
        for feature, weight in self.weights:
            value = evidence.get(feature)
            if value is None:
                return None
            total += weight * value
        return total

    def level(self, evidence: Mapping[str, float | None]) -> EvidenceLevel | None:
        """The level a vote with this evidence lands in; None when it lacks a feature."""
        score = self.score(evidence)
        if score is None:
            return None
        return self.hi if score >= self.threshold else self.lo


@dataclass(frozen=True)
class EvidenceCurve:
    """A read's reliability as a monotone function of its evidence score: rho = sigmoid(score).

    The score is ``intercept + sum(weight * feature)``, a logistic regression's linear predictor
    fitted on right and wrong reads; a feature a vote lacks (a backend without log-probabilities)
    counts at its mean over the fitted votes (``means``). ``spread``: (share, score) of the
    fitted votes in a few bins of the part of their score that pre-call features
    (``evidence_names(before_call=True)``) do not set, so the lookahead prices the spread of the next vote's
    rho given what the question's retrieval already shows. ``auc``: the score's held-out AUROC.
    ``features``: the evidence features its fit looked at (those BRAG computed then).
    """

    weights: tuple[tuple[str, float], ...]
    intercept: float
    means: tuple[tuple[str, float], ...]
    spread: tuple[tuple[float, float], ...]
    auc: float
    features: tuple[str, ...] = ()  # what its fit looked at (older files: what it weighs)

    def __post_init__(self) -> None:
        if not self.spread or abs(sum(share for share, _ in self.spread) - 1.0) > 1e-3:
            raise CalibrationError("calibration: an evidence curve's spread shares must sum to 1")

    @cached_property
    def _before_call(self) -> frozenset[str]:
        """Its features known before a call (``EVIDENCE`` as it was when the curve was first used)."""
        return frozenset(evidence_names(before_call=True))

    def _part(self, evidence: Mapping[str, float | None], features: Collection[str]) -> float:
        means = dict(self.means)
        total = 0.0
        for feature, weight in self.weights:
            if feature in features:
                value = evidence.get(feature)
                total += weight * (means.get(feature, 0.0) if value is None else value)
        return total

    def score(self, evidence: Mapping[str, float | None]) -> float:
        """The vote's score (a missing feature at its mean)."""
        return self.intercept + self._part(evidence, dict(self.weights))

    def reliability(self, evidence: Mapping[str, float | None]) -> float:
        """The vote's own reliability: sigmoid of its score, within ``RELIABILITY_BOUNDS``."""
        return bounded_reliability(_sigmoid(self.score(evidence)))

    def outcomes(self, signals: Mapping[str, float] | None, eta: float) -> tuple[tuple[float, float], ...]:
        """(share, likelihood ratio) of the next vote, given the question's pre-call signals.

        Without signals, the fitted votes' own (their means): the curve's prior view.
        """
        pre = self._part(signals or {}, self._before_call)
        rhos = [(share, bounded_reliability(_sigmoid(pre + post))) for share, post in self.spread]
        return tuple((share, rho / ((1 - rho) * eta)) for share, rho in rhos)

    @property
    def levels(self) -> tuple[EvidenceLevel, ...]:
        """Its spread as levels (share, reliability at the mean pre-call signals), for the rates."""
        pre = self._part({}, self._before_call)
        levels = []
        for i, (share, post) in enumerate(self.spread):
            rho = bounded_reliability(_sigmoid(pre + post))
            levels.append(EvidenceLevel(f"bin{i + 1}", share, *_prior_beta(rho)))
        return tuple(levels)


@dataclass(frozen=True)
class ActionPrior(_BetaMean):
    """Answerability q and reliability Beta(a, b) of one action; CB adds agreement levels."""

    q: float
    a: float
    b: float
    levels: tuple[Level, ...] = ()
    weak: ActionPrior | None = None  # (q, rho) when the gate calls the window weak
    same: Branch | None = None  # R2 only: the second hop repeats an earlier read's answer
    new: Branch | None = None  # R2 only: the second hop names an answer no earlier read gave
    evidence: EvidenceSplit | None = None  # reads: vote levels by what the answer shows
    curve: EvidenceCurve | None = None  # reads: each vote's own rho from its evidence (over levels)

    @property
    def spread(self) -> EvidenceSplit | EvidenceCurve | None:
        """What a read's votes vary by: its curve, else its evidence levels, else nothing."""
        return self.curve or self.evidence

    def on_weak_window(self) -> ActionPrior:
        """(q, rho) on a window the gate calls weak, never above the strong window's."""
        weak = self.weak or self
        a, b = (weak.a, weak.b) if weak.mean <= self.mean else (self.a, self.b)
        return ActionPrior(
            min(weak.q, self.q), a, b, evidence=self.evidence, curve=self.curve, same=self.same
        )


@dataclass(frozen=True)
class ReaderTerms:
    """A reader's own terms of one action: its reliabilities' logits scaled, then shifted.

    What a documents fit across readers keeps per reader (:meth:`Calibration.for_reader`): the
    evidence curves' features, the found model and the repeats mean the same for any reader;
    how far a reader's reads are to be trusted at the same evidence is its own.
    ``logit rho' = scale * logit rho + offset``; ``ReaderTerms()`` leaves an entry as it is.
    """

    offset: float = 0.0
    scale: float = 1.0

    def rho(self, rho: float) -> float:
        """A reliability under these terms."""
        rho = min(max(rho, 1e-9), 1 - 1e-9)
        return _sigmoid(self.scale * math.log(rho / (1 - rho)) + self.offset)

    def beta(self, a: float, b: float) -> tuple[float, float]:
        """A reliability Beta under these terms: its mean moved, its concentration kept.

        Neither parameter falls below a calibration's least (``_BETA_RANGE``): a mean moved
        toward 0 or 1 stops where its Beta would stop being one.
        """
        total = a + b
        least = 2 * _BETA_RANGE[0] / total
        mean = min(max(self.rho(a / total), least), 1 - least)
        return mean * total, (1 - mean) * total

    def curve(self, curve: EvidenceCurve) -> EvidenceCurve:
        """An evidence curve whose score is ``scale * score + offset`` (its spread likewise)."""
        return replace(
            curve,
            weights=tuple((name, round(w * self.scale, 6)) for name, w in curve.weights),
            intercept=round(curve.intercept * self.scale + self.offset, 6),
            spread=tuple((share, round(post * self.scale + self.offset, 6)) for share, post in curve.spread),
        )

    def prior(self, prior: ActionPrior) -> ActionPrior:
        """An action's entry under these terms: every reliability it holds; its rates and repeats kept."""

        def moved(item: Any) -> Any:
            a, b = self.beta(item.a, item.b)
            return replace(item, a=round(a, 6), b=round(b, 6))

        evidence = prior.evidence
        if evidence is not None:
            evidence = replace(evidence, hi=moved(evidence.hi), lo=moved(evidence.lo))
        return replace(
            moved(prior),
            levels=tuple(moved(level) for level in prior.levels),
            weak=self.prior(prior.weak) if prior.weak is not None else None,
            evidence=evidence,
            curve=self.curve(prior.curve) if prior.curve is not None else None,
        )


def _reader_terms_from_dict(raw: Any, actions: Collection[str]) -> dict[str, dict[str, ReaderTerms]]:
    """A calibration's ``readers``: per reader's name, per action it has, (offset, scale)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise CalibrationError("calibration: readers must be an object of reader names")
    found: dict[str, dict[str, ReaderTerms]] = {}
    for reader, terms in raw.items():
        if not isinstance(reader, str) or not isinstance(terms, Mapping):
            raise CalibrationError(f"calibration: readers.{_shown(reader)} must be an object of actions")
        found[reader] = {}
        for label, term in terms.items():
            where = f"readers.{reader}.{label}"
            if label not in actions or not isinstance(term, Mapping):
                raise CalibrationError(f"calibration: {where} must be an object for one of its actions")
            offset = _number(term.get("offset"), f"{where}.offset", -20.0, 20.0)
            scale = _number(term.get("scale"), f"{where}.scale", 0.0, 20.0, open_low=True)
            found[reader][label] = ReaderTerms(offset, scale)
    return found


@dataclass(frozen=True)
class ActionCost:
    """What one run of an action cost on average when calibration measured it."""

    prompt_tokens: float
    completion_tokens: float
    requests: float
    seconds: float | None  # None when the latencies were not known


def _listed(names: Sequence[str]) -> str:
    """``R1, R2 and CB``."""
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


CALIBRATION_VERSION = 1


_MIN_ETA = 1e-6


_MAX_SAMPLES = 20


def _number(value: Any, where: str, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise CalibrationError(f"calibration: {where} must be a number, got {_shown(value)}")
    if value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise CalibrationError(
            f"calibration: {where} = {_shown(value)} is outside {bracket}{low:g}, {high:g}]"
        )
    return float(value)


# A Beta parameter is a count of pseudo-observations: below a thousandth or above a million it
# is no fit (a fit's are 0.01 to 100 or so), and near 0 its arithmetic fails (5e-324 gave NaN).
_BETA_RANGE = (1e-3, 1e6)


def _beta(entry: Any, where: str) -> tuple[float, float]:
    if not isinstance(entry, Mapping) or "a" not in entry or "b" not in entry:
        raise CalibrationError(f"calibration: {where} must be an object with Beta parameters 'a' and 'b'")
    a = _number(entry["a"], f"{where}.a", *_BETA_RANGE)
    b = _number(entry["b"], f"{where}.b", *_BETA_RANGE)
    return a, b


def _read_action(name: str, entry: Mapping[str, Any], *, hop: bool = False) -> ActionPrior:
    """A read's entry: q, ρ, and the weak-window and (a hop's) repeat/new branches when present."""
    q = _number(entry.get("q"), f"actions.{name}.q", 0.0, 1.0)
    weak = None
    if entry.get("weak") is not None:
        raw_weak = entry["weak"]
        if not isinstance(raw_weak, Mapping):
            raise CalibrationError(f"calibration: actions.{name}.weak must be an object with q and rho")
        weak_q = _number(raw_weak.get("q"), f"actions.{name}.weak.q", 0.0, 1.0)
        weak = ActionPrior(weak_q, *_beta(raw_weak.get("rho"), f"actions.{name}.weak.rho"))
    same = new = None
    if hop and (entry.get("same") is not None or entry.get("new") is not None):
        same, new = _second_hop_branches(name, entry.get("same"), entry.get("new"))
    elif not hop and entry.get("same") is not None:  # a read that repeats an earlier read's answer
        raw_same = entry["same"]
        if not isinstance(raw_same, Mapping):
            raise CalibrationError(f"calibration: actions.{name}.same must be an object with pi and rho")
        pi = _number(raw_same.get("pi"), f"actions.{name}.same.pi", 0.0, 1.0)
        same = Branch(pi, *_beta(raw_same.get("rho"), f"actions.{name}.same.rho"))
    rho = _beta(entry.get("rho"), f"actions.{name}.rho")
    evidence = _evidence_from_dict(entry["evidence"], name) if entry.get("evidence") is not None else None
    curve = _curve_from_dict(entry["curve"], name) if entry.get("curve") is not None else None
    return ActionPrior(q, *rho, weak=weak, same=same, new=new, evidence=evidence, curve=curve)


def curve_to_dict(curve: EvidenceCurve) -> dict[str, Any]:
    """An evidence curve as a calibration file holds it."""
    found = {
        "weights": dict(curve.weights),
        "intercept": curve.intercept,
        "means": dict(curve.means),
        "spread": [list(pair) for pair in curve.spread],
        "auc": curve.auc,
    }
    return {**found, "features": list(curve.features)} if curve.features else found


def _looked_at(raw: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """An evidence fit's ``features``: the names BRAG computed when it was fitted (none recorded: ())."""
    listed = raw.get("features", [])
    if not isinstance(listed, list) or len(listed) > 100 or not all(isinstance(f, str) for f in listed):
        raise CalibrationError(f"calibration: {where}.features must list feature names")
    return tuple(f[:80] for f in listed)


def _curve_from_dict(raw: Any, action: str) -> EvidenceCurve:
    """A read's evidence curve: its feature weights, intercept, means, spread and AUROC."""
    where = f"actions.{action}.curve"
    if not isinstance(raw, Mapping):
        raise CalibrationError(f"calibration: {where} must be an object")
    tables = {}
    for key in ("weights", "means"):
        table = raw.get(key)
        if not isinstance(table, Mapping) or not set(table) <= set(evidence_names()):
            raise CalibrationError(
                f"calibration: {where}.{key} must map some of {', '.join(evidence_names())} to numbers"
            )
        tables[key] = tuple((f, _number(v, f"{where}.{key}.{f}", -1e6, 1e6)) for f, v in table.items())
    spread = raw.get("spread")
    if not isinstance(spread, list) or not spread or len(spread) > 20:
        raise CalibrationError(f"calibration: {where}.spread must list 1 to 20 [share, score] pairs")
    pairs = []
    for i, pair in enumerate(spread):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CalibrationError(f"calibration: {where}.spread[{i}] must be a [share, score] pair")
        pairs.append(
            (
                _number(pair[0], f"{where}.spread[{i}]", 0.0, 1.0),
                _number(pair[1], f"{where}.spread[{i}]", -1e6, 1e6),
            )
        )
    return EvidenceCurve(
        tables["weights"],
        _number(raw.get("intercept", 0.0), f"{where}.intercept", -1e6, 1e6),
        tables["means"],
        tuple(pairs),
        _number(raw.get("auc", 0.5), f"{where}.auc", 0.0, 1.0),
        _looked_at(raw, where),
    )


def _evidence_to_dict(split: EvidenceSplit) -> dict[str, Any]:
    levels = {lv.name: {"pi": lv.pi, "rho": {"a": lv.a, "b": lv.b}} for lv in split.levels}
    found = {
        "name": split.name,
        "weights": dict(split.weights),
        "intercept": split.intercept,
        "threshold": split.threshold,
        "auc": split.auc,
        "levels": levels,
    }
    return {**found, "features": list(split.features)} if split.features else found


def _evidence_from_dict(raw: Any, action: str) -> EvidenceSplit:
    """A read's evidence levels: the score (feature weights), its threshold, and each level."""
    where = f"actions.{action}.evidence"
    weights = raw.get("weights") if isinstance(raw, Mapping) else None
    if not isinstance(weights, Mapping) or not weights or not set(weights) <= set(evidence_names()):
        raise CalibrationError(
            f"calibration: {where}.weights must map some of {', '.join(evidence_names())} to numbers"
        )
    parsed_weights = tuple((f, _number(w, f"{where}.weights.{f}", -1e6, 1e6)) for f, w in weights.items())
    intercept = _number(raw.get("intercept", 0.0), f"{where}.intercept", -1e6, 1e6)
    threshold = _number(raw.get("threshold"), f"{where}.threshold", -1e6, 1e6)
    auc = _number(raw.get("auc", 0.5), f"{where}.auc", 0.0, 1.0)
    levels = raw.get("levels")
    if not isinstance(levels, Mapping) or set(levels) != {"hi", "lo"}:
        raise CalibrationError(f"calibration: {where}.levels must give 'hi' and 'lo'")
    parsed = {}
    for name in ("hi", "lo"):
        entry = levels[name]
        if not isinstance(entry, Mapping):
            raise CalibrationError(f"calibration: {where}.levels.{name} must be an object with pi and rho")
        pi = _number(entry.get("pi"), f"{where}.levels.{name}.pi", 0.0, 1.0)
        parsed[name] = EvidenceLevel(name, pi, *_beta(entry.get("rho"), f"{where}.levels.{name}.rho"))
    if abs(parsed["hi"].pi + parsed["lo"].pi - 1.0) > 1e-3:
        raise CalibrationError(f"calibration: {where}.levels pi values must sum to 1")
    name = str(raw.get("name") or "+".join(weights))[:80]
    hi, lo, features = parsed["hi"], parsed["lo"], _looked_at(raw, where)
    return EvidenceSplit(name, parsed_weights, intercept, threshold, hi, lo, auc, features)


def _second_hop_branches(name: str, raw_same: Any, raw_new: Any) -> tuple[Branch, Branch]:
    """A hop's two vote types: it repeats an earlier read's answer (share pi), or names another."""
    if not isinstance(raw_same, Mapping) or not isinstance(raw_new, Mapping):
        raise CalibrationError(f"calibration: actions.{name} needs both 'same' {{pi, rho}} and 'new' {{rho}}")
    pi = _number(raw_same.get("pi"), f"actions.{name}.same.pi", 0.0, 1.0)
    same = Branch(pi, *_beta(raw_same.get("rho"), f"actions.{name}.same.rho"))
    return same, Branch(1.0 - pi, *_beta(raw_new.get("rho"), f"actions.{name}.new.rho"))


def _closed_book_from_dict(entry: Mapping[str, Any], name: str) -> ActionPrior:
    """A samples action's entry: q and one {pi, kappa} per agreement level g = 1..m."""
    q = _number(entry.get("q"), f"actions.{name}.q", 0.0, 1.0)
    levels_raw = entry.get("levels")
    if not isinstance(levels_raw, Mapping) or not levels_raw:
        raise CalibrationError(
            f"calibration: actions.{name}.levels must map each agreement level g to {{pi, kappa}}"
        )
    levels = []
    for key, lv in levels_raw.items():
        if not str(key).isdigit() or not isinstance(lv, Mapping):
            raise CalibrationError(
                f"calibration: actions.{name}.levels.{_shown(key)} is not a level g -> {{pi, kappa}}"
            )
        where = f"actions.{name}.levels.{key}"
        pi = _number(lv.get("pi"), f"{where}.pi", 0.0, 1.0)
        levels.append(Level(int(key), pi, *_beta(lv.get("kappa"), f"{where}.kappa")))
    levels.sort(key=lambda lv: lv.g)
    m = levels[-1].g
    if [lv.g for lv in levels] != list(range(1, m + 1)):
        raise CalibrationError(f"calibration: actions.{name}.levels must be exactly 1..{m}")
    if m > _MAX_SAMPLES:  # m is how many samples every CB call asks for
        raise CalibrationError(
            f"calibration: {name} has {m} agreement levels; at most {_MAX_SAMPLES} are allowed"
        )
    if abs(sum(lv.pi for lv in levels) - 1.0) > 1e-3:
        raise CalibrationError(f"calibration: actions.{name}.levels pi values must sum to 1")
    # A mean reliability near 1 is allowed; the Beta prior keeps it finite.
    return ActionPrior(q, 1.0, 1.0, tuple(levels))


# ------------------------------------------------------------------------------------------
# Policy: information rates, choice, stop rule
# ------------------------------------------------------------------------------------------


def vote_information(rho: float, eta: float, rule: str = "floored") -> float:
    """d(rho) = (rho - (1 - rho) eta) ln(rho / ((1 - rho) eta)), the KL rate of one vote.

    ``floored``: 0 at and below rho_0 = eta / (1 + eta), where a vote cannot raise its answer's
    odds (SPEC's d grows again below rho_0, so a useless source looked informative).
    """
    rho = min(max(rho, 1e-9), 1 - 1e-9)
    if rule == "floored" and rho <= uninformative_reliability(eta):
        return 0.0
    wrong = (1.0 - rho) * eta
    return (rho - wrong) * math.log(rho / wrong)


def information_rate(action: ActionPrior, eta: float, rule: str = "floored") -> float:
    """D_a = q_a d(rho_a); over levels (CB's agreement, a read's evidence), q sum_g pi_g d(rho_g)."""
    levels = action.levels or (action.spread.levels if action.spread is not None else ())
    if levels:
        return action.q * sum(level.pi * vote_information(level.mean, eta, rule) for level in levels)
    return action.q * vote_information(action.mean, eta, rule)


def _likelihood_ratio(rho: float, eta: float, rule: str = "floored") -> float:
    """How much a vote multiplies its candidate's odds: rho / ((1 - rho) eta), floored at 1."""
    rho = min(max(rho, 1e-9), 1 - 1e-9)
    ratio = rho / ((1 - rho) * eta)
    return max(1.0, ratio) if rule == "floored" else ratio


# What one vote may be: (share, likelihood ratio) of each kind of vote.
Outcomes = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class VoteOutlook:
    """What one action's vote can be, for the lookahead.

    Whether it answers (q), and the likelihood ratio of each kind of vote with its share (CB:
    one per agreement level; a read: one per evidence level, or one). For the conditional
    second hop, ``same_ratio`` is the ratio of a vote repeating an earlier read's answer; the
    outcomes hold a new answer's.
    """

    q: float
    outcomes: tuple[tuple[float, float], ...]
    same_ratio: float | None = None

    # (summed share, ratio) per distinct ratio: the kinds of vote that move the posterior alike
    kinds: tuple[tuple[float, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shares: dict[float, float] = {}
        for share, ratio in self.outcomes:
            shares[ratio] = shares.get(ratio, 0.0) + share
        object.__setattr__(self, "kinds", tuple((share, ratio) for ratio, share in shares.items()))


def expected_gain(
    beliefs: Beliefs,
    n_candidates: int,
    eta: float,
    outlook: VoteOutlook,
    repeatable: Collection[int] = (),
    posterior: tuple[list[float], float] | None = None,
) -> float:
    """The expected drop in P_err from one more vote: a one-step lookahead.

    Under the posterior's own model a vote names the true answer with probability rho and each
    particular wrong one with (1 - rho) eta; every kind and target of vote is weighted by its
    predictive probability, and the posterior after it is the one :class:`Beliefs` would reach.
    It is what the stop rule prices: lambda is the price of one call in units of answer error.
    ``posterior`` is ``beliefs.probabilities(n_candidates)`` when the caller has it already.
    """
    probs, residual = posterior if posterior is not None else beliefs.probabilities(n_candidates)
    return _gain(_Now.of(beliefs, probs, residual), eta, outlook, repeatable)


class _Now(NamedTuple):
    """What every action's lookahead reads from one posterior, worked out once per decision.

    Per candidate: its probability, the leader's or runner-up's probability it must beat, and
    its log weight with whether a vote favours it (under ``floored``, None under ``spec``).
    """

    beliefs: Beliefs
    probs: list[float]
    residual: float
    best: float
    others: list[float]
    log_w: list[float]
    favoured: list[bool] | None

    @classmethod
    def of(cls, beliefs: Beliefs, probs: list[float], residual: float) -> _Now:
        first, best, runner_up = _top_two(probs)
        others = [best] * len(probs)
        if first >= 0:
            others[first] = runner_up
        log_w = beliefs.log_w
        fast = beliefs.model.rule == "floored" and len(beliefs.favour) == len(log_w) == len(probs)
        favoured = [f is not None for f in beliefs.favour] if fast else None
        return cls(beliefs, probs, residual, best, others, log_w, favoured)


def _gain(now: _Now, eta: float, outlook: VoteOutlook, repeatable: Collection[int]) -> float:
    """:func:`expected_gain` from a posterior's :class:`_Now`."""
    probs, best, others, log_w, favoured = now.probs, now.best, now.others, now.log_w, now.favoured
    same = outlook.same_ratio
    same_terms = _vote_terms(same, eta) if same is not None and repeatable else None
    exp = math.exp
    expected = (1 - outlook.q) * best
    for share, ratio in outlook.kinds:
        rho_new, log_new = _vote_terms(ratio, eta)
        total, covered = 0.0, 0.0
        for j, pj in enumerate(probs):
            if same_terms is not None and j in repeatable:
                (rho, log_lr), r = same_terms, same
            else:
                rho, log_lr, r = rho_new, log_new, ratio
            chance = pj * rho + (1 - pj) * (1 - rho) * eta  # the vote names candidate j
            # How much the vote multiplies j's weight, as Beliefs.add would. Floored: a
            # candidate some vote favours (log_w = its favour) grows by the ratio when it is at
            # least 1, else not at all; one no vote favours (log_w = its largest log ratio w)
            # grows to the vote's ratio when that is above e^w. Spelled out, as this loop is
            # most of a decision's time.
            if favoured is None:
                grown = pj * exp(now.beliefs.weight_after(j, log_lr) - log_w[j])
            elif favoured[j]:
                grown = pj * r if log_lr >= 0 else pj
            else:
                grown = pj * exp(log_lr - log_w[j]) if log_lr > log_w[j] else pj
            other = others[j]
            total += chance * (grown if grown > other else other) / (1 - pj + grown)
            covered += chance
        fresh = now.residual * ratio * eta  # a vote for an answer not seen yet: its weight
        total += max(0.0, 1 - covered) * max(best, fresh) / (1 + fresh)
        # eta is a per-answer likelihood, so with many candidates the chances of naming each
        # can sum past 1; the outcomes must form a distribution for this to be an expectation
        expected += outlook.q * share * total / max(1.0, covered)
    return max(0.0, expected - best)


def _vote_terms(ratio: float, eta: float) -> tuple[float, float]:
    """A vote of likelihood ratio ``ratio``: its reliability ρ = rη / (1 + rη), and ln r."""
    return ratio * eta / (1 + ratio * eta), math.log(ratio)


def _top_two(probs: Sequence[float]) -> tuple[int, float, float]:
    """The leading candidate (ties: the earliest), its probability, and the runner-up's."""
    first, best, runner_up = -1, 0.0, 0.0
    for j, pj in enumerate(probs):
        if first < 0 or pj > best:
            if first >= 0:
                runner_up = best
            first, best = j, pj
        elif pj > runner_up:
            runner_up = pj
    return first, best, runner_up


class Decision(NamedTuple):
    """One controller decision: the chosen action (None = stop) and why."""

    action: str | None
    score: float  # expected gain per cost of the best available action (0 when none is left)
    stop_reason: str | None


def choose_action(gain_per_cost: Mapping[str, float], available: Sequence[str], lam: float) -> Decision:
    """Pick the available action with the highest expected gain per cost; stop at or below lam.

    Ties go to the earlier action in ``available`` so the choice is deterministic. An action
    with no expected gain is never chosen, whatever lam.
    """
    best, score = None, -math.inf
    for action in available:
        if gain_per_cost[action] > score:
            best, score = action, gain_per_cost[action]
    if best is None:
        return Decision(None, 0.0, "no action left")
    if score <= 0:
        return Decision(None, 0.0, "no action left has any expected gain")
    if score <= lam:
        return Decision(None, score, f"expected gain {score:.4g} <= lambda {lam:g}")
    return Decision(best, score, None)


# ------------------------------------------------------------------------------------------
# Prompts and follow-up queries
# ------------------------------------------------------------------------------------------


# Worked examples go in as earlier chat turns, which is how chat models learn a format; a
# completion-only backend flattens the same turns into one few-shot prompt (llms/worker.py, plain_prompt).
_READ_INSTRUCTIONS = (
    "Answer the question from the passages with a short answer (a name, date, number or short "
    "phrase), or NONE if the passages do not contain it. Then write a follow-up search query "
    "for the missing fact."
)


# (passages, question, reply) per worked example.
_READ_EXAMPLES: tuple[tuple[str, str, str], ...] = (
    (
        "[1] Lebensraum\nLebensraum is a concept coined by Friedrich Ratzel. "
        "It was adopted by the Nazi Party.",
        "Which political party adopted the concept coined by Friedrich Ratzel?",
        "Answer: Nazi Party\nFollow-up query: Nazi Party Lebensraum",
    ),
    (
        "[1] Blue Tower\nThe Blue Tower was designed by Ana Ruiz.",
        "In which city was the architect of the Blue Tower born?",
        "Answer: NONE\nFollow-up query: Ana Ruiz architect birthplace",
    ),
    (
        "[1] Lake Orla\nLake Orla lies in Finland. Its area is 12 square kilometres.",
        "In which country is Lake Orla?",
        "Answer: Finland\nFollow-up query: Lake Orla Finland",
    ),
)


# A reply ends at a blank line or where the model starts writing another worked example.
READ_STOP = ["\n\n", "\nPassages:", "\nQuestion:"]


CLOSED_BOOK_INSTRUCTIONS = "Answer the question with a short answer (a name, date, number or short phrase)."


_CLOSED_BOOK_EXAMPLES: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "Answer: Paris"),
    ("Who wrote Hamlet?", "Answer: William Shakespeare"),
    ("In which year did World War II end?", "Answer: 1945"),
)


def _read_turn(body: str, question: str) -> str:
    return f"Passages:\n{body}\nQuestion: {question}"


def _chat(instructions: str, examples: Iterable[tuple[str, str]], final: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": instructions}]
    for asked, replied in examples:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": replied}]
    return [*messages, {"role": "user", "content": final}]


def answer_language(question: str, what: str = "the answer", passages: Sequence[Passage] = ()) -> str:
    """The prompt's line on the answer's language: none for English, else the question's.

    The worked examples are English, which a small model would copy. A language its script
    tells is named; one told by stop words is not, as a short question can mislead them
    ("Quelle commande" has more Italian stop words than French), and a wrong name is worse
    than none. A question that looks English over passages that are not ("Was macht der
    Befehl ls?" has one German stop word) gets the line too: it is right either way. The
    labels stay English, as the parser reads them.
    """
    language = language_of(question)
    if language == "en" and Analyzer.of([p.shown() for p in passages]) == Analyzer("en", by_script=False):
        return ""  # English over English passages (or none): the prompt English always had
    named = language in _SCRIPT_NAMED
    said = (
        f"{LANGUAGE_NAMES[language]}, the language of the question"
        if named
        else "the language of the question"
    )
    return f" Write {what} in {said}."


def read_messages(question: str, passages: Sequence[Passage]) -> list[dict[str, str]]:
    """The R1/R2 prompt: worked examples, then the passages (each cut short) and the question."""
    body = "\n".join(f"[{i}] {p.shown()}" for i, p in enumerate(passages, 1)) or "(no passages found)"
    examples = [(_read_turn(b, q), reply) for b, q, reply in _READ_EXAMPLES]
    return _chat(
        _READ_INSTRUCTIONS + answer_language(question, "the answer and the query", passages),
        examples,
        _read_turn(body, question),
    )


def closed_book_messages(question: str) -> list[dict[str, str]]:
    """The CB prompt: worked examples, then the question alone."""
    examples = [(f"Question: {q}", reply) for q, reply in _CLOSED_BOOK_EXAMPLES]
    return _chat(CLOSED_BOOK_INSTRUCTIONS + answer_language(question), examples, f"Question: {question}")


_CAPITALISED = re.compile(r"\b[A-Z][\w'’.-]*(?:\s+(?:of|the|de|von|van|[A-Z][\w'’.-]*))*")


def is_degenerate_query(query: str, question: str, analyzer: Analyzer | None = None) -> bool:
    """Empty, a copy of the question, or nothing the question does not already say.

    ``analyzer``: the corpus's, which the query will be searched with.
    """
    new = set(tokenize(query, analyzer)) - set(tokenize(question, analyzer))
    return not new


def expand_query(
    question: str, passages: Sequence[Passage], max_terms: int = 4, analyzer: Analyzer | None = None
) -> str:
    """Build a follow-up query without the LLM.

    The question plus salient titles and entities of the passages read that the question does
    not name: the likely bridge to the second hop. ``analyzer``: the corpus's.
    """
    named = set(tokenize(question, analyzer))
    extra: list[str] = []
    seen: set[str] = set()

    def add(phrase: str) -> None:
        tokens = tokenize(phrase, analyzer)
        key = " ".join(tokens)
        if tokens and key not in seen and not set(tokens) <= named:
            seen.add(key)
            extra.append(phrase.strip())

    for p in passages:
        if p.title:
            add(p.title)
    for p in passages[:2]:
        for span in _CAPITALISED.findall(p.shown_body()):
            add(span.rstrip(".'’"))
    return " ".join([question, *extra[:max_terms]])


# ------------------------------------------------------------------------------------------
# Actions: each LLM call the controller can choose, in one table
# ------------------------------------------------------------------------------------------


class VoteType(NamedTuple):
    """Whose reliability weighs a vote: its action, its branch and its evidence level.

    ``branch`` is the window or context the vote came from (``weak``: a window the gate called
    weak; a hop's ``same`` or ``new`` answer; a samples action's agreement ``3``), ``level`` its
    evidence level (``hi``, ``lo``); "" for none. Its text, ``R1``, ``R1_weak``, ``R2_new:hi``,
    ``CB_3``, is what reports, calibration files and the response cache have always used.
    """

    action: str
    branch: str = ""
    level: str = ""

    def __str__(self) -> str:
        text = f"{self.action}_{self.branch}" if self.branch else self.action
        return f"{text}:{self.level}" if self.level else text


def _evidence_types(base: VoteType, split: EvidenceSplit | None) -> dict[VoteType, tuple[float, float]]:
    """Each evidence level's vote type and Beta, for a read whose votes are split by evidence."""
    return {base._replace(level=lv.name): (lv.a, lv.b) for lv in split.levels} if split is not None else {}


def _typed(
    base: VoteType, flat: VoteType, split: EvidenceSplit | None, evidence: Mapping[str, Any]
) -> VoteType:
    """A read's vote type: ``base`` at its evidence level when its votes are split, else ``flat``."""
    level = split.level(evidence) if split is not None else None
    return base._replace(level=level.name) if level is not None else flat


@dataclass(frozen=True)
class Observation:
    """What one step of an action saw: the typed result of :meth:`VoteKind.step`.

    ``passages``: what its prompt held, in prompt order (None: it reads no passage); ``answer``
    ('' for none); ``evidence``: its evidence features; ``vote_type`` and ``candidate``: the
    vote it cast (None: no vote); ``reliability``: a vote's own reliability when its kind weighs
    each vote by itself (None: its vote type's); ``follow_up``: the query its reply asks for
    next (None: it asks none), which finds the next hop's passages when its kind ``sets_next_hop``;
    ``details``: what else its kind records (raw reply, samples, agreement…), as reports show it.
    """

    answer: str
    vote_type: str
    candidate: int | None
    passages: tuple[SeenPassage, ...] | None = None
    evidence: Mapping[str, float | None] | None = None
    reliability: float | None = None
    follow_up: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON for it: the shape reports have always had."""
        out: dict[str, Any] = {"answer": self.answer}
        if self.evidence is not None:
            out["evidence"] = dict(self.evidence)
        if self.follow_up is not None:
            out["follow_up_query"] = self.follow_up
        if self.passages is not None:
            out["passages"] = [p.to_dict() for p in self.passages]
            out["scores"] = [None if p.score is None else round(p.score, 4) for p in self.passages]
        out["vote_type"], out["candidate"] = self.vote_type, self.candidate
        if self.reliability is not None:
            out["reliability"] = round(self.reliability, 6)
        return {**out, **self.details}


class VoteFacts(NamedTuple):
    """What a vote's type is read from: its evidence, and the run around it.

    ``weak``: the gate called its window weak; ``repeats``: it repeats an earlier read's answer;
    ``agreement``: how many of a sampled call's answers gave it; ``second_hop``: how a hop is
    read (``BRAG.second_hop``).
    """

    evidence: Mapping[str, Any] = MappingProxyType({})
    weak: bool = False
    repeats: bool = False
    agreement: int = 0
    second_hop: str = "conditional"


class PolicyState(NamedTuple):
    """One state the policy prices an action in (:meth:`VoteKind.view`).

    ``weak``: the gate called the action's window weak; ``answered``: some read answered already
    (a hop may repeat it); ``second_hop``: how a hop is read.
    """

    weak: bool = False
    answered: bool = False
    second_hop: str = "conditional"


class NextHop(NamedTuple):
    """The latest follow-up retrieval: what it found, the passages not read yet, the novel ones.

    ``novel``: those of ``fresh`` that repeat none of the passages read (a hop adds only these).
    """

    found: Retrieval
    fresh: tuple[int, ...]
    novel: tuple[int, ...]


class WindowContext(Protocol):
    """What a kind's :meth:`VoteKind.window` may use of the run: its retrievals and a window builder.

    The runner calls it once for each window (the question's own at the start; a hop's each
    time a read's follow-up query retrieves), and everything after reads the window it built.
    """

    question: str
    brag: BRAG  # the controller's settings (k, m, hops...)
    first_hop: Retrieval  # the question's own retrieval
    next_hop: NextHop | None  # the latest follow-up retrieval (None until a read asked for one)
    read_ids: tuple[int, ...]  # passages read so far, in the order first read

    def retrieve(self, query: str, k: int) -> Retrieval:
        """The top ``k`` passages for ``query`` (a pool to rerank, say)."""
        ...

    def passages(self, ids: Sequence[int]) -> list[Passage]:
        """The passages of ``ids``, in that order (what a rerank reads)."""
        ...

    def window(
        self, ids: Sequence[int], found: Retrieval | None = None, removed: Sequence[int] | None = None
    ) -> Window:
        """A window of ``ids`` in that order, each scored by id, from ``found`` (default: the question's).

        ``removed``: what dedup dropped from it (default: ``found``'s).
        """
        ...


class StepContext(Protocol):
    """What a kind's :meth:`VoteKind.step` may use of the run: the question, the settings and calls."""

    question: str
    brag: BRAG  # the controller's settings (k, m, temperature, seed, max_tokens, priors...)

    def ask(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """One LLM call, its reply bounded and its cost counted."""
        ...

    def read(self, action: Action, window: Window) -> Reading:
        """One deterministic read of ``window``, in its order (no vote yet)."""
        ...

    def passages(self, window: Window) -> list[Passage]:
        """The window's passages, in its order, as a prompt holds them."""
        ...

    def vote(
        self, source: VoteType, answer: str, reliability: float | None = None, in_passage: bool = False
    ) -> int | None:
        """Add an answer to the posterior as a vote of type ``source`` (of its own ``reliability``).

        ``in_passage``: a passage it read holds the answer word for word (its candidate is shown so).
        """
        ...

    def repeats(self, answer: str, rests_on: Sequence[int] | None = None) -> bool:
        """Whether ``answer`` is one an earlier read voted for, holding a passage of ``rests_on``.

        ``rests_on``: the passages this read's answer rests on (:func:`resting_passages`); None:
        any earlier read's vote for it counts (a hop is typed against every answer before it).
        """
        ...


@dataclass(frozen=True)
class Reading:
    """One read's reply, parsed: what :meth:`StepContext.read` returns before any vote."""

    raw: str
    answer: str
    evidence: dict[str, float | None]
    follow_up: str
    follow_up_fallback: bool
    passages: tuple[SeenPassage, ...]

    def observed(
        self, vote_type: VoteType, candidate: int | None, reliability: float | None = None, **details: Any
    ) -> Observation:
        """The read as an observation of a vote of ``vote_type`` (of its own ``reliability``, if any)."""
        return Observation(
            self.answer,
            str(vote_type),
            candidate,
            self.passages,
            self.evidence,
            reliability if candidate is not None else None,
            follow_up=self.follow_up,
            details={"raw": self.raw, "follow_up_fallback": self.follow_up_fallback, **details},
        )


class VoteKind:
    """What an action's answers mean to BRAG; one object per kind: Read, Hop, Samples, SampledRead.

    Its calibration entry (``entry``, ``entry_dict``) and the prior it has without one
    (``prior``); the vote types its answers get and their Betas (``vote_types``, ``vote_type``,
    ``reliability``); its information rates and one-vote outlook for the policy (``rates``,
    ``view``, and its ``outcomes`` given its window); how often it may run (``uses``); what its prompt holds
    (``window``) and its run step (``step``); its cells in the app's steps table and its cases in
    the calibration table (``cells``, ``cases``). An :class:`Action` is a row: a label, a kind, a
    prompt, and the sizes and priors the estimates start from.
    """

    name: ClassVar[str] = ""
    # What it declares: the runner, the gate, calibration and the page act on these traits,
    # never on its class.
    reads_passages: ClassVar[bool] = True  # its prompt holds passages (its vote shares them)
    gated: ClassVar[bool] = True  # the gate judges the window its reads hold
    needs_new: ClassVar[bool] = False  # available only once a read found passages not read yet
    sets_next_hop: ClassVar[bool] = True  # its follow-up query finds the next hop's passages
    fit_shape: ClassVar[str] = "read"  # its calibration entry's shape: "read", "hop" or "samples"
    sampled: ClassVar[bool] = False  # one call draws m answers at the temperature
    # A self-test observes it on its questions; a kind whose reads its one-passage questions do
    # not exercise keeps the entry of the fit the self-test refines.
    self_tested: ClassVar[bool] = True

    def entry(self, label: str, raw: Mapping[str, Any]) -> ActionPrior:
        """Its calibration entry, validated (CalibrationError names the field)."""
        return _read_action(label, raw)

    def entry_dict(self, prior: ActionPrior) -> dict[str, Any]:
        """Its calibration entry as JSON-ready data (inverse of :meth:`entry`)."""
        entry: dict[str, Any] = {"q": prior.q, "rho": {"a": prior.a, "b": prior.b}}
        if prior.weak is not None:
            entry["weak"] = {"q": prior.weak.q, "rho": {"a": prior.weak.a, "b": prior.weak.b}}
        if prior.evidence is not None:
            entry["evidence"] = _evidence_to_dict(prior.evidence)
        if prior.curve is not None:
            entry["curve"] = curve_to_dict(prior.curve)
        if prior.same is not None:
            entry["same"] = {"pi": prior.same.pi, "rho": {"a": prior.same.a, "b": prior.same.b}}
        return entry

    def prior(self, action: Action, m: int) -> ActionPrior:
        """The hand-set prior of an action no calibration has fitted: its row's q and rho."""
        return ActionPrior(action.prior_q, *_prior_beta(action.prior_rho or 0.5))

    def vote_types(self, label: str, prior: ActionPrior, m: int) -> dict[VoteType, tuple[float, float]]:
        """Beta(a, b) of each vote type its answers may get (with m samples a call)."""
        strong, weak = prior, prior.on_weak_window()
        types = {VoteType(label): (strong.a, strong.b), VoteType(label, "weak"): (weak.a, weak.b)}
        if prior.same is not None:
            types[VoteType(label, "same")] = (prior.same.a, prior.same.b)
        return {**types, **_evidence_types(VoteType(label), prior.evidence)}

    def vote_type(self, label: str, prior: ActionPrior, seen: VoteFacts) -> VoteType:
        """The type of the vote its answer casts: its window's, at its evidence level when split.

        ``same`` when it repeats an earlier read's answer and its calibration fitted how much
        such a repeat says (reads that share a passage are not independent witnesses).
        """
        if seen.repeats and prior.same is not None:
            return VoteType(label, "same")
        flat = VoteType(label, "weak") if seen.weak else VoteType(label)
        return _typed(VoteType(label), flat, prior.evidence, seen.evidence)

    def reliability(
        self, prior: ActionPrior, vote_type: VoteType, evidence: Mapping[str, Any]
    ) -> float | None:
        """A vote's own reliability: its evidence curve's, unless it repeats a read (None: its type's)."""
        if prior.curve is None or vote_type.branch == "same":
            return None
        return round(prior.curve.reliability(evidence), 6)

    def rates(self, label: str, prior: ActionPrior, eta: float, rule: str) -> dict[str, float]:
        """Its information rate D in each state it is read in: on a strong window, and a weak one."""
        return {
            label: information_rate(prior, eta, rule),
            f"{label}_weak": information_rate(prior.on_weak_window(), eta, rule),
        }

    def view(
        self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float], state: PolicyState
    ) -> tuple[float, VoteOutlook]:
        """Its rate and its next vote's outlook in a policy state: its window weak or not, an answer before.

        With an evidence curve, the outlook is the spread of its vote's rho over the fitted votes
        (:meth:`outcomes` prices it with its window's own signals); a repeat of an earlier read's
        answer has its fitted ratio when the calibration has one.
        """
        flat = f"{label}_weak" if state.weak else label
        seen = prior.on_weak_window() if state.weak else prior
        if prior.curve is not None:
            outcomes = prior.curve.outcomes(None, eta)
        else:
            outcomes = _outcomes(prior.evidence, _ratio_of(seen, eta), eta)
        same = _ratio_of(prior.same, eta) if prior.same is not None else None
        return rates[flat], VoteOutlook(seen.q, outcomes, same)

    def outcomes(self, prior: ActionPrior, window: Window, eta: float) -> Outcomes | None:
        """Its next vote's (share, likelihood ratio) outcomes given its window; None: its state's table's.

        With an evidence curve, the curve's spread at the window's before-call signals (the
        runner works them out once for each window it builds).
        """
        return prior.curve.outcomes(window.signals, eta) if prior.curve is not None else None

    def uses(self, brag: BRAG) -> int:
        """How often a run may take it: ``max_uses`` times (the runner's availability check)."""
        return brag.max_uses

    def window(self, run: WindowContext, action: Action) -> Window:
        """What its prompt holds, in prompt order: the question's own passages from its row's rank on.

        A row's ``first`` skips the passages a read before it holds (the next-ranked read), so its
        vote rests on a passage the focused read never saw.
        """
        ranked = [i for i, _ in run.first_hop.hits][action.first :]
        return run.window(ranked[: action.passages or None])

    def step(self, run: StepContext, action: Action, window: Window) -> Observation:
        """Read its window, which is all its prompt holds, in that order; one vote."""
        label, prior = action.label, run.brag.priors[action.label]
        reading = run.read(action, window)
        repeats = run.repeats(reading.answer, resting_passages(window, reading.evidence))
        seen = VoteFacts(reading.evidence, weak=window.weak, repeats=repeats)
        vote_type = self.vote_type(label, prior, seen)
        own = self.reliability(prior, vote_type, reading.evidence)
        candidate = run.vote(vote_type, reading.answer, own, bool(reading.evidence.get("span")))
        return reading.observed(vote_type, candidate, own, dedup_removed=list(window.removed))

    def cells(self, label: str, seen: Mapping[str, Any]) -> tuple[str, str, str]:
        """Its cells in the steps table: what it read, its answer, and what its vote rested on."""
        evidence = ""
        if seen.get("candidate") is not None:
            parts = [evidence_text(seen.get("evidence") or {})]
            if seen.get("reliability") is not None:
                parts.append(f"reliability {seen['reliability']:.2f}")
            elif seen.get("vote_type"):
                parts.append(f"level {seen['vote_type']}")
            evidence = " · ".join(p for p in parts if p)
        return "; ".join(passage_labels(seen.get("passages", []))), seen.get("answer") or "NONE", evidence

    def cases(self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float]) -> list[Case]:
        """What its calibration tells apart, for a table of it: on any window, or strong and weak."""
        cases = [Case("any window" if prior.weak is None else "strong window", prior.q, prior, rates[label])]
        if prior.weak is not None:
            weak = prior.on_weak_window()
            cases.append(Case("weak window", weak.q, weak, rates[f"{label}_weak"]))
        return cases


class Read(VoteKind):
    """Reads a window of the question's own top passages; one vote, typed by its window and evidence."""

    name = "read"


class Hop(VoteKind):
    """Reads the passages read so far and the new ones the latest follow-up query found.

    Its vote is typed against the answers before it: ``same`` when it repeats an earlier read's
    answer (which says little: it reread the same passages), ``new`` otherwise.
    """

    name = "hop"
    needs_new = True
    fit_shape = "hop"
    self_tested = False  # a self-test's question is written from one passage: no second hop to find

    def entry(self, label: str, raw: Mapping[str, Any]) -> ActionPrior:
        """q, rho, the weak-window entry, and the ``same``/``new`` branches when present."""
        return _read_action(label, raw, hop=True)

    def entry_dict(self, prior: ActionPrior) -> dict[str, Any]:
        """The read's entry and its two branches."""
        entry = super().entry_dict(prior)
        if prior.same is not None and prior.new is not None:
            entry = {k: v for k, v in entry.items() if k != "evidence"}
            entry["same"] = {"pi": prior.same.pi, "rho": {"a": prior.same.a, "b": prior.same.b}}
            entry["new"] = {"rho": {"a": prior.new.a, "b": prior.new.b}}
            if prior.evidence is not None:
                entry["evidence"] = _evidence_to_dict(prior.evidence)
        return entry

    @staticmethod
    def branches(prior: ActionPrior) -> tuple[Branch, Branch]:
        """Its (same, new) outcomes; without them, both are its own reliability."""
        fallback = Branch(0.5, prior.a, prior.b)
        return prior.same or fallback, prior.new or fallback

    def vote_types(self, label: str, prior: ActionPrior, m: int) -> dict[VoteType, tuple[float, float]]:
        """As a read's, and ``_same``/``_new`` with the new answer's evidence levels."""
        types = super().vote_types(label, prior, m)
        levels = {t: v for t, v in types.items() if t.level}
        types = {t: v for t, v in types.items() if not t.level}
        same, new = self.branches(prior)
        types[VoteType(label, "same")], types[VoteType(label, "new")] = (same.a, same.b), (new.a, new.b)
        return {**types, **levels, **_evidence_types(VoteType(label, "new"), prior.evidence)}

    def vote_type(self, label: str, prior: ActionPrior, seen: VoteFacts) -> VoteType:
        """``same`` when it repeats an earlier read's answer, else ``new`` at its evidence level.

        Not ``conditional`` (SPEC's independent second hop): typed as a read of its window.
        """
        if seen.second_hop != "conditional":
            return super().vote_type(label, prior, VoteFacts(seen.evidence, weak=seen.weak))
        fresh = VoteType(label, "new")
        return (
            VoteType(label, "same") if seen.repeats else _typed(fresh, fresh, prior.evidence, seen.evidence)
        )

    def rates(self, label: str, prior: ActionPrior, eta: float, rule: str) -> dict[str, float]:
        """A read's; and read against what came before: after an answer, or none."""
        same, new = self.branches(prior)
        d_same = vote_information(same.mean, eta, rule)
        if prior.spread is None:
            d_new = vote_information(new.mean, eta, rule)
        else:  # a new answer's vote lands in one of the evidence levels
            d_new = sum(level.pi * vote_information(level.mean, eta, rule) for level in prior.spread.levels)
        return {
            **super().rates(label, prior, eta, rule),
            f"{label}_after_answer": prior.q * (same.pi * d_same + (1 - same.pi) * d_new),
            f"{label}_after_none": prior.q * d_new,
        }

    def view(
        self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float], state: PolicyState
    ) -> tuple[float, VoteOutlook]:
        """Read against the answers before it (``conditional``), or as a read of its window."""
        if state.second_hop != "conditional":
            return super().view(label, prior, eta, rates, state)
        same, new = self.branches(prior)
        rate = rates[f"{label}_after_answer" if state.answered else f"{label}_after_none"]
        if prior.curve is not None:
            outcomes = prior.curve.outcomes(None, eta)
        else:
            outcomes = _outcomes(prior.evidence, _ratio_of(new, eta), eta)
        return rate, VoteOutlook(prior.q, outcomes, _ratio_of(same, eta))

    def outcomes(self, prior: ActionPrior, window: Window, eta: float) -> Outcomes | None:
        """None: as its state's table has them, whatever its window's signals.

        Its window leads with the passages read before, whose signals the earlier reads' votes
        carry already; what it adds is its new passages.
        """
        return None

    def uses(self, brag: BRAG) -> int:
        """Up to ``hops`` times, and only once a read found passages not read yet (``needs_new``)."""
        return brag.hops

    def window(self, run: WindowContext, action: Action) -> Window:
        """The passages read so far and the new ones: judged once a read found them.

        Old passages first, in the order read, so each hop's prompt extends the last one.
        """
        hop = run.next_hop
        assert hop is not None  # the runner builds a hop's window once a read retrieved its next hop
        removed = [*hop.found.removed, *(i for i in hop.fresh if i not in hop.novel)]
        return run.window([*run.read_ids, *hop.novel[: run.brag.k]], hop.found, removed)

    def step(self, run: StepContext, action: Action, window: Window) -> Observation:
        """Read the passages read so far plus the new ones the latest follow-up query found."""
        label, prior = action.label, run.brag.priors[action.label]
        reading = run.read(action, window)
        repeats, second_hop = run.repeats(reading.answer), run.brag.second_hop
        vote_type = self.vote_type(
            label, prior, VoteFacts(reading.evidence, window.weak, repeats, 0, second_hop)
        )
        own = self.reliability(prior, vote_type, reading.evidence)
        return reading.observed(
            vote_type,
            run.vote(vote_type, reading.answer, own, bool(reading.evidence.get("span"))),
            own,
            query=window.query,
            new_passages=list(window.new),
            dedup_removed=list(window.removed),
        )

    def cells(self, label: str, seen: Mapping[str, Any]) -> tuple[str, str, str]:
        """As a read's, but what it read is what it added: the new passages."""
        _, answer, evidence = super().cells(label, seen)
        passages = seen.get("passages", [])
        new = passages[len(passages) - len(seen.get("new_passages") or []) :]
        return "; ".join(passage_labels(new)), answer, evidence

    def cases(self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float]) -> list[Case]:
        """As a read's, and its two branches: it repeats an earlier answer, or names a new one."""
        cases = super().cases(label, prior, eta, rates)
        same, new = self.branches(prior)
        for case, branch in (("repeats an earlier answer", same), ("new answer", new)):
            cases.append(Case(case, prior.q, branch, vote_information(branch.mean, eta), branch.pi))
        return cases


def passage_labels(passages: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a read looked at, as a report lists it: each passage's label, title, or id."""
    return [p.get("label") or p.get("title") or f"passage {p['id']}" for p in passages]


class Case(NamedTuple):
    """One case a calibration fits for an action: its share of votes (if a split), q, Beta and rate D."""

    name: str
    q: float
    beta: _BetaMean
    rate: float
    share: float | None = None


class Samples(VoteKind):
    """Draws m closed-book answers; their mode is one vote, typed by how many of the m agree."""

    name = "samples"
    reads_passages = False
    gated = False
    sets_next_hop = False
    fit_shape = "samples"
    sampled = True

    def entry(self, label: str, raw: Mapping[str, Any]) -> ActionPrior:
        """The q and one {pi, kappa} per agreement level g = 1..m."""
        return _closed_book_from_dict(raw, label)

    def entry_dict(self, prior: ActionPrior) -> dict[str, Any]:
        """The q and its levels."""
        levels = {str(lv.g): {"pi": lv.pi, "kappa": {"a": lv.a, "b": lv.b}} for lv in prior.levels}
        return {"q": prior.q, "levels": levels}

    def prior(self, action: Action, m: int) -> ActionPrior:
        """Its row's q; each level equally likely, more agreement more reliable (0.1 + 0.6 g / m)."""
        levels = tuple(Level(g, 1 / m, *_prior_beta(prior_kappa(g, m))) for g in range(1, m + 1))
        return ActionPrior(action.prior_q, 1.0, 1.0, levels)

    @staticmethod
    def level(prior: ActionPrior, g: int, m: int) -> Level:
        """The level matching g of m samples (rescaled when its levels count other than m)."""
        fitted_m = prior.levels[-1].g
        g_fitted = min(max(round(g * fitted_m / m), 1), fitted_m)
        return next(level for level in prior.levels if level.g == g_fitted)

    def vote_types(self, label: str, prior: ActionPrior, m: int) -> dict[VoteType, tuple[float, float]]:
        """One per agreement level g = 1..m."""
        types = {}
        for g in range(1, m + 1):
            level = self.level(prior, g, m)
            types[VoteType(label, str(g))] = (level.a, level.b)
        return types

    def vote_type(self, label: str, prior: ActionPrior, seen: VoteFacts) -> VoteType:
        """Typed by how many of its samples agree with their mode."""
        return VoteType(label, str(seen.agreement))

    def rates(self, label: str, prior: ActionPrior, eta: float, rule: str) -> dict[str, float]:
        """Its one: no window, no answer before it changes what it is."""
        return {label: information_rate(prior, eta, rule)}

    def view(
        self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float], state: PolicyState
    ) -> tuple[float, VoteOutlook]:
        """Its rate, and an outlook with one kind of vote per agreement level."""
        levels = tuple((lv.pi, _likelihood_ratio(lv.mean, eta, "spec")) for lv in prior.levels)
        return rates[label], VoteOutlook(prior.q, levels)

    def window(self, run: WindowContext, action: Action) -> Window:
        """None: it reads no passage."""
        return run.window([])

    def step(self, run: StepContext, action: Action, window: Window) -> Observation:
        """Sample ``m`` closed-book answers; their mode is one vote, typed by how many agree."""
        reply = run.ask(
            action.messages(run.question, []),
            n=run.brag.m,
            temperature=run.brag.temperature,
            max_tokens=16,
            stop=["\n"],
        )
        mode, g = closed_book_mode(reply.texts)
        vote_type = self.vote_type(action.label, run.brag.priors[action.label], VoteFacts(agreement=g))
        candidate = run.vote(vote_type, mode) if g else None
        details = {"samples": list(reply.texts), "agreement": g}
        return Observation(mode, str(vote_type), candidate, details=details)

    def cells(self, label: str, seen: Mapping[str, Any]) -> tuple[str, str, str]:
        """How many samples, the mode and how many agree, and its level."""
        n = len(seen.get("samples") or [])
        answer = seen.get("answer") or "NONE"
        answer += f" ({seen.get('agreement')}/{n} agree)" if seen.get("answer") else ""
        evidence = f"level {label}_{seen.get('agreement')}" if seen.get("candidate") is not None else ""
        return f"{n} closed-book samples", answer, evidence

    def cases(self, label: str, prior: ActionPrior, eta: float, rates: Mapping[str, float]) -> list[Case]:
        """One per agreement level."""
        m = prior.levels[-1].g
        return [
            Case(f"{lv.g} of {m} agree", prior.q, lv, vote_information(lv.mean, eta), lv.pi)
            for lv in prior.levels
        ]


class SampledRead(Read):
    """Reads the top passage m times at the sampling temperature, in one call; the mode is one vote.

    How many of the m samples give the mode is its ``agreement`` evidence feature, so a fitted
    evidence curve weighs its vote by it with the rest of its evidence; without a curve its vote
    is typed by agreement (``RS_3``), each level at the hand-set closed-book reliability. Its
    samples share the prompt, which a local backend evaluates once.
    """

    name = "sampled read"
    sets_next_hop = False  # its samples stop at the answer line: no follow-up query
    sampled = True
    # m samples a question would double a self-test's reading time; a refit keeps its entry.
    self_tested = False

    def vote_types(self, label: str, prior: ActionPrior, m: int) -> dict[VoteType, tuple[float, float]]:
        """A read's, and one per agreement level g = 1..m for a vote no curve weighs."""
        levels = {VoteType(label, str(g)): _prior_beta(prior_kappa(g, m)) for g in range(1, m + 1)}
        return {**super().vote_types(label, prior, m), **levels}

    def step(self, run: StepContext, action: Action, window: Window) -> Observation:
        """Sample ``m`` reads of the top passage; their mode is one vote, weighed by its evidence."""
        label, prior = action.label, run.brag.priors[action.label]
        passages = run.passages(window)
        reply = run.ask(
            action.messages(run.question, passages),
            n=run.brag.m,
            temperature=run.brag.temperature,
            max_tokens=run.brag.max_tokens,
            stop=["\n", *READ_STOP],
        )
        mode, g = closed_book_mode(reply.texts)
        answers = [parse_reading(text)[0] for text in reply.texts]
        first = next((i for i, a in enumerate(answers) if a and same_answer(a, mode)), None)
        tokens = reply.logprobs[first] if reply.logprobs and first is not None else None
        evidence = read_evidence(mode, run.question, passages, tokens, window=window, samples=reply.texts)
        vote_type = self.vote_type(
            label,
            prior,
            VoteFacts(
                evidence, weak=window.weak, repeats=run.repeats(mode, resting_passages(window, evidence))
            ),
        )
        if prior.curve is None and vote_type.branch != "same":  # no curve weighs it: by its agreement
            vote_type = VoteType(label, str(g))
        own = self.reliability(prior, vote_type, evidence)
        candidate = run.vote(vote_type, mode, own, bool(evidence.get("span"))) if g else None
        details = {"samples": list(reply.texts), "agreement": g, "dedup_removed": list(window.removed)}
        return Observation(
            mode, str(vote_type), candidate, window.passages, evidence, own if g else None, details=details
        )

    def cells(self, label: str, seen: Mapping[str, Any]) -> tuple[str, str, str]:
        """A read's, with how many samples agree."""
        read, answer, evidence = super().cells(label, seen)
        n = len(seen.get("samples") or [])
        answer += f" ({seen.get('agreement')}/{n} agree)" if seen.get("answer") else ""
        return read, answer, evidence


def prior_kappa(g: int, m: int) -> float:
    """The hand-set prior reliability of a closed-book vote with g of m samples agreeing."""
    return 0.1 + 0.6 * g / m


def _ratio_of(prior: _BetaMean, eta: float) -> float:
    """A vote's likelihood ratio from its mean reliability (raw: Beliefs applies the floor)."""
    return _likelihood_ratio(prior.mean, eta, "spec")


def _outcomes(split: EvidenceSplit | None, flat_ratio: float, eta: float) -> tuple[tuple[float, float], ...]:
    """(share, ratio) of each level a read's vote may land in; one when its votes are flat."""
    if split is None:
        return ((1.0, flat_ratio),)
    return tuple((lv.pi, _ratio_of(lv, eta)) for lv in split.levels)


READ, HOP, SAMPLES, SAMPLED_READ = Read(), Hop(), Samples(), SampledRead()
VOTE_KINDS = (READ, HOP, SAMPLES, SAMPLED_READ)


@dataclass(frozen=True)
class Action:
    """One LLM call the controller can choose: a row of :data:`ACTION_TABLE`.

    Its ``kind`` (:class:`Read`, :class:`Hop`, :class:`Samples`) says what its answers mean and
    how it runs (:class:`VoteKind`); ``messages`` is its prompt, and ``passages`` how many of the
    window's top passages it holds (None: all k). The rest feed the cost estimates (``window``
    in units of k, ``answer_tokens``), the prior calibration shrinks toward, whether
    calibration observes it unless told which actions to fit (``fitted``), and the rank its
    window starts at among the question's passages (``first``: 1 for the next-ranked read).
    """

    label: str  # what reports, calibrations, costs and the API call it
    does: str  # what the page says while it runs
    kind: VoteKind
    messages: Callable[[str, Sequence[Passage]], list[dict[str, str]]]  # its prompt
    window: int  # passages in its prompt, in units of k (0: none), for cost estimates
    answer_tokens: float  # tokens it generates per answer, for cost estimates
    prior_q: float  # its prior: P(it answers at all)
    prior_rho: float | None = None  # and P(right | answered) for a read (samples: by agreement)
    passages: int | None = None  # the window's top passages its prompt holds (None: all k)
    fitted: bool = True  # observed and fitted by calibration unless its actions are named
    first: int = 0  # the rank (from 0) of the first of the question's passages its prompt holds

    def __post_init__(self) -> None:
        # A vote type's text joins the label and its branch with "_" and a level with ":".
        if not self.label.isalnum() or not isinstance(self.kind, VoteKind):
            raise InputError(f"action {self.label!r}: a letters-and-digits label and a VoteKind")
        if not isinstance(self.first, int) or self.first < 0:
            raise InputError(f"action {self.label!r}: first is a rank, an integer from 0")

    def estimated_cost(self, question: str, passage: Passage, k: int, m: int) -> ActionCost:
        """Its cost from its prompt's size (about 4 characters a token), without a calibration."""
        prompt = self.messages(question, [passage] * (self.passages or self.window * k))
        answers = self.answer_tokens * (m if self.kind.sampled else 1)
        return ActionCost(sum(len(x["content"]) for x in prompt) / 4, answers, 1.0, None)


ACTION_TABLE: tuple[Action, ...] = (
    Action("R1", "reading the top passages", READ, read_messages, 1, 12.0, 0.8, 0.6),
    # Old and new passages: each hop's prompt extends the last one.
    Action("R2", "second retrieval hop", HOP, read_messages, 2, 12.0, 0.7, 0.6),
    Action("CB", "closed-book samples", SAMPLES, lambda q, _: closed_book_messages(q), 0, 4.0, 0.95),
    # The focused read: the top passage alone, at about a fifth of a read's prompt. Offered by a
    # calibration that fits it (calibrate.py --actions), or turned on with BRAG(extra_actions=...).
    Action(
        "RT",
        "reading the top passage alone",
        READ,
        read_messages,
        1,
        12.0,
        0.8,
        0.6,
        passages=1,
        fitted=False,
    ),
    # The focused read sampled m times in one call: how many samples agree is evidence. Offered
    # by a calibration that fits it, or with BRAG(extra_actions=...).
    Action(
        "RS",
        "reading the top passage several times",
        SAMPLED_READ,
        read_messages,
        1,
        6.0,
        0.8,
        0.6,
        passages=1,
        fitted=False,
    ),
    # The next-ranked passage alone: a second look at what the focused read did not see, so a
    # wrong first read can be outvoted by a witness that shares no passage with it. Offered by
    # a calibration that fits it, or with BRAG(extra_actions=...).
    Action(
        "RN",
        "reading the next passage alone",
        READ,
        read_messages,
        1,
        12.0,
        0.8,
        0.45,
        passages=1,
        fitted=False,
        first=1,
    ),
)


def check_actions(actions: Any) -> tuple[Action, ...]:
    """``actions`` as a table of rows: a sequence of :class:`Action`, at least one, no label twice."""
    rows = tuple(actions) if isinstance(actions, Sequence) and not isinstance(actions, str) else None
    if not rows or not all(isinstance(a, Action) for a in rows):
        raise InputError(f"actions must be a sequence of brag.Action rows, got {_shown(actions)}")
    labels = [a.label for a in rows]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise InputError(f"actions: {_listed(twice)} named twice; each row needs a label of its own")
    return rows


def action_labels(actions: Sequence[Action] = ACTION_TABLE) -> tuple[str, ...]:
    """The labels of a table's actions (default: the shipped :data:`ACTION_TABLE`), in its order."""
    return tuple(a.label for a in actions)


def action_named(label: str, actions: Sequence[Action] = ACTION_TABLE) -> Action:
    """The table's action with this label."""
    found = next((a for a in actions if a.label == label), None)
    if found is None:
        raise InputError(f"no action {label!r} in the table ({_listed(action_labels(actions))})")
    return found


def with_shipped(actions: Sequence[Action]) -> tuple[Action, ...]:
    """``actions`` and then the shipped rows whose labels they do not use, in that order.

    What a calibration is read with for a controller of these rows: a shipped file's entries
    still parse, and a row of the caller's own replaces the shipped one of its label.
    """
    labels = {a.label for a in actions}
    return (*actions, *(a for a in ACTION_TABLE if a.label not in labels))


# ------------------------------------------------------------------------------------------
# Calibration: the controller's hyperpriors, loaded, validated and matched to a model
# ------------------------------------------------------------------------------------------


# What a run says about whether the documents hold the answer, each in [0, 1] (FoundModel).
FOUND_SIGNALS = ("absent_terms", "read_none", "closed_book_only", "in_passage", "p_correct")


@dataclass(frozen=True)
class FoundModel:
    """Whether the documents hold a question's answer: a logistic model of the run's signals.

    Fitted on questions the documents answer and on questions they cannot (their key terms
    absent), so that at most a small share of right answers is flagged (``calibrate.fit_found``).
    ``p_found`` is the model's probability; below ``threshold`` the answer is "not in your
    documents". :func:`found_by_rule` holds with or without one.
    """

    intercept: float
    weights: Mapping[str, float]  # by FOUND_SIGNALS name, on the signals as they are
    threshold: float
    fitted_on: Mapping[str, Any] = field(default_factory=dict)  # what it was fitted on, as recorded

    def __post_init__(self) -> None:
        numbers = [self.intercept, self.threshold, *self.weights.values()]
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
            raise CalibrationError("calibration: found needs finite numbers")
        if not set(self.weights) <= set(FOUND_SIGNALS) or not 0.0 <= self.threshold <= 1.0:
            raise CalibrationError(
                f"calibration: found weighs {_listed(FOUND_SIGNALS)}, its threshold in [0, 1]"
            )

    def p_found(self, signals: Mapping[str, float]) -> float:
        """P(the documents hold the answer) from the run's ``signals``."""
        z = self.intercept + sum(w * float(signals.get(name, 0.0)) for name, w in self.weights.items())
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def found(self, signals: Mapping[str, float]) -> bool:
        """Whether the answer is taken to come from the documents."""
        return self.p_found(signals) >= self.threshold

    def to_dict(self) -> dict[str, Any]:
        """As a calibration's ``found`` section."""
        found = {"intercept": self.intercept, "weights": dict(self.weights), "threshold": self.threshold}
        return {**found, "fitted_on": dict(self.fitted_on)} if self.fitted_on else found


def found_by_rule(signals: Mapping[str, float]) -> bool:
    """Found only if a read of the documents gave the answer (with or without a fitted model)."""
    return not (signals.get("read_none") or signals.get("closed_book_only"))


def _found_from_dict(raw: Any) -> FoundModel | None:
    """A calibration's ``found`` section, when it has one."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("weights"), Mapping):
        raise CalibrationError("calibration: found must be an object with intercept, weights and threshold")
    unknown = [name for name in raw["weights"] if name not in FOUND_SIGNALS]
    if unknown:
        raise CalibrationError(
            f"calibration: found.weights.{_shown(unknown[0])} is not one of {_listed(FOUND_SIGNALS)}"
        )
    weights = {name: _number(w, f"found.weights.{name}", -1e3, 1e3) for name, w in raw["weights"].items()}
    intercept = _number(raw.get("intercept"), "found.intercept", -1e3, 1e3)
    threshold = _number(raw.get("threshold"), "found.threshold", 0.0, 1.0)
    fitted_on = raw.get("fitted_on")
    return FoundModel(
        intercept, weights, threshold, dict(fitted_on) if isinstance(fitted_on, Mapping) else {}
    )


@dataclass(frozen=True)
class Calibration:
    """Population-level hyperpriors: per-action (q, rho), CB levels (pi_g, kappa_g) and eta.

    ``costs``: what each action cost when calibration ran it (None for the hand-set prior and
    for calibrations fitted before costs were recorded).
    """

    eta: float
    actions: dict[str, ActionPrior]
    m: int
    meta: dict[str, Any] = field(default_factory=dict)
    gate: Gate | None = None
    gate_details: dict[str, Any] = field(default_factory=dict)  # AUCs, n, logistic fit
    costs: dict[str, ActionCost] | None = None
    found: FoundModel | None = None  # whether the documents hold an answer (None: found_by_rule alone)
    # The rows its entries were read with (load_calibration's ``actions``), in table order.
    table: tuple[Action, ...] = field(default=ACTION_TABLE, repr=False, compare=False)
    # A fit across readers: each reader's own terms by its name (``for_reader``).
    readers: dict[str, dict[str, ReaderTerms]] = field(default_factory=dict)

    @property
    def across_readers(self) -> bool:
        """Whether it was fitted on several readers' reads (``readers`` names them)."""
        return bool(self.meta.get(ACROSS_READERS))

    def for_reader(self, model: str) -> Calibration:
        """It as ``model`` reads with it: a fit across readers with that reader's terms, if any.

        A reader it has no terms for reads with it as it is, the readers' common fit; either way
        its meta says for whom (``model``) and whether the terms are that reader's own
        (``reader_terms``: "own" or "none"). A fit for one reader, or one already made for a
        reader, is returned as it is.
        """
        if not self.across_readers or READER_TERMS in self.meta:
            return self
        own = self.readers.get(model, {})
        actions = {label: own[label].prior(p) if label in own else p for label, p in self.actions.items()}
        meta = {**self.meta, "model": model, READER_TERMS: "own" if own else "none"}
        return replace(self, actions=actions, meta=meta, readers={})

    def offered(self) -> tuple[Action, ...]:
        """Its table's actions it has an entry for, in table order: the ones a controller offers."""
        return tuple(a for a in self.table if a.label in self.actions)

    def unweighed_features(self) -> tuple[str, ...]:
        """The evidence features BRAG computes (``EVIDENCE``) that none of its reads' fits looked at.

        A fit records the features there were when it was made (an older file: those it weighs);
        one added since is computed for every read but weighs nothing until a refit sees it.
        """
        looked: set[str] = set()
        for prior in self.actions.values():
            for fit in (prior.curve, prior.evidence):
                if fit is not None:
                    looked |= set(fit.features or (name for name, _ in fit.weights))
        return tuple(name for name in evidence_names() if name not in looked)

    def prior_of(self, action: Action) -> ActionPrior:
        """An action's entry, or its kind's hand-set prior when it has none (:meth:`VoteKind.prior`)."""
        found = self.actions.get(action.label)
        return found if found is not None else action.kind.prior(action, self.m)

    def source_priors(
        self, m: int, actions: Sequence[Action] | None = None
    ) -> dict[VoteType, tuple[float, float]]:
        """Beta(a, b) per vote type of ``actions`` (default: the ones it has), for m samples a call.

        ``R1``, ``R1_weak``, ``R1:hi``… for a read; a hop's as well as ``R2_same``, ``R2_new``
        and ``R2_new:hi``…; ``CB_1``… ``CB_m`` for samples (:meth:`VoteKind.vote_types`).
        """
        priors: dict[VoteType, tuple[float, float]] = {}
        for action in self.offered() if actions is None else actions:
            priors.update(action.kind.vote_types(action.label, self.prior_of(action), m))
        return priors

    def rates(self, rule: str = "floored", actions: Sequence[Action] | None = None) -> dict[str, float]:
        """Information rate D of each action (default: the ones it has) in each state it is read in.

        Each action on a strong window first (``R1``, ``R2``, ``CB``); then its other states:
        a read's weak window (``R1_weak``), and a hop's answers before it (``R2_after_answer``:
        an earlier read answered, so it may repeat it; ``R2_after_none``: none did).
        """
        chosen = self.offered() if actions is None else actions
        each = {a.label: a.kind.rates(a.label, self.prior_of(a), self.eta, rule) for a in chosen}
        rates = {label: found[label] for label, found in each.items()}  # every strong window first
        for found in each.values():
            rates.update(found)
        return rates

    def to_dict(self) -> dict[str, Any]:
        """The calibration as JSON-ready data (inverse of ``calibration_from_dict``)."""
        actions = {a.label: a.kind.entry_dict(self.actions[a.label]) for a in self.offered()}
        gate = None
        if self.gate is not None:
            gate = {"k": self.gate.k, "signals": [asdict(signal) for signal in self.gate.signals]}
            gate = {**self.gate_details, **gate}
        costs = {a: asdict(c) for a, c in self.costs.items()} if self.costs is not None else None
        return {
            **self.meta,
            "version": CALIBRATION_VERSION,
            "m": self.m,
            "eta": self.eta,
            "actions": actions,
            "gate": gate,
            **({"costs": costs} if costs is not None else {}),
            **({"found": self.found.to_dict()} if self.found is not None else {}),
            **({"readers": self._readers_dict()} if self.readers else {}),
        }

    def _readers_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            reader: {label: asdict(term) for label, term in terms.items()}
            for reader, terms in self.readers.items()
        }


def calibration_from_dict(data: Any, actions: Sequence[Action] = ACTION_TABLE) -> Calibration:
    """Validate a calibration object and build a :class:`Calibration`; ValueError names the field.

    ``actions``: the rows its entries belong to (each entry read by its row's kind).
    """
    table = check_actions(actions)
    if not isinstance(data, Mapping):
        raise CalibrationError(f"calibration: expected a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != CALIBRATION_VERSION:
        raise CalibrationError(
            f"calibration: unsupported version {_shown(version)} (expected {CALIBRATION_VERSION})"
        )
    # Below this η the likelihood ratios overflow; no fitted calibration comes near it.
    eta = _number(data.get("eta"), "eta", _MIN_ETA, 1.0)
    entries = _actions_from_dict(data.get("actions"), table)
    m = _samples_per_call(data, entries)
    gate, details = _gate_from_dict(data.get("gate"))
    costs = _costs_from_dict(data.get("costs"), list(entries))
    found = _found_from_dict(data.get("found"))
    readers = _reader_terms_from_dict(data.get("readers"), entries)
    own = ("version", "eta", "actions", "m", "gate", "costs", "found", "readers")
    meta = {k: v for k, v in data.items() if k not in own}
    return Calibration(eta, entries, m, meta, gate, details, costs, found, table, readers)


def _actions_from_dict(raw: Any, table: Sequence[Action]) -> dict[str, ActionPrior]:
    """Each action's entry, by its kind; any of the table's, at least one (table order kept)."""
    labels = action_labels(table)
    if not isinstance(raw, Mapping) or not raw:
        raise CalibrationError(f"calibration: 'actions' must be an object with some of {_listed(labels)}")
    unknown = [name for name in raw if name not in labels]
    if unknown:
        raise CalibrationError(
            f"calibration: actions.{_shown(unknown[0])} is not an action of this BRAG ({_listed(labels)}); "
            "a calibration of rows of your own is read with them: load_calibration(source, actions=rows)"
        )
    for name, entry in raw.items():
        if not isinstance(entry, Mapping):
            raise CalibrationError(f"calibration: actions.{name} must be an object")
    return {a.label: a.kind.entry(a.label, raw[a.label]) for a in table if a.label in raw}


def _samples_per_call(data: Mapping[str, Any], actions: Mapping[str, ActionPrior]) -> int:
    """m: the agreement levels of its samples actions (which must agree), else its ``m`` field."""
    counts = {label: prior.levels[-1].g for label, prior in actions.items() if prior.levels}
    if len(set(counts.values())) > 1:
        raise CalibrationError(f"calibration: its samples actions have different numbers of levels {counts}")
    if counts:
        label, m = next(iter(counts.items()))
        if "m" in data and data["m"] != m:
            raise CalibrationError(
                f"calibration: m = {_shown(data['m'])} but {label} has {m} agreement levels"
            )
        return m
    m = data.get("m", 5)
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= _MAX_SAMPLES:
        raise CalibrationError(
            f"calibration: m must be a whole number from 1 to {_MAX_SAMPLES}, got {_shown(m)}"
        )
    return m


def _costs_from_dict(raw: Any, actions: Sequence[str]) -> dict[str, ActionCost] | None:
    """The measured cost of each of its ``actions``, when the calibration recorded them."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) != set(actions):
        raise CalibrationError(f"calibration: costs must give {_listed(actions)}")
    costs = {}
    for name in actions:
        entry = raw[name]
        if not isinstance(entry, Mapping):
            raise CalibrationError(f"calibration: costs.{name} must be an object")
        where = f"costs.{name}"
        numbers = [
            _number(entry.get(key), f"{where}.{key}", 0.0, 1e9)
            for key in ("prompt_tokens", "completion_tokens", "requests")
        ]
        seconds = entry.get("seconds")
        seconds = None if seconds is None else _number(seconds, f"{where}.seconds", 0.0, 1e6)
        costs[name] = ActionCost(*numbers, seconds)
    return costs


def _gate_from_dict(raw: Any) -> tuple[Gate | None, dict[str, Any]]:
    """The gate section: kept signals with orientation and threshold (the rest is diagnostics)."""
    if raw is None:
        return None, {}
    if not isinstance(raw, Mapping) or not isinstance(raw.get("signals"), list):
        raise CalibrationError("calibration: gate must be an object with a 'signals' list")
    signals = []
    for i, entry in enumerate(raw["signals"]):
        where = f"gate.signals[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise CalibrationError(f"calibration: {where} needs a name, an orientation and a threshold")
        orientation = entry.get("orientation")
        if orientation not in (1, -1, 1.0, -1.0):
            raise CalibrationError(f"calibration: {where}.orientation must be 1 or -1")
        threshold = _number(entry.get("threshold"), f"{where}.threshold", -1e12, 1e12)
        auc = _number(entry.get("auc", 0.5), f"{where}.auc", 0.0, 1.0)
        signals.append(GateSignal(entry["name"], float(orientation), threshold, auc))
    k = raw.get("k", 5)
    if not isinstance(k, int) or k < 1:
        raise CalibrationError("calibration: gate.k must be a positive integer")
    details = {key: value for key, value in raw.items() if key not in ("signals", "k")}
    return Gate(tuple(signals), k), details


def load_calibration(
    source: Calibration | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    actions: Sequence[Action] | None = None,
) -> Calibration:
    """A calibration from an object, a JSON string, a file path, or None for the hand-set prior.

    ``actions``: the rows its entries are read with; None, a loaded calibration's own (its
    ``table``), else the shipped ``ACTION_TABLE``. One read with other rows is read again.
    """
    if isinstance(source, Calibration):
        if actions is None or source.table == tuple(actions):
            return source
        return calibration_from_dict(source.to_dict(), actions)
    actions = ACTION_TABLE if actions is None else actions
    if source is None or (isinstance(source, str) and not source.strip()):
        source = PRIOR_CALIBRATION_PATH
    source = read_json(source, "calibration")
    return calibration_from_dict(source, actions)


def shipped_calibrations() -> dict[str, Calibration]:
    """Every shipped calibration by name: ``prior``, and each fitted file in ``data/calibrations``."""
    found = {"prior": load_calibration(PRIOR_CALIBRATION_PATH)}
    for path in sorted(CALIBRATIONS_DIR.glob("*.json")):
        found[path.stem] = load_calibration(path)
    return found


def shipped_calibration(
    model: str, corpus: str | None = None, shipped: Mapping[str, Calibration] | None = None
) -> Calibration:
    """The shipped calibration fitted for ``model``, else the hand-set prior.

    For a named ``corpus`` with a fit of its own, that fit, unless the model's pooled fit beat
    it by cross-validation (the pooled fit ``replaces`` it); any other named corpus gets the
    pooled fit. ``corpus`` None is the caller's own documents (uploaded, pasted, or a library
    user's): the model's documents fit (``DOCUMENTS``: labelled questions over real manuals).
    Without those, the fit on HotpotQA, else on any corpus; never a fit for another model. A
    model with no fit of its own reads the caller's documents with the documents fit across
    readers (:meth:`Calibration.for_reader`: its own terms when it was one of them).
    """
    shipped = shipped if shipped is not None else shipped_calibrations()
    fitted = [c for c in shipped.values() if c.meta.get("fitted") and c.meta.get("model") == model]
    across = [c for c in shipped.values() if c.across_readers and c.meta.get("corpus") == DOCUMENTS]
    if not fitted and corpus is None and across:
        return across[0].for_reader(model)
    pooled = next((c for c in fitted if c.meta.get("corpus") == POOLED), None)
    own = next((c for c in fitted if corpus and c.meta.get("corpus") == corpus), None)
    if own is not None and not (pooled is not None and corpus in pooled.meta.get("replaces", ())):
        return own
    for wanted in (DOCUMENTS, POOLED, "HotpotQA") if corpus is None else (POOLED, "HotpotQA"):
        match = [c for c in fitted if c.meta.get("corpus") == wanted]
        if match:
            return match[0]
    return fitted[0] if fitted else shipped["prior"]


POOLED = "pooled"  # the corpus name of a model's fit over every labelled set
ACROSS_READERS = "across_readers"  # meta of a fit on several readers' reads: their names
READER_TERMS = "reader_terms"  # meta of such a fit made for one reader: "own" terms, or "none"
DOCUMENTS = "documents"  # the corpus name of a model's fit over labelled sets of real manuals


def calibration_status(calibration: Calibration, model: str) -> str:
    """In words: whether ``calibration`` was fitted for ``model``."""
    meta = {key: _meta_value(value) for key, value in calibration.meta.items()}
    fitted_for = meta.get("model")
    if not meta.get("fitted"):
        return "uncalibrated: a hand-set prior for a capable reader (run /calibrate for this model)"
    readers = calibration.meta.get(ACROSS_READERS)
    if readers and calibration.meta.get("model") == model:
        names = ", ".join(map(str, readers if isinstance(readers, list) else ())) or "several readers"
        if calibration.meta.get(READER_TERMS) == "own":
            return f"the documents fit across readers ({names}), with this reader's own terms"
        return f"fitted for other readers ({names}), not yet for this one (run /calibrate on your documents)"
    if calibration.meta.get("model") != model:
        return f"fitted for another model ({fitted_for}), not for this one (run /calibrate for this model)"
    fitted_on = calibration.meta.get("fitted_on")
    if isinstance(fitted_on, Mapping) and fitted_on.get("kind") == "self-test":
        return self_test_text(fitted_on)
    if meta.get("corpus") == POOLED:
        pooled = meta.get("pooled_from")
        sets = ", ".join(map(str, pooled if isinstance(pooled, list) else ())) or "several sets"
        return f"fitted for this model, pooled over {sets}"
    if meta.get("corpus") == DOCUMENTS:
        pooled = meta.get("pooled_from")
        sets = ", ".join(map(str, pooled if isinstance(pooled, list) else ())) or "several manuals"
        return f"the documents fit for this model (real manuals: {sets}); no self-test of these documents yet"
    return f"fitted for this model on {meta.get('corpus') or 'its corpus'}"


def self_test_text(fitted_on: Mapping[str, Any]) -> str:
    """In words: a fit on questions written from the user's documents (and theirs, if any)."""
    n, own = fitted_on.get("questions"), fitted_on.get("labelled")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    said = f"calibrated on {n} self-test questions from your documents"
    if not n and not own:
        kept = (
            (fitted_on.get("yield") or {}).get("kept") if isinstance(fitted_on.get("yield"), Mapping) else 0
        )
        why = "it ran out before running its questions" if kept else "none of its questions passed the checks"
        return f"self-tested, but {why}: the fit it refines, as it is"
    if isinstance(own, int) and not isinstance(own, bool) and own > 0:
        said += f" and {own} of your own labelled questions"
    return said


MAX_META_CHARS = 200  # a calibration's own words (name, corpus, model) as a report repeats them


def _meta_value(value: Any) -> Any:
    """A calibration's description as a report repeats it: short text, plain numbers, short lists.

    A caller may send any calibration: its name could be megabytes, or an integer no JSON
    encoder takes, and every report would carry it.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):  # compared as an int: a huge one does not convert to float
        return value if abs(value) <= 10**15 else None
    if isinstance(value, float):
        return value if math.isfinite(value) and abs(value) <= 1e15 else None
    if isinstance(value, str):
        return value if len(value) <= MAX_META_CHARS else value[: MAX_META_CHARS - 1] + "…"
    if isinstance(value, list | tuple):
        return [_meta_value(v) for v in value[:20] if isinstance(v, str | int | float | bool) or v is None]
    return f"({type(value).__name__})"


# ------------------------------------------------------------------------------------------
# Pricing and the policy's tables: what each action costs, what the policy sees per state
# ------------------------------------------------------------------------------------------


# How an action is priced (``BRAG(cost=...)``): every cost is relative to one R1 read, so that
# lambda keeps its meaning, the price of one read in units of answer error.
COST_UNITS = ("calls", "tokens", "seconds", "usd")
# Chosen by cross-validated replay on the calibration questions (docs/method.md).
DEFAULT_COST_UNIT = "tokens"
# On a CPU a generated token takes about as long as this many prompt tokens (estimates only).
_DECODE_WEIGHT = 6.0


def action_costs(
    calibration: Calibration,
    unit: str = DEFAULT_COST_UNIT,
    *,
    k: int = 5,
    m: int = 5,
    output_ratio: float = 4.0,
    prices: tuple[float, float] | None = None,
    actions: Sequence[Action] | None = None,
) -> tuple[dict[str, float], str]:
    """Each action's cost relative to one read (the first read offered costs 1), and where it comes from.

    ``actions``: those to price (default: the calibration's). ``calls``: every action 1 (SPEC's).
    ``tokens``: prompt plus ``output_ratio`` × completion tokens. ``seconds``: LLM latency.
    ``usd``: ``prices`` = (input, output) dollars per million tokens. The figures are the
    calibration's measured means; a calibration without them (the hand-set prior, older files)
    falls back to estimates from the prompts' sizes, and an action it never ran is priced by
    its estimate against the read's; the source says which.
    """
    chosen = list(calibration.offered() if actions is None else actions)
    labels = [a.label for a in chosen]
    if unit not in COST_UNITS:
        raise InputError(f"cost must be one of {COST_UNITS}, got {unit!r}")
    if unit == "calls":
        return dict.fromkeys(labels, 1.0), "every action counts as one call"
    if unit == "usd" and (prices is None or len(prices) != 2 or min(prices) < 0 or max(prices) <= 0):
        raise InputError("cost='usd' needs prices=(input, output) in dollars per million tokens")
    if not output_ratio > 0:
        raise InputError(f"output_ratio must be positive, got {output_ratio!r}")
    # The unit of cost: the first read of the question's own passages.
    read = next((a.label for a in chosen if a.kind.reads_passages and not a.kind.needs_new), labels[0])
    measured = {a: c for a, c in (calibration.costs or {}).items() if a in labels}
    usable = read in measured and (unit != "seconds" or all(c.seconds for c in measured.values()))
    estimated = {a: _price(c, unit, output_ratio, prices) for a, c in _estimated_costs(chosen, k, m).items()}
    if usable:
        raw = {a: _price(c, unit, output_ratio, prices) for a, c in measured.items()}
        unmeasured = [a for a in labels if a not in raw]
        for a in unmeasured:  # never run by calibration: its estimate, in the read's measured terms
            raw[a] = estimated[a] / estimated[read] * raw[read]
        source = "measured by calibration" + (
            f"; {_listed(unmeasured)} estimated from the prompt's size" if unmeasured else ""
        )
    else:
        raw, source = estimated, "estimated from prompt sizes: the calibration measured none"
    if not (math.isfinite(raw[read]) and raw[read] > 0 and all(math.isfinite(raw[a]) for a in labels)):
        raise InputError(
            f"cost {unit!r}: a read would cost {raw[read]:g} with these figures ({source}); every cost is "
            "relative to a read, so a read must cost more than 0"
        )
    return {a: max(raw[a] / raw[read], 1e-3) for a in labels}, source


def _price(cost: ActionCost, unit: str, output_ratio: float, prices: tuple[float, float] | None) -> float:
    if unit == "seconds":
        return cost.seconds if cost.seconds is not None else _seconds_estimate(cost)
    if unit == "usd":
        assert prices is not None
        return (cost.prompt_tokens * prices[0] + cost.completion_tokens * prices[1]) / 1e6
    return cost.prompt_tokens + output_ratio * cost.completion_tokens


def _seconds_estimate(cost: ActionCost) -> float:
    return (cost.prompt_tokens + _DECODE_WEIGHT * cost.completion_tokens) / 1000


def _estimated_costs(actions: Sequence[Action], k: int, m: int) -> dict[str, ActionCost]:
    """Costs from the prompts' own sizes, for k passages of a hundred words each."""
    passage = Passage("A title", " ".join(["word"] * 100))
    question = "In which city was the person this question is about born?"
    estimated = {a.label: a.estimated_cost(question, passage, k, m) for a in actions}
    return {a: replace(c, seconds=_seconds_estimate(c)) for a, c in estimated.items()}


def priced(
    usage: Mapping[str, Any], unit: str, output_ratio: float, prices: tuple[float, float] | None
) -> float:
    """What one step's calls cost in ``unit`` (absolute, not relative to a read)."""
    if unit == "calls":
        return float(usage["llm_calls"])
    if unit == "seconds":
        return float(usage["llm_seconds"])
    cost = ActionCost(usage["prompt_tokens"], usage["completion_tokens"], usage["llm_calls"], None)
    return _price(cost, unit, output_ratio, prices)


# What the policy sees in one state: each action's information rate D, D per unit cost, and the
# outlook of its next vote (what it may answer, and with which likelihood ratio).
_StateTables = tuple[dict[str, float], dict[str, float], dict[str, VoteOutlook]]


def _policy_tables(
    cal: Calibration,
    m: int,
    costs: Mapping[str, float],
    rule: str,
    second_hop: str,
    actions: Sequence[Action] | None = None,
    priors: Mapping[str, ActionPrior] | None = None,
) -> dict[tuple[bool, ...], _StateTables]:
    """The policy's view in each of its states, computed once per controller.

    A state is each gated action's window weak or not (the gate's verdicts, in table order) and
    whether some read answered already: the verdicts change which reliabilities apply, and an
    earlier answer splits a hop into its "repeats" and "new answer" branches. Each action's
    view in a state is its kind's (:meth:`VoteKind.view`).
    """
    actions = cal.offered() if actions is None else actions
    priors = {a.label: cal.prior_of(a) for a in actions} if priors is None else priors
    rates = cal.rates(rule, actions)
    gated = [a.label for a in actions if a.kind.gated]
    tables = {}
    for state_key in itertools.product((False, True), repeat=len(gated) + 1):
        weak, answered = dict(zip(gated, state_key, strict=False)), state_key[-1]
        views = {
            a.label: a.kind.view(
                a.label,
                priors[a.label],
                cal.eta,
                rates,
                PolicyState(weak.get(a.label, False), answered, second_hop),
            )
            for a in actions
        }
        state = {a: rate for a, (rate, _) in views.items()}
        per_cost = {a: rate / costs[a] for a, rate in state.items()}
        tables[state_key] = (state, per_cost, {a: outlook for a, (_, outlook) in views.items()})
    return tables


def _offered(calibration: Calibration, extra: Sequence[str], rows: Sequence[Action]) -> tuple[Action, ...]:
    """The ``rows`` the calibration has an entry for and the ``extra`` ones, in the rows' order."""
    if isinstance(extra, str) or not all(isinstance(label, str) for label in extra):
        raise InputError(f"extra_actions must be a tuple of action labels, got {_shown(extra)}")
    unknown = sorted(set(extra) - set(action_labels(rows)))
    if unknown:
        labels = _listed(action_labels(rows))
        raise InputError(f"extra_actions: {_listed(unknown)} not in the actions ({labels})")
    return tuple(a for a in rows if a.label in calibration.actions or a.label in extra)


# ------------------------------------------------------------------------------------------
# Runner: BRAG.run -> _Run.loop
# ------------------------------------------------------------------------------------------


class RunAborted(RuntimeError):
    """An action failed mid-run (mostly its LLM call); ``report`` holds everything done before.

    ``step`` names what failed (an action's label, ``retrieval``, or ``the run``); the failure
    itself is the exception's ``__cause__``.
    """

    def __init__(self, message: str, report: dict[str, Any], step: str = "the run") -> None:
        super().__init__(message)
        self.report, self.step = report, step


_SECOND_HOP_MODELS = ("conditional", "independent")


_POLICIES = ("lookahead", "rate")


# Second-hop reads (R2) a question may take at most; the stop rule decides how many it takes.
# Two reach both passages of a two-hop question through a bridge the first read could not name,
# and cost nothing where they do not pay: bench/results/controller.md has the measurements.
# Calibration runs this many.
DEFAULT_HOPS = 2


@dataclass(frozen=True)
class BRAG:
    """The orchestrator: ``run(question, corpus) -> (answer, report)``.

    Frozen: what it derives from its settings (the relative costs, the vote model, the policy
    tables) always matches them. ``dataclasses.replace(controller, k=2)`` makes another.

    ``lam`` is the price of one LLM call in units of answer error; ``k`` passages per hop;
    ``m`` closed-book samples per CB call; ``hops`` second-hop reads (R2) allowed per question,
    each retrieving with the latest follow-up query; ``max_uses`` runs of R1 and of CB.
    ``rule``, ``second_hop`` and ``policy`` choose how votes are weighed and actions scored
    (docs/method.md): the defaults keep every vote from counting against itself, read
    R2 against the answers before it, and price each action by its expected drop in P_err;
    ``rule="spec", second_hop="independent", policy="rate", hops=1`` is SPEC as first written.
    ``min_calls`` (default 1) calls are made whatever their price, so every question gets an
    answer when any action gives one; ``min_calls=0`` (with the settings above) prices strictly.
    ``actions`` are the rows it may offer (default: the shipped :data:`ACTION_TABLE`; a label
    each, refused twice): it offers those its calibration has an entry for and
    ``extra_actions``, labels of rows it has none for, each weighed by its kind's prior
    (``offered`` and ``priors`` after construction; the report says which were not fitted).
    """

    llm: LLM
    calibration: Calibration | Mapping[str, Any] | str | None = None
    lam: float = 0.05
    k: int = 5
    m: int = 5
    temperature: float = 0.7
    max_uses: int = 1
    hops: int = DEFAULT_HOPS
    cost: str = DEFAULT_COST_UNIT
    output_ratio: float = 4.0
    prices: tuple[float, float] | None = None
    costs: Mapping[str, float] | None = None  # explicit relative costs; None: from ``cost``
    seed: int = 0
    max_tokens: int = 48
    rule: str = "floored"
    second_hop: str = "conditional"
    policy: str = "lookahead"
    min_calls: int = 1
    extra_actions: tuple[str, ...] = ()  # labels of ``actions`` it has no entry for, on their kind's prior
    actions: tuple[Action, ...] = ACTION_TABLE  # the rows it may offer (a label each)
    # Each action's relative cost as runs price it: ``costs`` when given, else from ``cost``.
    priced_costs: dict[str, float] = field(init=False, repr=False, compare=False)
    offered: tuple[Action, ...] = field(init=False, repr=False, compare=False)  # in table order
    priors: dict[str, ActionPrior] = field(init=False, repr=False, compare=False)  # by label

    def __post_init__(self) -> None:
        # Derived once here: a frozen dataclass sets its own fields through object.__setattr__.
        rows = check_actions(self.actions)
        object.__setattr__(self, "actions", rows)
        given = self.calibration
        shipped = shipped_calibration(llm_name(self.llm)) if given is None else given
        # A fit across readers, given as it is, is made for this reader (a no-op for any other).
        calibration = load_calibration(shipped, with_shipped(rows)).for_reader(llm_name(self.llm))
        object.__setattr__(self, "calibration", calibration)
        if not (isinstance(self.lam, (int, float)) and self.lam >= 0):
            raise InputError(f"lam must be a number >= 0, got {self.lam!r}")
        counts = (("k", self.k), ("m", self.m), ("max_uses", self.max_uses), ("hops", self.hops))
        for name, value in (*counts, ("min_calls", self.min_calls)):
            least = 0 if name in ("hops", "min_calls") else 1  # no second hop; no call made regardless
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "a whole number >= 0" if least == 0 else "a positive integer"
                raise InputError(f"{name} must be {kind}, got {value!r}")
        offered = _offered(calibration, self.extra_actions, rows)
        labels = [a.label for a in offered]
        object.__setattr__(self, "offered", offered)
        object.__setattr__(self, "priors", {a.label: calibration.prior_of(a) for a in offered})
        if self.costs is None:
            priced, source = action_costs(
                calibration,
                self.cost,
                k=self.k,
                m=self.m,
                output_ratio=self.output_ratio,
                prices=self.prices,
                actions=offered,
            )
        else:
            priced, source = dict(self.costs), "given"
        if set(priced) != set(labels) or min(priced.values()) <= 0:
            raise InputError(f"costs must give a positive cost for each of {_listed(labels)}")
        object.__setattr__(self, "priced_costs", priced)  # ``costs`` stays what the caller gave
        object.__setattr__(self, "_cost_source", source)
        if (
            self.rule not in _RULES
            or self.second_hop not in _SECOND_HOP_MODELS
            or self.policy not in _POLICIES
        ):
            choices = f"rule in {_RULES}, second_hop in {_SECOND_HOP_MODELS}, policy in {_POLICIES}"
            raise InputError(f"settings must be {choices}")
        priors = calibration.source_priors(self.m, offered)
        object.__setattr__(self, "_vote_model", VoteModel(priors, calibration.eta, rule=self.rule))
        tables = _policy_tables(calibration, self.m, priced, self.rule, self.second_hop, offered, self.priors)
        object.__setattr__(self, "_tables", tables)

    def settings(self) -> dict[str, Any]:
        """Every setting it was made with, JSON-ready, but the model, the calibration and the rows."""

        def plain(value: Any) -> Any:
            if isinstance(value, Mapping):
                return {str(k): plain(v) for k, v in value.items()}
            return [plain(v) for v in value] if isinstance(value, (tuple, list)) else value

        chosen = (f.name for f in fields(self) if f.init and f.name not in ("llm", "calibration", "actions"))
        return {name: plain(getattr(self, name)) for name in chosen}

    def run(self, question: str, corpus: Retriever, **options: Any) -> tuple[str, dict[str, Any]]:
        """Answer ``question`` from ``corpus``: the final ``(answer, report)`` of :meth:`stream`.

        ``options`` are ``stream``'s (``on_step``, ``actions``). Raises ValueError on bad input,
        and RunAborted carrying the partial report when an LLM call fails.
        """
        report = self.ask(question, corpus, **options)
        return report.answer, report.to_dict()

    def ask(self, question: str, corpus: Retriever, **options: Any) -> Report:
        """:meth:`run`, as a typed :class:`Report` (its steps and observations typed too)."""
        *_, last = self._reports(question, corpus, **options)
        return last

    def stream(
        self,
        question: str,
        corpus: Retriever,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        actions: Sequence[str] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``run``, step by step: ``(best answer so far, report so far)``, then the final pair.

        ``on_step`` sees each decision before its action runs. ``actions`` replaces the policy
        with a fixed schedule (e.g. ``["R1", "R2"]``, run in that order, an unavailable one
        skipped): calibration and the baselines use it, and the report keeps the same shape.

        One pair after each decision, before its action runs (``report["finished"]`` is False).
        """
        for report in self._reports(question, corpus, on_step, actions):
            yield report.answer, report.to_dict()

    def _reports(
        self,
        question: str,
        corpus: Retriever,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        actions: Sequence[str] | None = None,
    ) -> Iterator[Report]:
        """The report after each decision (before its action runs), then the final one."""
        labels = tuple(a.label for a in self.offered)
        if actions is not None and not set(actions) <= set(labels):
            raise InputError(f"actions must be drawn from those offered, {labels}, got {list(actions)!r}")
        if not isinstance(question, str) or not question.strip():
            raise InputError("question is empty")
        check_retriever(corpus)
        question = " ".join(question.split())
        run = _Run(self, question, corpus, on_step, list(actions) if actions is not None else None)
        try:
            for step in run.loop():
                if step.action is not None:
                    yield run.report("", finished=False)
        except Exception as err:  # a backend may raise anything; the work done is kept
            report = run.report(f"error: {err}").to_dict()
            failed = run.current or "the run"
            raise RunAborted(f"{failed} failed: {err}", report, failed) from err
        yield run.report(run.stop_reason)


@dataclass(frozen=True)
class Step:
    """One decision of a run, and what its action saw and cost once it ran.

    ``posterior`` before the decision; ``rates``: each action's information rate in the state
    the policy saw; ``scores``: what the stop rule compared with lambda for each available
    action; ``action`` (None: stop) and its ``score``; ``floor``: taken only because the run had
    made fewer than ``min_calls`` calls. ``observation`` and ``cost`` once it ran.
    """

    number: int
    posterior: Mapping[str, Any]
    rates: Mapping[str, float]
    available: tuple[str, ...]
    scores: Mapping[str, float]
    score: float | None
    action: str | None
    floor: bool
    policy_us: float
    observation: Observation | None = None
    cost: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON for it."""
        out = {
            "step": self.number,
            "posterior": self.posterior,
            "rates": dict(self.rates),
            "available": list(self.available),
            "scores": dict(self.scores),
            "score": self.score,
            "action": self.action,
            "floor": self.floor,
            "policy_us": self.policy_us,
        }
        if self.observation is not None:
            out["observation"] = self.observation.to_dict()
        if self.cost is not None:
            out["cost"] = dict(self.cost)
        return out


@dataclass(frozen=True)
class Report:
    """A run as it stands: its answer, how far to trust it, every step, the totals, the settings.

    :meth:`BRAG.ask` returns it; :meth:`BRAG.run` and :meth:`BRAG.stream` give its
    :meth:`to_dict`, the JSON reports have always had.
    """

    question: str
    answer: str
    finished: bool
    note: str
    confidence: Mapping[str, Any]
    p_err: float
    steps: tuple[Step, ...]
    stop_reason: str
    gate: Mapping[str, Any]
    corpus: Mapping[str, Any]  # the retriever's own figures (Retriever.stats)
    totals: Mapping[str, Any]
    config: Mapping[str, Any]

    @property
    def answered(self) -> bool:
        """Whether it has an answer."""
        return bool(self.answer)

    @property
    def p_correct(self) -> float:
        """The answer's P(correct) (0 without one)."""
        return float(self.confidence.get("p_correct", 0.0))

    @property
    def found_in_documents(self) -> bool | None:
        """Whether the documents hold the answer, as the run's signals say; None when no read ran."""
        found = self.confidence.get("found_in_documents")
        return None if found is None else bool(found)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (a new object each time)."""
        return {
            "question": self.question,
            "answer": self.answer,
            "answered": self.answered,
            "found_in_documents": self.found_in_documents,
            "finished": self.finished,
            "note": self.note,
            "confidence": dict(self.confidence),
            "p_err": self.p_err,
            "steps": [step.to_dict() for step in self.steps],
            "stop_reason": self.stop_reason,
            "gate": dict(self.gate),
            "corpus": self.corpus,
            "totals": dict(self.totals),
            "config": self.config,
        }


@dataclass
class _Usage:
    """What one run's LLM calls cost so far, summed call by call."""

    calls: int = 0
    requests: int = 0  # HTTP requests (or local generations) behind the calls
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_calls: int = 0
    tokens_estimated: bool = False
    # llm_seconds: what the calls took when made (a cache keeps the original latency);
    # llm_wait_s: time this run spent waiting on the backend (near zero on cache hits).
    llm_seconds: float = 0.0
    llm_wait_s: float = 0.0
    llm_seconds_known: bool = True

    def add(self, result: Completion, waited: float) -> None:
        """Count one call that returned ``result`` after ``waited`` seconds."""
        self.llm_wait_s += waited
        if result.cached:
            self.llm_seconds += result.seconds or 0.0
            self.llm_seconds_known &= result.seconds is not None
        else:
            self.llm_seconds += waited if result.seconds is None else result.seconds
        self.calls += 1
        self.requests += result.requests
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.completion_tokens
        self.cached_calls += int(result.cached)
        self.tokens_estimated |= result.estimated

    def since(self, before: _Usage) -> dict[str, Any]:
        """One step's cost: what was added after ``before`` (a copy taken then)."""
        return {
            "llm_calls": self.calls - before.calls,
            "requests": self.requests - before.requests,
            "prompt_tokens": self.prompt_tokens - before.prompt_tokens,
            "completion_tokens": self.completion_tokens - before.completion_tokens,
            "llm_seconds": round(self.llm_seconds - before.llm_seconds, 6),
            "llm_seconds_known": self.llm_seconds_known,
        }

    def totals(self) -> dict[str, Any]:
        """The report's totals for the calls."""
        return {
            "llm_calls": self.calls,
            "llm_requests": self.requests,
            "cached_calls": self.cached_calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tokens_estimated": self.tokens_estimated,
        }


# Below this P(correct) an answer is reported as a guess, in the report and on the page.
GUESS_BELOW = 0.5


class _ShownPassage(NamedTuple):
    """A passage a read showed, in the forms the answer checks compare (made once per run)."""

    label: str
    body: str  # its shown text without the title, which quotes come from
    folded: str  # the body's NFKC form
    words: str  # normalize_answer of all it showed, between spaces

    @classmethod
    def of(cls, passage: Passage) -> _ShownPassage:
        """``passage`` as its read's prompt showed it (:meth:`Passage.shown`)."""
        body = passage.shown_body()
        words = f" {normalize_answer(passage.shown())} "
        return cls(passage.label(), body, unicodedata.normalize("NFKC", body), words)


def _appears_in(answer: str, shown: Iterable[_ShownPassage]) -> bool:
    """Whether ``answer`` (normalised) stands as whole words in any passage shown."""
    wanted = normalize_answer(answer)
    if not wanted or wanted in ("yes", "no"):
        return wanted in ("yes", "no")  # a yes/no answer is never quoted; it cannot be checked
    return any(f" {wanted} " in passage.words for passage in shown)


QUOTE_WORDS = 12  # words shown on each side of an answer quoted from its passage
QUOTE_CHARS = 200  # at most this many characters on each side


def _source_of(answer: str, shown: Sequence[_ShownPassage]) -> dict[str, str] | None:
    """The first passage shown that holds ``answer`` word for word, and its words around it."""
    for passage in shown:
        located = _find_answer(answer, passage.body, passage.folded)
        if located is None:
            continue
        text, found = located
        before = [w.start() for w in re.finditer(r"\S+", text[: found.start()])]
        after = [found.end() + w.end() for w in re.finditer(r"\S+", text[found.end() :])]
        start = before[-QUOTE_WORDS] if len(before) >= QUOTE_WORDS else 0
        end = after[QUOTE_WORDS - 1] if len(after) >= QUOTE_WORDS else len(text)
        lead = "… " if len(before) > QUOTE_WORDS or start < found.start() - QUOTE_CHARS else ""
        tail = " …" if len(after) > QUOTE_WORDS or end > found.end() + QUOTE_CHARS else ""
        # Words can be as long as a text without spaces: the quote is cut in characters too.
        start, end = max(start, found.start() - QUOTE_CHARS), min(end, found.end() + QUOTE_CHARS)
        return {"passage": passage.label, "quote": lead + " ".join(text[start:end].split()) + tail}
    return None


NOT_FOUND = "not in your documents"  # how a report says the documents do not hold the answer


def _confidence_summary(
    p_correct: float, runner_up: dict[str, Any] | None, supported: bool, found: bool = True
) -> str:
    """One sentence a person can act on: found or not, a guess or not, the runner-up, the corpus's say."""
    parts = [] if found else [f"{NOT_FOUND}: what follows is a guess, not an answer from them"]
    parts.append(
        f"a guess: {p_correct:.0%}"
        if p_correct < GUESS_BELOW or not found
        else f"P(correct) ≈ {p_correct:.0%}"
    )
    if runner_up is not None and p_correct < GUESS_BELOW:
        parts.append(f"runner-up: {runner_up['answer']} ({runner_up['p']:.0%})")
    if not supported:
        parts.append("no passage read contains this answer: the corpus does not seem to hold it")
    return "; ".join(parts)


class _WindowView:
    """The run as a kind's window sees it (:class:`WindowContext`), and nothing more of it.

    What it reads of the run is a copy (the passages read) or immutable (the retrievals): a kind
    building its window can retrieve, and change nothing of the run.
    """

    __slots__ = ("_run",)

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def question(self) -> str:
        """The question, as the run reads it."""
        return self._run.question

    @property
    def brag(self) -> BRAG:
        """The controller's settings."""
        return self._run.brag

    @property
    def first_hop(self) -> Retrieval:
        """The question's own retrieval."""
        return self._run.first_hop

    @property
    def next_hop(self) -> NextHop | None:
        """The latest follow-up retrieval: what it found, the passages not read yet, the novel ones."""
        return self._run.next_hop

    @property
    def read_ids(self) -> tuple[int, ...]:
        """The passages read so far, in the order first read."""
        return tuple(self._run.read_ids)

    def retrieve(self, query: str, k: int) -> Retrieval:
        """The top ``k`` passages for ``query``."""
        return self._run.retrieve(query, k)

    def passages(self, ids: Sequence[int]) -> list[Passage]:
        """The passages of ``ids``, in that order."""
        return [self._run.corpus[i] for i in ids]

    def window(
        self, ids: Sequence[int], found: Retrieval | None = None, removed: Sequence[int] | None = None
    ) -> Window:
        """A window of ``ids``, each scored by id (:meth:`_Run.make_window`)."""
        return self._run.make_window(ids, found, removed)


class _StepView:
    """The run as a kind's step sees it (:class:`StepContext`), and nothing more of it.

    A step changes the run only through its calls: ``ask``, ``read`` and ``vote``.
    """

    __slots__ = ("_run",)

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def question(self) -> str:
        """The question, as the run reads it."""
        return self._run.question

    @property
    def brag(self) -> BRAG:
        """The controller's settings."""
        return self._run.brag

    def ask(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        """One LLM call, its reply bounded and its cost counted."""
        return self._run.ask(messages, **options)

    def read(self, action: Action, window: Window) -> Reading:
        """One deterministic read of ``window``, in its order (no vote yet)."""
        return self._run.read(action, window)

    def passages(self, window: Window) -> list[Passage]:
        """The window's passages, in its order, as a prompt holds them."""
        return self._run.passages(window)

    def vote(
        self, source: VoteType, answer: str, reliability: float | None = None, in_passage: bool = False
    ) -> int | None:
        """Add an answer to the posterior as a vote of type ``source`` (of its own ``reliability``)."""
        return self._run.vote(source, answer, reliability, in_passage)

    def repeats(self, answer: str, rests_on: Sequence[int] | None = None) -> bool:
        """Whether ``answer`` is one an earlier read voted for, holding a passage of ``rests_on``."""
        return self._run.repeats(answer, rests_on)


def _lead(found: Retrieval) -> float:
    """How far ``found``'s top score leads the next one's, as a share of it (0 without a positive top)."""
    if not found.hits:
        return 0.0
    top = found.hits[0][1]
    second = found.hits[1][1] if len(found.hits) > 1 else 0.0
    return min(max((top - second) / top, 0.0), 1.0) if top > 0 else 0.0


class _Run:
    """The state of one question, and the loop that answers it.

    ``loop`` alternates two layers until the policy stops: ``_decide`` prices every available
    action against the posterior and picks one (or stop), ``_act`` runs it as its kind does
    (:meth:`VoteKind.step`) and counts its cost. A step asks the LLM (``ask``, or ``read`` for a
    window of passages), turns the reply into a vote (``vote``) and records what it saw;
    ``report`` assembles the report from all of it at any point.
    """

    def __init__(
        self,
        brag: BRAG,
        question: str,
        corpus: Retriever,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        schedule: list[str] | None = None,
    ) -> None:
        self.brag, self.question, self.corpus, self.on_step = brag, question, corpus, on_step
        self.schedule = schedule
        self.votes: list[Vote] = []
        self.beliefs = brag._vote_model.beliefs()
        self.update_us = 0.0  # posterior update for the latest vote, billed to the next decision
        self.candidates = _Candidates()
        self.uses: Counter[str] = Counter()
        self.read_ids: list[int] = []
        self.shown: dict[int, _ShownPassage] = {}  # each passage read, as shown (confidence)
        # Each candidate some read voted for, and the passages those reads held.
        self.read_answers: dict[int, set[int]] = {}
        # The gate's verdict on each gated action's window, in table order (a key of the policy tables).
        self.weak = dict.fromkeys([a.label for a in brag.offered if a.kind.gated], False)
        self.next_hop: NextHop | None = None
        self.first_hop = Retrieval([], [], 0)  # set by loop, where a retriever's failure is caught
        # Each action's window, built once by its kind (a hop's anew with each next hop).
        self.windows: dict[str, Window] = {}
        # Each window's vote outcomes, as its kind prices them (VoteKind.outcomes; None: the tables').
        self.outcomes: dict[str, Outcomes | None] = {}
        self.steps: list[Step] = []
        self.usage = _Usage()
        self.offered = {a.label: a for a in brag.offered}
        self.view, self.window_view = _StepView(self), _WindowView(self)  # what a kind may use of the run
        self.read_as: dict[int, SeenPassage] = {}  # each passage with the score it was read with
        self.policy_us = 0.0
        self.started = time.perf_counter()
        self.stop_reason = ""
        self.absent: float | None = None  # absent_share of the question, once looked up
        self.floor_reason: str | None = (
            None  # why the policy alone would have stopped, if the floor overrode it
        )
        self.current: str | None = None
        self.probs: list[float] = []
        self.residual = 1.0

    def available(self) -> list[str]:
        """The actions left, as each one's kind says (a read up to ``max_uses``, a hop up to ``hops``)."""
        ready = self.next_hop is not None and bool(self.next_hop.novel)  # set by a read
        return [
            a.label
            for a in self.brag.offered
            if self.uses[a.label] < a.kind.uses(self.brag)
            and (ready or not a.kind.needs_new)
            and not self._past_the_ranking(a)
        ]

    def _past_the_ranking(self, action: Action) -> bool:
        """A row that starts below the top (``first``) whose window found no passage: nothing to read."""
        window = self.windows.get(action.label)
        return action.first > 0 and window is not None and not window.passages

    def loop(self) -> Iterator[dict[str, Any]]:
        """Retrieve, build and judge the question's windows; then decide, yield the step, act, until done."""
        self.current = "retrieval"  # a retriever that raises is named in RunAborted
        self.first_hop = self.retrieve(self.question, self.brag.k)
        for action in self.brag.offered:
            if not action.kind.needs_new:  # a hop's: once a read found its new passages
                self.build(action)
        self.current = None
        while True:
            step = self._decide()
            yield step
            if step.action is None:
                return
            self._act(step)

    def _decide(self) -> Step:
        """Price each available action, pick one or stop, and record the step (not yet acted on)."""
        t0 = time.perf_counter()
        self.probs, self.residual = self.beliefs.probabilities(len(self.candidates.texts))
        available = self.available()
        rates, _, _ = self._state()
        gains = self._gains(available)
        decision = self._follow_schedule(choose_action(gains, available, self.brag.lam), available)
        floor = self._below_the_floor(decision, gains, available)
        if floor is not None:
            decision, self.floor_reason = floor, decision.stop_reason
        us = (time.perf_counter() - t0) * 1e6 + self.update_us
        self.update_us = 0.0
        self.policy_us += us
        step = Step(
            len(self.steps) + 1,
            self.posterior_view(),
            dict(rates),
            tuple(available),
            {a: round(gain, 6) for a, gain in gains.items()},  # what the stop rule compares with lambda
            decision.score,
            decision.action,
            floor is not None,  # taken only because the run had made too few calls
            round(us, 2),
        )
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step.to_dict())
        if decision.action is None:
            self.stop_reason = decision.stop_reason or ""
            if self.floor_reason:
                n = self.brag.min_calls
                made = "the first call was" if n == 1 else f"the first {n} calls were"
                self.stop_reason += f"; {made} made by the min_calls floor ({self.floor_reason})"
        return step

    def _below_the_floor(
        self, decision: Decision, gains: Mapping[str, float], available: list[str]
    ) -> Decision | None:
        """Until ``min_calls`` calls are made, the best available action runs even at a gain <= λ.

        A person who asks a question expects an answer; ``min_calls=0`` keeps strict pricing.
        """
        if decision.action is not None or self.schedule is not None or not available:
            return None
        if self.usage.calls >= self.brag.min_calls:
            return None
        best = max(available, key=lambda a: (gains[a], -available.index(a)))  # ties: the earlier
        return Decision(best, gains[best], None)

    def _state(self) -> _StateTables:
        """What the policy sees now: the windows the gate judged weak, and whether a read answered."""
        return self.brag._tables[(*self.weak.values(), bool(self.read_answers))]

    def _gains(self, available: list[str]) -> dict[str, float]:
        """Each available action's score: its expected drop in P(error) per unit cost."""
        brag = self.brag
        _, rate_per_cost, outlooks = self._state()
        if brag.policy == "rate":  # SPEC: P_err * D / c
            p_err = error_probability(self.probs)
            return {a: p_err * rate_per_cost[a] for a in available}
        eta, costs = brag.calibration.eta, brag.priced_costs
        now = _Now.of(self.beliefs, self.probs, self.residual)  # what _decide just read
        return {
            a: _gain(now, eta, self._outlook(a, outlooks), self._repeatable(a)) / costs[a] for a in available
        }

    def _repeatable(self, label: str) -> set[int]:
        """The candidates a vote of this action would repeat: those of reads sharing a passage of its window.

        A window not built yet (a hop's, before its next hop) shares every passage read.
        """
        window = self.windows.get(label)
        if window is None or self.offered[label].kind.needs_new:
            return set(self.read_answers)
        ids = {p.id for p in window.passages}
        return {c for c, held in self.read_answers.items() if not held.isdisjoint(ids)}

    def _outlook(self, label: str, outlooks: Mapping[str, VoteOutlook]) -> VoteOutlook:
        """An action's next vote: its state's table's, with its window's outcomes where its kind has them."""
        outcomes = self.outcomes.get(label)
        return outlooks[label] if outcomes is None else replace(outlooks[label], outcomes=outcomes)

    def _follow_schedule(self, decision: Decision, available: list[str]) -> Decision:
        """A fixed schedule (calibration, baselines) overrides the policy's choice, not its score."""
        if self.schedule is None:
            return decision
        while self.schedule and self.schedule[0] not in available:
            self.schedule.pop(0)
        chosen = self.schedule.pop(0) if self.schedule else None
        return Decision(chosen, decision.score, None if chosen else "schedule done")

    def _act(self, step: Step) -> None:
        """Run the step's action and record what it saw and what it cost."""
        action = step.action
        assert action is not None
        self.current = action
        before = replace(self.usage)
        observed = self._observe(self.offered[action])
        cost = self.usage.since(before)
        brag = self.brag
        cost["priced"] = round(priced(cost, brag.cost, brag.output_ratio, brag.prices), 9)
        self.steps[-1] = replace(step, observation=observed, cost=cost)
        self.uses[action] += 1
        self.current = None

    def _observe(self, action: Action) -> Observation:
        """Run the action's step on its window; what its kind declares decides what the run does with it.

        A gated kind's observation carries the gate's view of its window; a kind that reads
        passages notes its answer (a hop after it may repeat it); one that sets the next hop
        retrieves with its follow-up query.
        """
        kind, window = action.kind, self.windows[action.label]
        observed = kind.step(self.view, action, window)
        for passage in observed.passages or ():
            if passage.id not in self.read_ids:  # scored as this read held it, until it is read
                self.read_as[passage.id] = passage
        gate = window.gate  # before a next hop's window is judged anew
        if kind.reads_passages:
            self.note_answer(observed.candidate, [p.id for p in observed.passages or ()])
        if kind.sets_next_hop and observed.follow_up is not None:
            self.after_read(observed.follow_up, [p.id for p in observed.passages or ()])
        return replace(observed, details={**observed.details, "gate": gate}) if kind.gated else observed

    def ask(self, messages: list[dict[str, str]], **kwargs: Any) -> Completion:
        """One LLM call, its reply texts bounded and its cost counted."""
        t0 = time.perf_counter()
        result = self.brag.llm.complete(messages, seed=self.brag.seed, **kwargs)
        waited = time.perf_counter() - t0
        if not isinstance(result, Completion):
            raise TypeError(f"LLM backend returned {type(result).__name__}, expected Completion")
        if any(len(text) > MAX_REPLY_CHARS for text in result.texts):
            result = replace(result, texts=[text[:MAX_REPLY_CHARS] for text in result.texts])
        self.usage.add(result, waited)
        return result

    def vote(
        self, source: VoteType, answer: str, reliability: float | None = None, in_passage: bool = False
    ) -> int | None:
        """Add an answer to the posterior as a vote of type ``source``; its candidate (None: no answer).

        ``reliability``: the vote's own, when its evidence sets it; ``in_passage``: a passage read
        holds the answer word for word.
        """
        if is_no_answer(answer):
            return None
        index = self.candidates.index(answer, in_passage)
        vote = Vote(source, index, reliability)
        t0 = time.perf_counter()
        self.beliefs.add(vote)
        self.update_us += (time.perf_counter() - t0) * 1e6
        self.votes.append(vote)
        return index

    def read(self, action: Action, window: Window) -> Reading:
        """One read of ``window``: the answer, its evidence and the follow-up query (no vote yet)."""
        passages = self.passages(window)
        reply = self.ask(
            action.messages(self.question, passages),
            n=1,
            temperature=0.0,
            max_tokens=self.brag.max_tokens,
            stop=READ_STOP,
        )
        raw = reply.texts[0] if reply.texts else ""
        answer, query = parse_reading(raw)
        if is_no_answer(answer):
            answer = ""
        analyzer = _analyzer_of(self.corpus)
        fallback = is_degenerate_query(query, self.question, analyzer)
        if fallback:
            query = expand_query(self.question, passages, analyzer=analyzer)
        tokens = reply.logprobs[0] if reply.logprobs else None
        evidence = read_evidence(answer, self.question, passages, tokens, window=window)
        return Reading(raw, answer, evidence, query, fallback, window.passages)

    def passages(self, window: Window) -> list[Passage]:
        """The window's passages, in its order, as a prompt holds them."""
        return [self.corpus[i] for i in window.ids]

    def retrieve(self, query: str, k: int) -> Retrieval:
        """The top ``k`` passages for ``query``, which the retrieval records."""
        found = self.corpus.retrieve(query, k)
        return found if found.query == query else replace(found, query=query)

    def make_window(
        self, ids: Sequence[int], found: Retrieval | None = None, removed: Sequence[int] | None = None
    ) -> Window:
        """A window of ``ids`` in that order, each scored by id, and its before-call evidence.

        A passage read before keeps the score it was read with; any other is scored by
        ``found``, the retrieval that put it in the window (default: the question's own).
        """
        found = self.first_hop if found is None else found
        hits, lead = dict(found.hits), _lead(found)
        top = found.hits[0][0] if found.hits else None
        passages = []
        for i in ids:
            before = self.read_as.get(i)
            if before is not None and i in self.read_ids:
                passages.append(before)
                continue
            score = hits.get(i, before.score if before is not None else None)
            passage = self.corpus[i]
            passages.append(SeenPassage(i, passage.title, passage.label(), score, lead if i == top else 0.0))
        new = tuple(i for i in ids if i not in self.read_ids)
        window = Window(tuple(passages), found, new, tuple(found.removed if removed is None else removed))
        facts = ReadFacts(self.question, window, self.passages(window), analyzer=_analyzer_of(self.corpus))
        return replace(window, signals=window_evidence(facts))

    def build(self, action: Action) -> None:
        """Its kind's window for ``action``, judged by the gate when its kind is gated."""
        kind, prior = action.kind, self.brag.priors[action.label]
        window = kind.window(self.window_view, action)
        self.windows[action.label] = self.judge(action.label, window) if kind.gated else window
        self.outcomes[action.label] = kind.outcomes(prior, window, self.brag.calibration.eta)

    def repeats(self, answer: str, rests_on: Sequence[int] | None = None) -> bool:
        """Whether ``answer`` is one an earlier read voted for, holding a passage of ``rests_on``.

        Reads that share the passage an answer rests on are not independent witnesses of it;
        a read that found it in a passage the earlier one never held is (None: any earlier vote).
        """
        held = self.read_answers.get(self.candidates.find(answer)) if answer else None
        return held is not None and (rests_on is None or not held.isdisjoint(rests_on))

    def judge(self, label: str, window: Window) -> Window:
        """``window`` with the gate's signals and verdict (as it is, without a calibrated gate)."""
        gate = self.brag.calibration.gate
        if gate is None:
            return window
        judged = gate.judge(window, self.corpus)
        self.weak[label] = judged.weak
        return judged

    def after_read(self, follow_up: str, passage_ids: Sequence[int]) -> None:
        """Remember what was read and find the next hop's window with the new follow-up query."""
        added = [i for i in passage_ids if i not in self.read_ids]
        self.read_ids += added
        if not added and self.next_hop is not None:
            return  # a read of passages already read (a focused one) leaves the next hop as it was
        # Only passages not read yet, and none that repeats one read: a hop must bring new
        # evidence. Its window is known now, so the gate can judge it before R2 is scored.
        found = self.retrieve(follow_up, self.brag.k + len(self.read_ids))
        fresh = [i for i, _ in found.hits if i not in self.read_ids]
        novel = self.corpus.novel(fresh, self.read_ids)
        self.next_hop = NextHop(found, tuple(fresh), tuple(novel))
        for action in self.brag.offered:
            if action.kind.needs_new:
                self.build(action)

    def note_answer(self, candidate: int | None, passage_ids: Sequence[int]) -> None:
        """Remember that a read of ``passage_ids`` voted for ``candidate`` (a later read may repeat it)."""
        if candidate is not None:
            self.read_answers.setdefault(candidate, set()).update(passage_ids)

    def posterior_view(self) -> dict[str, Any]:
        """The posterior as the report shows it: each candidate, the residual and P(error)."""
        counts = Counter(v.candidate for v in self.votes)
        candidates = [
            {"answer": text, "p": round(p, 6), "votes": counts[i]}
            for i, (text, p) in enumerate(zip(self.candidates.texts, self.probs, strict=True))
        ]
        return {
            "candidates": candidates,
            "residual": round(self.residual, 6),
            "p_err": round(error_probability(self.probs), 6),
        }

    def confidence(self, answer: str) -> dict[str, Any]:
        """How far to trust ``answer``, in words as well as numbers.

        ``found_in_documents``: whether the run's signals say the documents hold the answer (a read
        of them gave it, :func:`found_by_rule`, and the calibration's :class:`FoundModel`, if it has
        one, agrees); None when no read of them ran, so nothing was checked. ``guess`` when they
        do not hold it, or P(correct) is below ``GUESS_BELOW``; the runner-up candidate; and
        whether any passage read contains the answer (``supported``).
        """
        reads = self._document_reads()
        if not answer:
            signals = self.found_signals(answer, False, 0.0, reads)
            return {
                "p_correct": 0.0,
                "guess": True,
                "runner_up": None,
                "supported": False,
                "source": None,
                "found_in_documents": False if reads else None,  # every read said NONE
                "found": {"p": None, "signals": signals},
                "summary": "",
            }
        ranked = sorted(range(len(self.probs)), key=lambda i: (-self.probs[i], i))
        p_correct = 1.0 - error_probability(self.probs)
        runner_up = None
        if len(ranked) > 1:
            second = ranked[1]
            runner_up = {"answer": self.candidates.texts[second], "p": round(self.probs[second], 6)}
        shown = self._passages_shown()
        supported = _appears_in(answer, shown)
        signals = self.found_signals(answer, supported, p_correct, reads)
        model = self.brag.calibration.found
        found = (found_by_rule(signals) and (model is None or model.found(signals))) if reads else None
        return {
            "p_correct": round(p_correct, 6),
            "guess": p_correct < GUESS_BELOW or found is False,
            "runner_up": runner_up,
            "supported": supported,
            "source": _source_of(answer, shown) if found is not False else None,
            "found_in_documents": found,
            "found": {"p": round(model.p_found(signals), 6) if model else None, "signals": signals},
            "summary": _confidence_summary(p_correct, runner_up, supported, found is not False),
        }

    def _document_reads(self) -> list[Observation]:
        """The observations of the run's reads of the documents (its kinds that read passages)."""
        return [
            s.observation
            for s in self.steps
            if s.action in self.offered
            and s.observation is not None
            and self.offered[s.action].kind.reads_passages
        ]

    def found_signals(
        self, answer: str, supported: bool, p_correct: float, reads: Sequence[Observation]
    ) -> dict[str, float]:
        """What the run says about whether the documents hold ``answer`` (``FOUND_SIGNALS``)."""
        if self.absent is None:  # the question's terms are looked up once a run
            self.absent = absent_share(self.question, self.corpus)
        answered = [o for o in reads if o.answer and o.candidate is not None]
        best = self.candidates.texts.index(answer) if answer in self.candidates.texts else None
        return {
            "absent_terms": round(self.absent, 6),
            "read_none": float(bool(reads) and not answered),  # reads ran, and every one said NONE
            "closed_book_only": float(bool(answer) and all(o.candidate != best for o in answered)),
            "in_passage": float(supported),
            "p_correct": round(p_correct, 6),
        }

    def _passages_shown(self) -> list[_ShownPassage]:
        """The passages the run's reads showed the LLM, in the order first read, each made once.

        A report is made after every step, so each passage's forms are kept for the run.
        """
        ids = [p.id for step in self.steps if step.observation for p in step.observation.passages or ()]
        for i in ids:
            if i not in self.shown:
                self.shown[i] = _ShownPassage.of(self.corpus[i])
        return [self.shown[i] for i in dict.fromkeys(ids)]

    def answer(self) -> str:
        """The most probable candidate so far (ties: the earliest), or "" before any."""
        if not self.probs:
            return ""
        best = max(range(len(self.probs)), key=lambda i: (self.probs[i], -i))
        return self.candidates.texts[best]

    def report(self, stop_reason: str, finished: bool = True) -> Report:
        """The report as it stands: every step so far, the totals and the configuration."""
        answer = self.answer()
        totals = {
            **self.usage.totals(),
            "wall_time_s": round(time.perf_counter() - self.started, 6),
            "llm_seconds": round(self.usage.llm_seconds, 6),
            "llm_seconds_known": self.usage.llm_seconds_known,
            "llm_wait_s": round(self.usage.llm_wait_s, 6),
            "policy_us": round(self.policy_us, 2),
        }
        return Report(
            question=self.question,
            answer=answer,
            finished=finished,
            note="" if answer or not finished else "no candidate answer: every action returned NONE",
            confidence=self.confidence(answer),
            p_err=round(error_probability(self.probs), 6),
            steps=tuple(self.steps),  # a snapshot: steps are frozen, and later ones do not change it
            stop_reason=stop_reason,
            gate={label: w.gate for label, w in self.windows.items() if self.offered[label].kind.gated},
            corpus=self.corpus.stats(),
            totals=totals,
            config=self.config(),
        )

    def config(self) -> dict[str, Any]:
        """The report's configuration: every setting, the prices, the actions, the calibration."""
        brag, calibration = self.brag, self.brag.calibration
        return {
            **brag.settings(),
            "cost": {
                "unit": brag.cost,
                "per_action": {a: round(c, 6) for a, c in brag.priced_costs.items()},
                "source": brag._cost_source,
            },
            "actions": {
                "offered": [a.label for a in brag.offered],
                # Weighed by their kind's hand-set prior: the calibration has no entry for them.
                "on_kind_prior": [a.label for a in brag.offered if a.label not in calibration.actions],
            },
            "calibration": {
                **{
                    key: _meta_value(brag.calibration.meta.get(key))
                    for key in (
                        "name",
                        "source",
                        "model",
                        "corpus",
                        "pooled_from",
                        "fitted",
                        "fitted_on",
                        "date",
                    )
                },
                "status": calibration_status(brag.calibration, llm_name(brag.llm)),
                # Evidence this code computes that none of the calibration's fits looked at.
                "unweighed_features": list(calibration.unweighed_features()),
            },
        }


if __name__ == "__main__":
    # ``python -m brag`` runs this file as __main__: the command line is bragkit.cli's, which imports
    # this module as ``brag`` (so the loop is at the script's entry, never between modules).
    from bragkit.cli import main

    sys.exit(main())
