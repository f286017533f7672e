"""Text analysis: tokens per script, stop words per language, a corpus's analyzer, and answers in
other languages (normalisation, labels, quotes, the prompt's language line)."""

import json

import pytest

import brag
from brag import Analyzer, Corpus, Passage, language_of, normalize_answer, tokenize, words

TOKYO = "東京タワーは1958年に完成した電波塔です。設計者は内藤多仲です。"
OSAKA = "大阪城は豊臣秀吉が築いた城で、天守閣は1931年に再建されました。"
STOCKHOLM = "Stockholm är Sveriges huvudstad och ligger där Mälaren möter Östersjön."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Han and kana: overlapping bigrams; digits and Latin stand apart as words.
        ("東京タワーは1958年", ["東京", "京タ", "タワ", "ワー", "ーは", "1958", "年"]),
        # The katakana middle dot is punctuation: it separates runs, as a space would.
        ("データ・ベース", ["デー", "ータ", "ベー", "ース"]),
        # Chinese, with CJK and full-width punctuation as separators.
        ("故宫，位于北京。", ["故宫", "位于", "于北", "北京"]),
        # Hangul, written with spaces between words: bigrams inside each word.
        ("서울은 한국의 수도", ["서울", "울은", "한국", "국의", "수도"]),
        # Thai has no spaces and combining vowels: bigrams of its characters, marks included.
        ("ภาษาไทย", ["ภา", "าษ", "ษา", "าไ", "ไท", "ทย"]),
        # Devanagari vowel signs and viramas belong to their word.
        ("हिन्दी भाषा", ["हिन्दी", "भाषा"]),
        # Full-width Latin and digits fold (NFKC); case folds; "_" separates.
        ("ＡＢＣ１２３ snake_Case", ["abc123", "snake", "case"]),
        # Mixed scripts in one passage: each run analysed by its script.
        (
            "Tokyo Tower（東京タワー）is 333 m",
            ["tokyo", "tower", "東京", "京タ", "タワ", "ワー", "is", "333", "m"],
        ),
    ],
)
def test_words_splits_each_script_into_units_bm25_can_match(text, expected):
    assert words(text) == expected


def test_diacritics_are_kept_so_words_they_tell_apart_stay_apart():
    assert words("Malmö Malmo résumé resume Straße") == ["malmö", "malmo", "résumé", "resume", "strasse"]


def test_a_latin_script_corpus_reads_words_as_brag_always_did():
    # Whole runs, marks splitting words: the tokens (and rankings) English corpora always had.
    assert words("Tokyo Tower (東京タワー) ти́хон", by_script=False) == [
        "tokyo",
        "tower",
        "東京タワー",
        "ти",
        "хон",
    ]


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("Welcher Befehl listet den Inhalt eines Verzeichnisses auf, wenn man ihn aufruft?", "de"),
        ("La commande affiche le contenu du répertoire et les fichiers qui sont cachés.", "fr"),
        ("Stockholm är Sveriges huvudstad och det är en stad som ligger vid vattnet.", "sv"),
        # A 2WikiMultihopQA question naming an Italian film stays English.
        (
            "Which film has the director born first, La Mazurka Del Barone, Della Santa E Del Fico Fiorone "
            "or Safe (2012 Film)?",
            "en",
        ),
        ("cat dog dog", "en"),  # one Danish stop word is no Danish text
    ],
)
def test_stopword_language_needs_a_clear_lead_over_english(text, language):
    assert brag.stopword_language(words(text)) == language


def test_each_text_loses_its_own_languages_stop_words():
    assert tokenize("Der Befehl zeigt die Dateien und die Verzeichnisse an") == [
        "befehl",
        "zeigt",
        "dateien",
        "verzeichnisse",
    ]
    assert tokenize("The Glass Tower and the fjord") == ["glass", "tower", "fjord"]


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("東京タワーの設計者は誰ですか", "ja"),
        ("ls 命令的作用是什么？", "zh"),
        ("서울은 어디에 있습니까?", "ko"),
        ("Welcher Befehl listet den Inhalt eines Verzeichnisses auf?", "de"),
        ("Vad gör kommandot ls?", ""),  # accented, no stop words of any language: unsure
        ("Who is Sergio Pérez?", "en"),
        ("Что делает команда ls?", ""),
    ],
)
def test_language_of(text, language):
    assert language_of(text) == language


def test_english_prompts_are_unchanged_and_others_ask_for_the_questions_language():
    english = brag.read_messages("Who designed the Glass Tower?", [])
    assert english[0]["content"] == brag._READ_INSTRUCTIONS
    assert brag.closed_book_messages("Who wrote Hamlet?")[0]["content"] == brag.CLOSED_BOOK_INSTRUCTIONS
    japanese = brag.read_messages("東京タワーの設計者は誰ですか", [Passage("", TOKYO)])[0]["content"]
    assert japanese.endswith("Write the answer and the query in Japanese, the language of the question.")
    chinese = brag.closed_book_messages("故宫在哪个城市？")[0]["content"]
    assert chinese.endswith("Write the answer in Chinese, the language of the question.")
    # A language told only by stop words is not named: a wrong name is worse than none.
    german = brag.read_messages("Welcher Befehl listet den Inhalt eines Verzeichnisses auf?", [])
    assert german[0]["content"].endswith("Write the answer and the query in the language of the question.")
    # A question too short to tell, over passages that are not English, gets the line too.
    short = "Was macht der Befehl ls?"
    page = Passage(
        "ls.1.txt", "ls - Verzeichnisinhalte auflisten. Die Einträge werden alphabetisch sortiert."
    )
    assert brag.read_messages(short, [page])[0]["content"].endswith("in the language of the question.")
    assert brag.read_messages("What does ls do?", [Passage("", TOKYO)])[0]["content"].endswith(
        "in the language of the question."
    )
    english = [Passage("", "The tower was designed by an architect.")]
    assert brag.read_messages("Who designed it?", english)[0]["content"] == brag._READ_INSTRUCTIONS


