"""Answers: SQuAD normalisation, candidate merging, no-vote detection, reply parsing."""

import pytest

from brag import (
    closed_book_mode,
    exact_match,
    is_no_answer,
    normalize_answer,
    parse_reading,
    same_answer,
    token_f1,
)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Nazi Party", "nazi party"),
        ("  An   apple, a day. ", "apple day"),
        ("Théâtre-Français!", "théâtrefrançais"),
        ("“Quoted”", "quoted"),
    ],
)
def test_normalize_answer_follows_squad(raw, norm):
    assert normalize_answer(raw) == norm


def test_same_answer_merges_near_identical_strings():
    assert same_answer("the Nazi Party", "Nazi party")
    assert same_answer("Barack Obama", "Obama")
    assert not same_answer("John", "John Smith Junior")
    assert not same_answer("Paris", "London")
    assert not same_answer("", "")


def test_token_f1_and_exact_match():
    assert token_f1("Nazi Party", "the Nazi party") == 1.0
    assert token_f1("red car", "blue car") == pytest.approx(0.5)
    assert token_f1("", "x") == 0.0
    assert exact_match("the Nazi Party", ["NSDAP", "Nazi party"])
    assert not exact_match("", [""])


@pytest.mark.parametrize("text", ["NONE", "none.", "Unknown", "", "  ", "I don't know", "N/A"])
def test_no_answer_is_no_vote(text):
    assert is_no_answer(text)


@pytest.mark.parametrize("text", ["Nonesuch Records", "1945", "Known Unknowns"])
def test_real_answers_are_votes(text):
    assert not is_no_answer(text)


@pytest.mark.parametrize(
    ("reply", "answer", "query"),
    [
        ("Answer: Nazi Party\nFollow-up query: Lebensraum Nazi", "Nazi Party", "Lebensraum Nazi"),
        (" Nazi Party\nFollow-up query: Lebensraum", "Nazi Party", "Lebensraum"),
        ("**Answer:** Paris.\n**Follow-up Query:** capital", "Paris", "capital"),
        ("Query: x y\nAnswer: 1945", "1945", "x y"),
        ("The answer is Lyon.", "Lyon", ""),
        ("", "", ""),
        ('NONE\nFollow-up query: "who built it"', "NONE", "who built it"),
        (" No, Waste Land is a drink.  It is sweet.", "No", ""),
        ("Yes.", "Yes", ""),
        ("Nobel Prize in Physics. She won it twice.", "Nobel Prize in Physics", ""),
        ("J. R. R. Tolkien", "J. R. R. Tolkien", ""),
        ("St. Louis, Missouri.", "St. Louis, Missouri", ""),
        ("Dr. Who was first shown in 1963. It ran for years.", "Dr. Who was first shown in 1963", ""),
    ],
)
def test_parse_reading_is_robust(reply, answer, query):
    assert parse_reading(reply) == (answer, query)


def test_closed_book_mode_counts_agreement_and_skips_no_votes():
    assert closed_book_mode(["Paris", "paris.", "Lyon", "NONE", "The Paris"]) == ("Paris", 3)
    assert closed_book_mode(["NONE", "unknown", ""]) == ("", 0)
    # A tie goes to the answer seen first.
    assert closed_book_mode(["Lyon", "Paris", "Paris", "Lyon"]) == ("Lyon", 2)
