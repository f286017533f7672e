"""MilvusCorpus on a real Milvus (Milvus Lite, a local file): protocol, ranks, hybrid, resume, errors."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from conftest import PRIORS, ROOT, ScriptedLLM

import brag
from bragkit import calibrate_cli, embedders
from bragkit import milvus as mc

pytest.importorskip("pymilvus")

PASSAGES = [
    {"title": "Glass Tower", "text": "The Glass Tower in Oslo was designed by the architect Lina Berg."},
    {"title": "Lina Berg", "text": "Lina Berg is a Norwegian architect, born in Bergen in 1961."},
    {"title": "Oslo", "text": "Oslo is the capital of Norway and its largest city."},
    {"title": "Bergen", "text": "Bergen is a city on the west coast of Norway, known for its harbour."},
    {"title": "Fjord", "text": "A fjord is a long, narrow inlet with steep sides, made by a glacier."},
    {"title": "Trondheim", "text": "Trondheim is a city in Norway where the Nidaros Cathedral stands."},
    {
        "title": "Silent Orchard",
        "text": "The Silent Orchard is a novel by Kari Holm, who was born in Trondheim.",
    },
    {"title": "Norway", "text": "Norway is a country in Northern Europe whose capital is Oslo."},
]
QUESTIONS = [
    "Where was Lina Berg born?",
    "Who designed the Glass Tower?",
    "Which city has the Nidaros Cathedral?",
    "What is a fjord?",
    "Who wrote The Silent Orchard?",
    "What is the capital of Norway?",
]


@pytest.fixture(scope="module")
def milvus(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("milvus") / "brag.db")
    client = mc.connect(uri)
    mc.ingest(PASSAGES, client, "demo")
    yield uri, client
    client.close()


def test_brag_answers_through_milvus_end_to_end(milvus):
    uri, client = milvus
    corpus = mc.MilvusCorpus(uri, "demo", client=client)
    assert len(corpus) == len(PASSAGES)

    def reader(prompt: str) -> str:
        if "born in Bergen" in prompt:
            return "Answer: Bergen\nFollow-up query: Lina Berg"
        return "Answer: NONE\nFollow-up query: Lina Berg birthplace"

    llm = ScriptedLLM(read=reader, closed_book=lambda p, n: ["NONE"] * n)
    answer, report = brag.BRAG(llm, calibration=PRIORS, k=2).run(
        "Where was the architect Lina Berg born?", corpus
    )
    assert answer == "Bergen" and report["corpus"]["engine"] == "milvus"
    read = {p["title"] for s in report["steps"] for p in (s.get("observation") or {}).get("passages", [])}
    assert "Lina Berg" in read
    assert corpus.document_share("norway") == pytest.approx(
        sum("norway" in p["text"].lower() for p in PASSAGES) / len(PASSAGES)
    )
    assert corpus.document_share("zzz") == 0.0 and corpus.document_share("a' OR 1") == 0.0  # no injection


def test_bm25_ranks_like_bm25s_on_a_fixed_corpus(milvus):
    uri, client = milvus
    corpus = mc.MilvusCorpus(uri, "demo", client=client)
    reference = brag.Corpus(PASSAGES)
    for question in QUESTIONS:
        mine = [corpus[pid].title for pid, _ in corpus.retrieve(question, 3).hits]
        # bm25s fills the window with passages that match nothing (score 0); Milvus returns matches.
        theirs = [reference[i].title for i, s in reference.retrieve(question, 3).hits if s > 0]
        # Milvus weighs terms by its own BM25 implementation, so near ties may swap.
        assert theirs[0] in mine[:2] and mine[0] in theirs[:2], question
        assert set(theirs) <= set(mine) or len(set(mine) & set(theirs)) >= 2, question
        scores = [s for _, s in corpus.retrieve(question, 3).hits]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0


def test_hybrid_search_fuses_bm25_with_dense_vectors(milvus):
    uri, client = milvus
    embedder = embedders.make_embedder("hashing")
    counts = mc.ingest(PASSAGES, client, "dense", embedder=embedder)
    assert counts == {"passages": len(PASSAGES), "kept": len(PASSAGES), "inserted": len(PASSAGES)}
    corpus = mc.MilvusCorpus(uri, "dense", client=client, embedder=embedder)
    assert corpus.stats()["search"] == "hybrid (BM25 + dense, RRF)"
    hits = corpus.retrieve("Where was Lina Berg born?", 3).hits
    assert corpus[hits[0][0]].title == "Lina Berg" and hits[0][1] == pytest.approx(1.0, abs=0.05)
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(hits))
    # Without the embedder the same collection is searched by BM25 alone.
    assert mc.MilvusCorpus(uri, "dense", client=client).stats()["search"] == "BM25 full text"


def test_an_interrupted_ingestion_resumes_and_inserts_nothing_twice(milvus):
    uri, client = milvus

    class Flaky:
        """The real client, failing on its second insert, as a dropped connection would."""

        def __init__(self) -> None:
            self.inserts = 0

        def __getattr__(self, name):
            return getattr(client, name)

        def insert(self, collection, rows):
            self.inserts += 1
            if self.inserts == 2:
                raise ConnectionError("connection dropped")
            return client.insert(collection, rows)

    many = [{"title": f"T{i}", "text": f"passage number {i} about topic {i % 7}"} for i in range(25)]
    with pytest.raises(ConnectionError):
        mc.ingest(many, Flaky(), "resume", batch=10)
    assert mc.MilvusCorpus(uri, "resume", client=client).__len__() == 10
    counts = mc.ingest(many, client, "resume", batch=10)
    assert counts["inserted"] == 15 and len(mc.MilvusCorpus(uri, "resume", client=client)) == 25
    assert mc.ingest(many, client, "resume", batch=10)["inserted"] == 0  # a third run adds nothing


def test_each_error_is_clear(milvus, tmp_path):
    uri, client = milvus
    with pytest.raises(mc.MilvusError, match=r"cannot reach Milvus at http://127\.0\.0\.1:9/"):
        mc.connect("http://user:secret@127.0.0.1:9/", timeout=2)
    with pytest.raises(mc.MilvusError, match="no collection 'missing'"):
        mc.MilvusCorpus(uri, "missing", client=client)
    from pymilvus import DataType

    schema = client.create_schema(auto_id=True)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("v", DataType.FLOAT_VECTOR, dim=2)
    index = client.prepare_index_params()
    index.add_index(field_name="v", index_type="FLAT", metric_type="L2")
    client.create_collection("other", schema=schema, index_params=index)
    with pytest.raises(mc.MilvusError, match="not a BRAG collection: it lacks the fields pid, title, text"):
        mc.MilvusCorpus(uri, "other", client=client)
    with pytest.raises(mc.MilvusError, match="not a BRAG collection"):
        mc.ingest(PASSAGES, client, "other")


def test_the_index_command_ingests_into_milvus(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(f'{{"title": "T{i}", "text": "words {i} and more"}}' for i in range(7)))
    uri = str(tmp_path / "cli.db")
    command = [sys.executable, "-m", "brag", "index", str(docs), "--milvus", uri, "--collection", "cli"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "7 passages, 7 kept, 7 inserted" in result.stdout
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "7 passages, 7 kept, 0 inserted" in again.stdout
    client = mc.connect(uri)
    assert len(mc.MilvusCorpus(uri, "cli", client=client)) == 7
    client.close()


def test_the_owners_milvus_collection_is_offered_in_the_app_and_named_in_the_report(tmp_path):
    from app_server import AppProcess
    from gradio_client import Client
    from openai_server import FakeOpenAI, Reply

    # Milvus Lite is one process's file: the index command writes it and exits, then the app opens it.
    uri = str(tmp_path / "owner.db")
    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(PASSAGES))
    command = [sys.executable, "-m", "brag", "index", str(docs), "--milvus", uri, "--collection", "norway"]
    assert subprocess.run(command, capture_output=True, cwd=ROOT, timeout=300).returncode == 0

    def reader(request):
        prompt = request["messages"][-1]["content"]
        if "Passages:" in prompt and "born in Bergen" in prompt:
            return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg"])
        return Reply(texts=["NONE"] * request.get("n", 1))

    env = {"BRAG_MILVUS_URI": uri, "BRAG_MILVUS_COLLECTIONS": "norway", "BRAG_MILVUS_TOKEN": "tok-SECRET-1"}
    with FakeOpenAI(handler=reader) as server, AppProcess({**env, "BRAG_MODEL": server.url + "#m"}) as app:
        caller = Client(app.url, verbose=False)
        args = ["Where was the architect Lina Berg born?", "norway", "", 0.05, "", "", "auto", ""]
        answer, report = caller.predict(*args, api_name="/brag")
        assert (
            answer == "Bergen"
            and report["server"]["corpus"] == "norway"
            and report["server"]["engine"] == "milvus"
        )
        assert "tok-SECRET-1" not in json.dumps(report) and "tok-SECRET-1" not in app.log()


def test_a_refused_token_is_named_and_never_shown():
    """A real gRPC server on loopback refusing every call as Milvus's authentication does."""
    from concurrent import futures

    import grpc

    seen: list[dict] = []

    class Refuse(grpc.GenericRpcHandler):
        def service(self, details):
            seen.append(dict(details.invocation_metadata))

            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "auth check failure, please check the token")

            return grpc.unary_unary_rpc_method_handler(deny)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Refuse(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(mc.MilvusError) as refused:
            mc.connect(f"http://127.0.0.1:{port}", token="root:WRONG-secret", timeout=5)
    finally:
        server.stop(None)
    assert str(refused.value) == f"Milvus at http://127.0.0.1:{port} refused the token"
    assert any("authorization" in metadata for metadata in seen)  # the token was sent, then refused


def test_dense_vectors_are_searched_with_the_embedder_that_made_them(milvus):
    uri, client = milvus
    mc.ingest(PASSAGES, client, "recorded", embedder=brag.HashingEmbedder())
    opened = mc.open_corpus(uri, "recorded")
    assert (
        opened.stats()["search"] == "hybrid (BM25 + dense, RRF)" and opened.stats()["embedder"] == "hashing"
    )
    assert opened[opened.retrieve("Where was Lina Berg born?", 1).hits[0][0]].title == "Lina Berg"
    with pytest.raises(mc.MilvusError, match="dense vectors from hashing, not other-embedder"):
        mc.MilvusCorpus(uri, "recorded", client=client, embedder=brag.HashingEmbedder(name="other-embedder"))
    assert mc.open_corpus(uri, "demo").stats()["search"] == "BM25 full text"  # no vectors: BM25


def labelled_questions(copies: int) -> list[dict]:
    """Questions about PASSAGES with their gold answers and supporting passages."""
    facts = [
        ("Where was Lina Berg born?", "Bergen", ["Lina Berg"]),
        ("Who designed the Glass Tower?", "Lina Berg", ["Glass Tower"]),
        ("Which city has the Nidaros Cathedral?", "Trondheim", ["Trondheim"]),
        # Its second passage shares no word with it: a weak window, for the gate's fit.
        ("Who designed the Glass Tower, what is it near?", "Lina Berg", ["Glass Tower", "Fjord"]),
    ]
    text = {p["title"]: p["text"] for p in PASSAGES}
    return [
        {
            "id": f"q{i}-{n}",
            "question": question,
            "answer": [gold],
            "paragraphs": [{"title": t, "text": text[t], "is_supporting": True} for t in titles],
        }
        for n in range(copies)
        for i, (question, gold, titles) in enumerate(facts)
    ]


def reads_the_passages(request):
    """A reader that answers from the passages in its prompt, so a right answer shows retrieval."""
    from openai_server import Reply

    prompt = request["messages"][-1]["content"]
    if "Passages:" not in prompt:
        return Reply(texts=["NONE"] * request.get("n", 1))
    passages = prompt.split("Passages:", 1)[1]
    for clue, answer in (("born in Bergen", "Bergen"), ("architect Lina Berg", "Lina Berg")):
        if clue in passages:
            return Reply(texts=[f"Answer: {answer}\nFollow-up query: {answer}"])
    if "Nidaros Cathedral stands" in passages:
        return Reply(texts=["Answer: Trondheim\nFollow-up query: Trondheim"])
    return Reply(texts=["Answer: NONE\nFollow-up query: Norway"])


def test_calibration_and_the_benchmark_retrieve_from_a_milvus_collection(tmp_path):
    from openai_server import FakeOpenAI

    import calibrate

    sys.path.insert(0, str(ROOT / "bench"))
    import run as bench_run

    uri = str(tmp_path / "served.db")
    client = mc.connect(uri)
    mc.ingest(PASSAGES, client, "served")
    client.close()
    # No corpus file anywhere: every passage the reader sees comes from the collection.
    data = tmp_path / "data" / "hotpotqa"
    data.mkdir(parents=True)
    (data / "hotpotqa_ircot500.json").write_text(json.dumps(labelled_questions(16)))
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps(labelled_questions(8)))
    served = ["--milvus", uri, "--collection", "served"]
    with FakeOpenAI(handler=reads_the_passages) as server:
        model = server.url + "#m"
        out = tmp_path / "cal.json"
        cache = ["--cache", str(tmp_path / "c.sqlite")]
        args = ["--questions", str(questions), *served, "--model", model, *cache, "--split", "0:30"]
        assert calibrate_cli.main([*args, "--out", str(out)]) == 0
        # The outcomes stay beside the fit, for `calibrate.py pool`.
        kept = calibrate.read_outcomes(out)
        assert [o.id for o in kept] == json.loads(out.read_text())["split_ids"]
        results = tmp_path / "results"
        results.mkdir()
        bench = ["--datasets", "hotpotqa", "--n", "3", "--data", str(tmp_path / "data"), *cache]
        assert bench_run.main(["--model", model, "--out", str(results), *bench, *served]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["corpus"] == "served" and fitted["diagnostics"]["R1"]["accuracy"] == 1.0
    table = json.loads((results / "benchmark.json").read_text())[0]["rows"]
    assert [row[0] for row in table["Vanilla RAG"]] == [1, 1, 1]  # right from Milvus's passages
    assert "--milvus" in (results / "benchmark.md").read_text()
    gate = tmp_path / "gate.json"
    assert calibrate_cli.main(["gate", "--questions", str(questions), *served, "--out", str(gate)]) == 0
    fitted_gate = json.loads(gate.read_text())
    assert fitted_gate["n"] == 32 and fitted_gate["weak_rate"] == pytest.approx(1 / 4)  # one fact in 4


def test_a_corpus_is_a_file_or_a_collection_not_both(tmp_path, capsys):

    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(labelled_questions(1)))
    corpus = tmp_path / "c.json"
    corpus.write_text(json.dumps(PASSAGES))
    for extra in (
        [],
        ["--corpus", str(corpus), "--milvus", "x.db", "--collection", "c"],
        ["--milvus", "x.db"],
    ):
        assert calibrate_cli.main(["gate", "--questions", str(questions), *extra, "--out", "-"]) == 2
        said = capsys.readouterr().err
        assert "calibrate gate:" in said and "--milvus" in said and "Traceback" not in said
    assert not (tmp_path / "never-made.db").exists()  # refused before anything was opened