def test_a_corpus_picks_its_analyzer_from_its_passages():
    assert Corpus([TOKYO, OSAKA, "An English passage."]).analyzer == Analyzer("en", by_script=True)
    english = ["The tower (東京タワー) was finished in 1958.", "It is in Tokyo, Japan."]
    assert Corpus(english).analyzer == Analyzer("en", by_script=False)
    german = [
        "Der Befehl ls zeigt den Inhalt eines Verzeichnisses an.",
        "Mit der Option -a werden auch versteckte Dateien angezeigt, die mit einem Punkt beginnen.",
    ]
    assert Corpus(german).analyzer == Analyzer("de", by_script=False)


def test_the_issues_japanese_question_finds_its_passage():
    corpus = Corpus([OSAKA, STOCKHOLM, TOKYO])
    hits = corpus.search("東京タワーの設計者は誰ですか", 2)
    assert hits[0][0] == 2 and hits[0][1] > 0 and hits[1][1] < hits[0][1]
    assert corpus.search("天守閣はいつ再建されましたか", 1)[0][0] == 0
    assert corpus.search("Mälaren", 1)[0][0] == 1 and corpus.search("malaren", 1)[0][1] == 0


def test_a_chinese_question_finds_its_passage_among_others():
    passages = [
        "故宫位于北京中轴线的中心，是明清两代的皇家宫殿。",
        "长城是中国古代的军事防御工程，总长度超过两万公里。",
        "西湖位于浙江省杭州市西湖区，是中国主要的观赏性淡水湖泊之一。",
    ]
    corpus = Corpus(passages)
    assert [i for i, _ in corpus.search("西湖在哪个省？", 1)] == [2]
    assert [i for i, _ in corpus.search("长城有多长？", 1)] == [1]


def test_a_saved_corpus_keeps_its_analyzer_and_an_older_save_reads_as_english(tmp_path):
    corpus = Corpus([TOKYO, OSAKA])
    corpus.save(tmp_path / "ja")
    loaded = Corpus.load(tmp_path / "ja")
    assert loaded.analyzer == corpus.analyzer and loaded.search("設計者", 1) == corpus.search("設計者", 1)
    meta_path = tmp_path / "ja" / "brag_corpus.json"
    meta = json.loads(meta_path.read_text())
    meta["analysis"] = "stemmed/9:words:en"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not this BRAG's"):
        Corpus.load(tmp_path / "ja")
    del meta["analysis"]
    meta_path.write_text(json.dumps(meta))
    assert Corpus.load(tmp_path / "ja").analyzer == Analyzer("en", by_script=False)


def test_answers_in_scripts_without_spaces_compare_by_character():
    assert normalize_answer("「内藤 多仲」です。") == "内 藤 多 仲 で す"
    assert brag.exact_match("内藤多仲。", ["内藤多仲"]) and not brag.exact_match("内藤", ["内藤多仲"])
    assert brag.token_f1("内藤多仲", "内藤多仲です") == pytest.approx(0.8)
    assert brag.same_answer("北京市", "北京") and not brag.same_answer("北京", "南京")
    assert brag.exact_match("ＡＢＣ", ["abc"])  # full-width folds


def test_replies_in_other_languages_parse_to_their_answer():
    assert brag.parse_reading("答え：内藤多仲です。設計者として知られる。\nFollow-up query: 内藤多仲") == (
        "内藤多仲です",
        "内藤多仲",
    )
    assert brag.parse_reading("Antwort: Bergen")[0] == "Bergen"
    assert brag.parse_reading("Answer: 「北京」")[0] == "北京"
    for none in ("なし", "不明", "无", "没有", "keine", "Answer: NONE"):
        assert brag.is_no_answer(brag.parse_reading(none)[0]), none


def shown(*passages):
    return [brag._ShownPassage.of(p) for p in passages]


def test_an_answer_inside_text_without_spaces_is_found_and_quoted():
    passage = Passage("東京タワー", "東京タワーは１９５８年に完成した電波塔です。設計者は内藤多仲です。")
    assert brag._source_of("内藤多仲", shown(passage)) == {"passage": "東京タワー", "quote": passage.text}
    # Full-width digits match their ASCII form, either way round; the quote shows the folded text.
    assert "1958年" in brag._source_of("1958", shown(passage))["quote"]
    assert brag._source_of("１９５８", shown(Passage("", "Built in 1958 in Tokyo."))) is not None
    evidence = brag.read_evidence("内藤多仲", "東京タワーの設計者は誰？", [Passage("", OSAKA), passage])
    assert evidence["span"] == 0.5 and evidence["in_question"] == 0.0
    assert brag._appears_in("内藤多仲", shown(passage)) and not brag._appears_in(
        "内藤", shown(Passage("", OSAKA))
    )
    # Latin answers still need whole words, also beside Han: "Paris" is not in "Parisian".
    assert brag._source_of("Paris", shown(Passage("", "A Parisian café."))) is None
    assert brag._source_of("Tokyo", shown(Passage("", "東京はTokyoです"))) is not None
