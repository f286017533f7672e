"""Self-test questions (bragkit/selftest.py): spans, the generator's prompt, the checks, the budget,
the corpus calibration and where it is kept."""

from __future__ import annotations

import pytest
from selftest_reader import PASSAGES, SelfTestReader

import brag
from bragkit import fits, selftest

TOOLS = ["frobnicate", "quuxify", "blarg"]


def corpus() -> brag.Corpus:
    return brag.Corpus(PASSAGES)


# ------------------------------------------------------------------------------------------
# Spans
# ------------------------------------------------------------------------------------------


def test_answer_spans_prefer_typed_spans_and_keep_their_sentence():
    text = "Set the FOO_BAR variable to change it. The cache holds 250 entries by default here."
    spans = selftest.answer_spans(text)
    assert [s.text for s in spans] == ["FOO_BAR", "250"]
    assert spans[0].cloze() == "Set the ____ variable to change it."


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("The LIMIT_MAX value caps it, and LIMIT_MAX cannot be unset by the user.", ""),  # twice
        ("This option is described in Section 4.2 [Options], page 91 of the manual.", ""),  # a reference
        ("Contents . . . . . 1 Intro . . . . . 3 Usage . . . . . 7 Options . . . . . 12", ""),  # a listing
        ("The FOO_BAR variable changes how the program behaves at start.", "FOO_BAR"),  # in the title
        ("FOO_BAR", ""),  # no sentence around it
    ],
)
def test_answer_spans_refuse_what_cannot_be_asked_for_unambiguously(text, title):
    assert selftest.answer_spans(text, title) == []


def test_draw_visits_every_document_before_any_twice():
    passages = [
        {"title": f"doc{d}", "text": f"part {i} of document {d}"} for d in range(3) for i in range(20)
    ]
    chosen = brag.Corpus(passages)
    drawn = selftest.draw(chosen, 9, seed=1)
    docs = [chosen[i].title for i in drawn]
    assert sorted(docs[:3]) == ["doc0", "doc1", "doc2"] and len(set(drawn)) == 9
    # Each document gives passages from its whole length, not only its start.
    positions = sorted(passages.index({"title": chosen[i].title, "text": chosen[i].text}) % 20 for i in drawn)
    assert positions[-1] - positions[0] >= 10


def test_the_generator_is_shown_the_blanked_sentence_not_the_answer():
    passage = brag.Passage("wibble manual", "The wibble program keeps at most 105 entries in its log.")
    span = selftest.answer_spans(passage.text, passage.title)[0]
    prompt = selftest.question_messages(passage, span)[-1]["content"]
    assert "105" not in prompt and "____" in prompt
    german = brag.Passage(
        "Handbuch", "Das Programm wibble speichert höchstens 105 Einträge in seinem Protokoll."
    )
    system = selftest.question_messages(german, selftest.answer_spans(german.text)[0])[0]["content"]
    assert "German" in system


# ------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------


def test_kept_pairs_pass_the_roundtrip_and_the_yield_adds_up():
    reader = SelfTestReader()
    test = selftest.self_test(corpus(), reader, budget=selftest.Budget(questions=5, tries=20))
    assert len(test.pairs) == 5 and test.yield_.kept == 5
    for pair in test.pairs:
        assert not selftest.names_answer(pair.question, pair.answer)
        assert pair.answer in corpus()[pair.passage].text
    y = test.yield_
    refused = y.no_question + y.names_answer + y.duplicate + y.vague + y.roundtrip
    assert y.tried == refused + y.kept
    assert [i.gold for i in fits.self_test_questions(test)] == [(p.answer,) for p in test.pairs]


@pytest.mark.parametrize(
    ("reader", "verdict"),
    [
        (SelfTestReader(wrong="Atlantis"), "roundtrip"),  # a read of the passage does not give it back
        (SelfTestReader(copy=True), "names_answer"),  # the question holds the answer
        (SelfTestReader(vague=True), "vague"),  # the question does not find its passage
    ],
)
def test_a_bad_pair_is_refused(reader, verdict):
    test = selftest.self_test(corpus(), reader, budget=selftest.Budget(questions=3, tries=6))
    assert test.pairs == []
    assert getattr(test.yield_, verdict) >= 1
    assert {t["verdict"] for t in test.pairs_tried} <= {verdict, "no_span"}


