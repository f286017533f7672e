"""Self-test questions (bragkit/selftest.py): spans, the generator's prompt, the checks, the budget,
the corpus calibration and where it is kept."""

from __future__ import annotations

import pytest
from selftest_reader import PASSAGES, SelfTestReader

import brag
import calibrate
from bragkit import selftest

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
    assert [i.gold for i in calibrate.self_test_questions(test)] == [(p.answer,) for p in test.pairs]


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
    asked = []
    test = selftest.self_test(
        corpus(),
        reader,
        budget=selftest.Budget(questions=5, tries=20),
        should_stop=lambda: asked.append(1) or len(asked) > 3,
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