def test_term_counts_are_cached_within_a_bound(milvus):
    uri, client = milvus
    corpus = mc.MilvusCorpus(uri, "demo", client=client, cache_size=3)
    for term in ("norway", "oslo", "bergen", "fjord", "city"):
        corpus.document_share(term)
    assert list(corpus._shares) == ["bergen", "fjord", "city"]  # the last three, oldest first
    assert corpus.document_share("bergen") == pytest.approx(2 / len(PASSAGES))
    assert list(corpus._shares)[-1] == "bergen"  # used again: now the newest


JAPANESE = [
    {"title": "東京タワー", "text": "東京タワーは1958年に完成した電波塔で、設計者は内藤多仲です。"},
    {"title": "大阪城", "text": "大阪城は豊臣秀吉が築いた城で、天守閣は1931年に再建されました。"},
    {"title": "富士山", "text": "富士山は標高3776メートルの日本最高峰の火山です。"},
    {"title": "京都", "text": "京都は794年から1869年まで日本の都でした。金閣寺があります。"},
    {"title": "札幌", "text": "札幌は北海道の道庁所在地で、雪まつりで知られています。"},
    {"title": "故宫", "text": "故宫位于北京中轴线的中心，是明清两代的皇家宫殿。"},
    {"title": "西湖", "text": "西湖位于浙江省杭州市，是中国主要的观赏性淡水湖泊之一。"},
]
JAPANESE_QUESTIONS = {
    "東京タワーの設計者は誰ですか": "東京タワー",
    "天守閣はいつ再建されましたか": "大阪城",
    "日本最高峰の山の標高は": "富士山",
    "雪まつりで知られる都市は": "札幌",
    "金閣寺がある都はどこ": "京都",
    "明清两代的皇家宫殿在哪里？": "故宫",
    "杭州市的湖泊叫什么？": "西湖",
}