def test_a_second_question_with_the_same_answer_is_a_duplicate():
    again = {
        "title": "again",
        "text": "Its FROB_CONF variable is what the frobnicate program reads on a restart.",
    }
    test = selftest.self_test(
        brag.Corpus([*PASSAGES, again]), SelfTestReader(), budget=selftest.Budget(questions=13, tries=20)
    )
    assert test.yield_.duplicate >= 1 and len({p.answer for p in test.pairs}) == len(test.pairs)


def test_the_budget_bounds_the_calls_and_a_cancel_stops_before_the_next_call():
    reader = SelfTestReader(wrong="Atlantis")  # nothing is ever kept: only the budget ends it
    test = selftest.self_test(corpus(), reader, budget=selftest.Budget(questions=5, tries=40, calls=7))
    assert len(reader.calls) == test.calls == 7 and test.stopped == "budget"
    reader = SelfTestReader()
    test = selftest.self_test(
        corpus(),
        reader,
        budget=selftest.Budget(questions=5, tries=20),
        should_stop=lambda: len(reader.calls) >= 3,
    )
    assert test.stopped == "cancelled" and len(reader.calls) == 3


def test_a_bad_budget_is_a_clear_error():
    with pytest.raises(brag.InputError, match="budget"):
        selftest.Budget(questions=10, tries=5)


def test_draw_never_reads_a_large_collection_whole():
    class Counting:
        def __init__(self, corpus):
            self.corpus, self.read = corpus, set()

        def __len__(self):
            return len(self.corpus)

        def __getitem__(self, i):
            self.read.add(i)
            return self.corpus[i]

    big = Counting(brag.Corpus([{"title": f"doc{i // 50}", "text": f"part {i}"} for i in range(5000)]))
    drawn = selftest.draw(big, 20, seed=2)
    assert len(drawn) == 20 and len(big.read) <= selftest.DRAW_POOL * 20
    assert max(drawn) - min(drawn) > 2500  # still spread over the whole collection


def test_a_term_defined_on_a_line_of_its_own_is_asked_for_from_its_description():
    text = "-A\n--smarthome\nMake the Home key smarter when it is pressed anywhere on a line.\n-B"
    spans = selftest.answer_spans(text)
    assert spans[0].text == "--smarthome"
    assert spans[0].cloze() == "____: Make the Home key smarter when it is pressed anywhere on a line."


def test_a_small_corpus_asks_about_each_passages_next_span_in_later_rounds():
    two_each = [
        {
            "title": "part 0",
            "text": "Set BLIP_MODE to pick how blip runs on a host today. "
            "The blip tool stores its cache below /var/cache/blip on every host.",
        },
        {
            "title": "part 1",
            "text": "Quieter output needs the ZAP_LEVEL knob lowered before starting. "
            "Old reports of zap end up in /srv/zap/cache once a week has passed.",
        },
    ]
    others = [
        {"title": f"other {i}", "text": f"Unrelated filler text number {i} about gardens."} for i in range(40)
    ]
    test = selftest.self_test(
        brag.Corpus(two_each + others), SelfTestReader(), budget=selftest.Budget(questions=4, tries=10)
    )
    assert sorted(p.answer for p in test.pairs) == [
        "/srv/zap/cache",
        "/var/cache/blip",
        "BLIP_MODE",
        "ZAP_LEVEL",
    ]


# ------------------------------------------------------------------------------------------
# Bounds a public server relies on (issue 50): the finder's work, its stops, the limits
# ------------------------------------------------------------------------------------------


def identifiers(count: int, start: int = 0) -> str:
    """Sentences of distinct snake_case identifiers, each standing once: every one a candidate."""
    words = [f"name_{i}_value" for i in range(start, start + count)]
    return " ".join(f"The tool reads {' and '.join(words[j : j + 4])} today." for j in range(0, count, 4))


