"""Japanese and Chinese documents end to end over the app: uploaded as files with their own
names, retrieved, answered in their language by a loopback reader, and quoted."""

from __future__ import annotations

import threading

import pytest
from app_server import AppProcess
from conftest import PRIORS
from document_files import docx_bytes
from gradio_client import Client, handle_file
from openai_server import FakeOpenAI, Reply

# Sections of other topics come first, so only retrieval that matches the question's words puts
# the answering section in the window: read in input order, the first five never hold it.
JAPANESE_SECTIONS = [
    ("富士山", "富士山は静岡県と山梨県にまたがる活火山で、標高は3776メートルです。"),
    ("大阪城", "大阪城は豊臣秀吉が築いた城で、現在の天守閣は1931年に再建されました。"),
    ("京都", "京都は794年から1869年まで日本の都であり、金閣寺や清水寺があります。"),
    ("札幌", "札幌は北海道の道庁所在地で、毎年2月のさっぽろ雪まつりで知られています。"),
    ("厳島神社", "厳島神社は広島県の宮島にある神社で、海上に立つ大鳥居が有名です。"),
    ("姫路城", "姫路城は兵庫県にある城で、白鷺城とも呼ばれる世界遺産です。"),
    ("琵琶湖", "琵琶湖は滋賀県にある日本最大の湖で、京阪神の水源となっています。"),
    ("東京タワー", "東京タワーは1958年に完成した電波塔で、設計者は内藤多仲です。高さは333メートルです。"),
]
CHINESE_SECTIONS = [
    ("长城", "长城是中国古代的军事防御工程，总长度超过两万公里。"),
    ("西湖", "西湖位于浙江省杭州市，是中国主要的观赏性淡水湖泊之一。"),
    ("黄山", "黄山位于安徽省南部，以奇松、怪石、云海、温泉闻名。"),
    ("兵马俑", "兵马俑位于陕西省西安市临潼区，是秦始皇陵的陪葬坑。"),
    ("布达拉宫", "布达拉宫位于西藏自治区拉萨市，是世界上海拔最高的宫殿之一。"),
    ("泰山", "泰山位于山东省泰安市，是五岳之首。"),
    ("故宫", "故宫位于北京中轴线的中心，是明清两代的皇家宫殿，旧称紫禁城。"),
]
ANSWERS = {"設計者は内藤多仲です": "内藤多仲", "旧称紫禁城": "北京"}


class Reader:
    """Answers in the passages' language when the answering sentence is in the prompt."""

    def __init__(self) -> None:
        self.instructions: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: dict) -> Reply:
        with self.lock:
            self.instructions.append(request["messages"][0]["content"])
        prompt = request["messages"][-1]["content"]
        if "Passages:" not in prompt:
            return Reply(texts=["Answer: NONE"] * int(request.get("n") or 1))
        for sentence, answer in ANSWERS.items():
            if sentence in prompt:
                return Reply(texts=[f"答え：{answer}\nFollow-up query: {answer}"])
        return Reply(texts=["Answer: なし\nFollow-up query: 設計者"])


@pytest.fixture(scope="module")
def reader():
    reader = Reader()
    with FakeOpenAI(handler=reader) as server:
        server.reader = reader
        yield server


@pytest.fixture(scope="module")
def client(reader):
    env = {"BRAG_MODEL": reader.url + "#reader", "HF_TOKEN": ""}
    with AppProcess(env) as app:
        yield Client(app.url, verbose=False)


def ask(client: Client, question: str, files: list) -> tuple[str, dict]:
    inputs = [question, "", "", 0.05, "", "", "auto", PRIORS.read_text()]
    return client.predict(*inputs, "tokens", None, None, files, api_name="/brag")


def test_a_japanese_document_is_retrieved_answered_and_quoted_under_its_own_name(client, reader, tmp_path):
    notes = tmp_path / "日本の名所.md"
    notes.write_text(
        "\n\n".join(f"# {title}\n\n{text}" for title, text in JAPANESE_SECTIONS), encoding="utf-8"
    )
    answer, report = ask(client, "東京タワーの設計者は誰ですか？", [handle_file(str(notes))])
    assert answer == "内藤多仲"
    assert report["server"]["corpus"] == "日本の名所.md"
    assert report["confidence"]["source"]["passage"] == "日本の名所.md › 東京タワー"
    assert "設計者は内藤多仲です" in report["confidence"]["source"]["quote"]
    assert report["confidence"]["supported"]
    first_read = next(s for s in report["steps"] if s["action"] == "R1")
    assert first_read["observation"]["passages"][0]["title"] == "日本の名所.md › 東京タワー"
    assert any(i.endswith("in Japanese, the language of the question.") for i in reader.reader.instructions)


def test_a_chinese_word_file_is_retrieved_answered_and_quoted(client, reader, tmp_path):
    blocks = [block for title, text in CHINESE_SECTIONS for block in ((1, title), (0, text))]
    word = tmp_path / "中国名胜.docx"
    word.write_bytes(docx_bytes(blocks))
    answer, report = ask(client, "明清两代的皇家宫殿在哪个城市？", [handle_file(str(word))])
    assert answer == "北京"
    assert report["server"]["corpus"] == "中国名胜.docx"
    assert report["confidence"]["source"]["passage"] == "中国名胜.docx › 故宫"
    assert any(i.endswith("in Chinese, the language of the question.") for i in reader.reader.instructions)