def test_a_japanese_and_chinese_collection_ranks_as_corpus_does(tmp_path):
    uri = str(tmp_path / "ja.db")
    client = mc.connect(uri)
    mc.ingest(JAPANESE, client, "ja")
    corpus = mc.MilvusCorpus(uri, "ja", client=client)
    reference = brag.Corpus(JAPANESE)
    # The collection records the analysis brag.Corpus chose for the same passages.
    assert corpus.analyzer == reference.analyzer == brag.Analyzer("en", by_script=True)
    assert corpus.stats()["analysis"] == reference.stats()["analysis"]
    for question, title in JAPANESE_QUESTIONS.items():
        mine = [corpus[pid].title for pid, _ in corpus.retrieve(question, 3).hits]
        theirs = [reference[i].title for i, s in reference.retrieve(question, 3).hits if s > 0]
        assert mine[0] == theirs[0] == title, question
    # A bigram counts as one term, as it does in brag.Corpus.
    assert corpus.document_share("日本") == reference.document_share("日本") == pytest.approx(2 / 7)
    assert corpus.document_share("北京") == pytest.approx(1 / 7)
    client.close()


def test_a_collection_made_before_brag_analysed_its_text_is_still_searched(tmp_path):
    uri = str(tmp_path / "old.db")
    client = mc.connect(uri)
    # Such a collection has no analysis property, and holds the raw title and text.
    mc.create_collection(client, "old")
    client.drop_collection_properties("old", property_keys=[mc.ANALYSIS_PROPERTY])
    mc.ingest(PASSAGES, client, "old")
    corpus = mc.MilvusCorpus(uri, "old", client=client)
    assert corpus.analyzer is None and corpus.stats()["analysis"] == "milvus standard (legacy)"
    assert corpus[corpus.retrieve("Where was Lina Berg born?", 1).hits[0][0]].title == "Lina Berg"
    assert corpus.document_share("norway") > 0
    client.alter_collection_properties("old", {mc.ANALYSIS_PROPERTY: "stemmed/9:words:en"})
    with pytest.raises(mc.MilvusError, match="into a new collection"):
        mc.MilvusCorpus(uri, "old", client=client)
    client.close()