def test_the_span_finder_counts_each_candidate_once_and_at_most_its_cap():
    text = identifiers(20_000)  # about 20,000 candidates: counting each over the text is quadratic
    checks = []
    spans = selftest.answer_spans(text, check=lambda: checks.append(1))
    assert len(spans) == selftest.MAX_CANDIDATES  # each stands once; the finder stopped at its cap
    sentences = text.count(" today.")
    # One check per candidate counted, one per 64 sentences or lines: never one per occurrence.
    assert len(checks) <= selftest.MAX_CANDIDATES + len(selftest._SHAPES) * (sentences // 64 + 1) + 2
    small = (
        "Set the FOO_BAR variable to change it. FOO_BAR is read once here. The cache holds 250 entries now."
    )
    assert [s.text for s in selftest.answer_spans(small)] == ["250"]  # FOO_BAR stands twice


def test_a_stop_is_heard_inside_the_span_finder_and_between_passages_with_no_call_due():
    with pytest.raises(selftest.Cancelled):
        selftest.answer_spans(identifiers(400), check=lambda: (_ for _ in ()).throw(selftest.Cancelled()))
    # Passages of identifiers common to all of them: no span is rare, so no call is ever due.
    common = [{"title": f"p{i}", "text": identifiers(40)} for i in range(60)]
    reader, asked = SelfTestReader(), []
    test = selftest.self_test(
        brag.Corpus(common),
        reader,
        budget=selftest.Budget(questions=5, tries=20),
        should_stop=lambda: asked.append(1) or len(asked) > 10,
    )
    assert test.stopped == "cancelled" and reader.calls == [] and len(asked) == 11


def test_each_passage_is_searched_for_spans_once_for_every_round(monkeypatch):
    searched: list[str] = []
    find = selftest.answer_spans
    monkeypatch.setattr(
        selftest,
        "answer_spans",
        lambda text, title="", check=None: searched.append(text) or find(text, title),
    )
    # Every read is wrong, so every passage is asked again in each of the rounds.
    test = selftest.self_test(
        corpus(), SelfTestReader(wrong="Atlantis"), budget=selftest.Budget(questions=30, tries=100)
    )
    assert test.yield_.tried > len(PASSAGES)  # more than one round ran
    assert len(searched) == len(set(searched)) == len(PASSAGES)


class LongWriter(SelfTestReader):
    """Its questions are far over the question limit: as written, or once NFKC expands them."""

    def __init__(self, filler: str) -> None:
        super().__init__()
        self.filler = filler

    def complete(self, messages, **options):
        if messages[0]["content"].startswith("You turn a fill-in-the-blank"):
            self.calls.append("generate")
            return brag.Completion([f"Question: Which value is {self.filler} here?"])
        return super().complete(messages, **options)


@pytest.mark.parametrize("filler", ["x" * 900_000, "\ufdfa" * 300])  # U+FDFA is 18 characters in NFKC
def test_a_written_question_obeys_the_question_limit(filler):
    test = selftest.self_test(
        corpus(), LongWriter(filler), budget=selftest.Budget(questions=3, tries=6, question_chars=4_000)
    )
    assert test.pairs == [] and test.yield_.no_question == test.yield_.tried == 6
    assert selftest.parse_question(f"Question: Which value is {filler} here?", 10_000_000)


class Counting(SelfTestReader):
    def __init__(self) -> None:
        super().__init__()
        self.chars: list[int] = []

    def complete(self, messages, **options):
        self.chars.append(sum(len(m["content"]) for m in messages))
        return super().complete(messages, **options)


def test_the_prompt_characters_of_a_self_test_are_bounded_in_all():
    reader = Counting()
    test = selftest.self_test(
        corpus(), reader, budget=selftest.Budget(questions=10, tries=40, prompt_chars=6_000)
    )
    assert test.stopped == "prompt characters"
    assert 0 < sum(reader.chars) <= 6_000 and len(reader.chars) < 20
    with pytest.raises(brag.InputError, match="prompt_chars"):
        selftest.Budget(prompt_chars=0)


class Echo:
    """A model that answers each request with a fresh text, and counts the calls it gets."""

    name = "echo"

    def __init__(self, size: int = 5) -> None:
        self.calls, self.size = 0, size

    def complete(self, messages, **options):
        self.calls += 1
        return brag.Completion([f"{self.calls}" * self.size] * options.get("n", 1), 10, 2)


def test_a_kept_request_is_answered_once_from_the_roundtrip_with_its_seconds():
    model = Echo()
    remembered = selftest.Remembered(model)
    read = [{"role": "user", "content": "Question: where?"}]
    options = selftest.focused_read_options()
    first = remembered.complete_and_keep(read, **options)
    again = remembered.complete(read, **dict(reversed(options.items())))  # the same request
    assert model.calls == 1 and again.texts == first.texts and again.cached and not first.cached
    assert again.seconds is not None  # a read answered from it still says what the call took
    remembered.complete(read, **options)  # used once: asked again, the model answers
    remembered.complete_and_keep(read, **options)
    remembered.complete(read, **{**options, "seed": 1})  # another request
    assert model.calls == 4 and not remembered.replies.keys() - {remembered._key(read, options)}


def test_remembered_replies_are_bounded_in_size_and_number():
    long = selftest.Remembered(Echo(size=2 * brag.MAX_REPLY_CHARS + 1))
    read = [{"role": "user", "content": "Question: where?"}]
    long.complete_and_keep(read, temperature=0.0)
    long.complete(read, temperature=0.0)
    assert long.llm.calls == 2 and not long.replies  # longer than a read keeps: never kept
    few = selftest.Remembered(Echo(), limit=2)
    for i in range(4):
        few.complete_and_keep([{"role": "user", "content": f"Question {i}?"}], temperature=0.0)
    assert len(few.replies) == 2
    few.complete([{"role": "user", "content": "Question 3?"}], temperature=0.0)
    assert few.llm.calls == 5  # past the limit, a request is sent again


def test_a_roundtrip_is_the_focused_reads_own_request():
    docs = corpus()
    reader = Counting()
    requests: list[tuple] = []
    recording = type("Recording", (), {"name": reader.name})()
    recording.complete = lambda messages, **o: (
        requests.append((messages, o)) or reader.complete(messages, **o)
    )
    question = "Which  port does a plonk server answer health checks on?"  # as a writer may space it
    top = docs.retrieve(" ".join(question.split()), 1).hits[0][0]
    for passage in (top, (top + 1) % len(docs)):  # its own passage ranked first, then another
        requests.clear()
        selftest.roundtrip(recording, question, docs[passage], "8421")
        controller = brag.BRAG(recording, calibration=brag.load_calibration(), k=1, extra_actions=("RT",))
        controller.run(question, docs, actions=["RT"])
        (sent, options), (read, read_options) = requests
        assert (sent == read and options == read_options) is (passage == top)


# ------------------------------------------------------------------------------------------
# Languages: sentences, spans and questions in scripts written without spaces
# ------------------------------------------------------------------------------------------


def test_a_sentence_in_a_script_without_spaces_counts_its_words_by_two_characters():
    assert selftest.word_count("Set the cache size to a larger value.") == 8  # spaced: as before
    assert selftest.word_count("設定は /etc/foo.conf に書きます。") >= selftest.MIN_SENTENCE_WORDS
    assert (
        selftest.word_count("配置文件保存在 /etc/bar.conf 中，系统启动时读取。")
        >= selftest.MIN_SENTENCE_WORDS
    )
    assert selftest.word_count("はい。") < selftest.MIN_SENTENCE_WORDS  # a heading, not a statement


@pytest.mark.parametrize(
    ("text", "span", "cloze"),
    [
        (
            "最初の文は短いです。ログは /var/log/frob.log に毎日書き込まれ、一週間保存されます。",
            "/var/log/frob.log",
            "ログは ____ に毎日書き込まれ、一週間保存されます。",
        ),
        (
            "本機能の名前は「自動更新」と呼ばれており、毎晩実行されるように設定されています。",
            "自動更新",
            "本機能の名前は「____」と呼ばれており、毎晩実行されるように設定されています。",
        ),
        (
            "配置文件保存在 /etc/bar.conf 中，系统启动时读取这个文件。",
            "/etc/bar.conf",
            "配置文件保存在 ____ 中，系统启动时读取这个文件。",
        ),
    ],
    ids=["japanese-path", "japanese-quoted", "chinese-path"],
)
def test_spans_are_found_in_japanese_and_chinese_sentences(text, span, cloze):
    found = {s.text: s for s in selftest.answer_spans(text)}
    assert span in found and found[span].cloze() == cloze


@pytest.mark.parametrize(
    ("reply", "question"),
    [
        ("質問：設定ファイルはどこに保存されますか？", "設定ファイルはどこに保存されますか？"),
        ("问题: 配置文件保存在哪里？", "配置文件保存在哪里？"),
        (
            "Frage: Welche Variable liest frobnicate beim Start?",
            "Welche Variable liest frobnicate beim Start?",
        ),
        ("Question: Which file?", ""),  # two words: too short to name what it is about
        ("Question: 設定値 a：b はどこに書きますか？", "設定値 a：b はどこに書きますか？"),  # kept as written
    ],
)
def test_a_question_is_read_from_a_reply_in_each_language(reply, question):
    assert selftest.parse_question(reply) == question


def test_a_german_noun_phrase_is_not_taken_for_a_name():
    text = (
        "Die Liste enthält eine Reihe von Dateisystempfaden für das System, die beim Start gelesen werden. "
        "Der Wert steht in /etc/fstab und wird beim Booten des Rechners ausgewertet."
    )
    assert [s.text for s in selftest.answer_spans(text)] == ["/etc/fstab"]
    english = "The manual was written by the famous author John Smith Baker in the summer of that year."
    assert [s.text for s in selftest.answer_spans(english)] == ["John Smith Baker"]