def test_an_empty_collection_gives_the_gate_its_signals_and_brag_a_clear_answer(tmp_path):
    uri = str(tmp_path / "empty.db")
    client = mc.connect(uri)
    mc.create_collection(client, "empty")
    corpus = mc.MilvusCorpus(uri, "empty", client=client)
    assert len(corpus) == 0 and corpus.retrieve("Where was Lina Berg born?", 5).hits == []
    # The gate's rare-term signal divides by the collection's size: nothing to be rare in here.
    signals = brag.window_signals("Where was Lina Berg born in 1961?", corpus, [], 5)
    assert signals["salient_terms"] == 3.0 and signals["evidence_coverage"] == 0.0  # lina, berg, 1961
    gated = brag.load_calibration(brag.CALIBRATIONS_DIR / "qwen2.5-coder-0.5b-hotpotqa.json")
    assert gated.gate is not None
    llm = ScriptedLLM(
        read=lambda p: "Answer: NONE\nFollow-up query: Lina Berg", closed_book=lambda p, n: ["Oslo"] * n
    )
    _, report = brag.BRAG(llm, calibration=gated).run("Where was Lina Berg born in 1961?", corpus)
    assert report["gate"]["R1"]["signals"]["salient_terms"] == 3.0 and report["steps"]
    client.close()
