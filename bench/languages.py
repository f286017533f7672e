"""Documents in other languages: retrieval recall, end-to-end answers, and index cost.

The text is Debian's translated manual pages (``manpages-ja``, ``manpages-zh``, ``manpages-de``,
``manpages-fr``: sections 1 and 8, rendered to plain text by ``man``), which nobody on this
project wrote. Each question is made from one page's NAME line ("ls - ディレクトリの内容をリスト
表示する"): "which command <description>?", in the page's language, answered by the command, and
the passage holding that line answers it. The questions reuse the description's words, so recall
measures whether an analysis lets the words of a language match at all, not paraphrase.

    python bench/languages.py fetch --pages DIR        # apt-get download, dpkg-deb -x, man
    python bench/languages.py questions --pages DIR    # bench/languages/LANG.json
    python bench/languages.py recall --pages DIR [--code OLD_CHECKOUT --label before]
    python bench/languages.py answers --pages DIR      # through /brag, embedded model
    python bench/languages.py scale --pages DIR        # 100,000 passages: Japanese vs English
    python bench/languages.py report                   # bench/results/languages.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ``--code DIR`` measures another checkout's brag (the code before a change) with this script.
CODE = Path(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else ROOT
sys.path.insert(0, str(ROOT / "tests"))  # app_server: a real app on a loopback port
sys.path.insert(0, str(CODE))

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import brag
from bragkit import documents

QUESTIONS_DIR = ROOT / "bench" / "languages"
RESULTS = ROOT / "bench" / "results"
PACKAGES = {"ja": "manpages-ja", "zh": "manpages-zh", "de": "manpages-de", "fr": "manpages-fr"}
MAN_FOLDERS = {"ja": "ja", "zh": "zh_CN", "de": "de", "fr": "fr"}
NAMES = {"ja": "Japanese", "zh": "Chinese", "de": "German", "fr": "French"}
SECTIONS = ("1", "8")
PER_LANGUAGE = 60
END_TO_END = 20
UPLOADED = 10  # files per /brag request, as the sets were measured (BRAG_MAX_FILES was 10 then; now 300)
K = 5
# "which command <description>?" in each language; the description keeps its own words.
TEMPLATES = {
    "ja": "{d}コマンドは何ですか？",
    "zh": "哪个命令用于{d}？",
    "de": "Welcher Befehl dient dazu: {d}?",
    "fr": "Quelle commande sert à : {d} ?",
}
# "what does the command X do?", for answers a reader has to write in the language.
ASK_WHAT = {
    "ja": "{c} コマンドは何をしますか？",
    "zh": "{c} 命令的作用是什么？",
    "de": "Was macht der Befehl {c}?",
    "fr": "Que fait la commande {c} ?",
}
NAME_LINE = re.compile(r"^\s+([\w.+-]+(?:\s*,\s*[\w.+-]+)*)\s+[-‐—–]\s+(.+)$")


# ------------------------------------------------------------------------------------------
# The pages: fetched from Debian, rendered by man
# ------------------------------------------------------------------------------------------


def render(page: Path) -> str:
    """A manual page as plain text: no hyphenation, no justification, no overstrike ("" if man hangs)."""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "100", "MANPAGER": "cat", "PAGER": "cat"}
    try:
        shown = subprocess.run(
            ["man", "--nh", "--nj", "-E", "UTF-8", "-l", str(page)],
            capture_output=True,
            env=env,
            timeout=20,
            stdin=subprocess.DEVNULL,
        ).stdout
    except subprocess.TimeoutExpired:
        return ""
    return subprocess.run(["col", "-b"], input=shown, capture_output=True, timeout=60).stdout.decode(
        "utf-8", "replace"
    )


def fetch(pages: Path) -> None:
    """Download the four packages, unpack them, and render their pages (and the English ones)."""
    work = Path(tempfile.mkdtemp())
    subprocess.run(["apt-get", "download", *PACKAGES.values()], cwd=work, check=True)
    versions = {}
    for language, package in PACKAGES.items():
        deb = next(work.glob(f"{package}_*.deb"))
        versions[language] = deb.name
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / language)], check=True)
        sources = [
            p
            for section in SECTIONS
            for p in sorted(
                (work / language / "usr/share/man" / MAN_FOLDERS[language] / f"man{section}").glob("*.gz")
            )
        ]
        out = pages / language
        out.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(4) as pool:
            for source, text in zip(sources, pool.map(render, sources), strict=True):
                if text.strip():
                    (out / (source.name.removesuffix(".gz") + ".txt")).write_text(text, encoding="utf-8")
    english = pages / "en"
    english.mkdir(exist_ok=True)
    wanted = {p.name for language in PACKAGES for p in (pages / language).glob("*.txt")}
    for name in sorted(wanted):
        source = Path("/usr/share/man") / f"man{name.split('.')[-2]}" / (name.removesuffix(".txt") + ".gz")
        if source.exists():
            (english / name).write_text(render(source), encoding="utf-8")
    (pages / "packages.json").write_text(json.dumps(versions, indent=1))
    shutil.rmtree(work)


def name_line(text: str) -> tuple[str, str] | None:
    """The page's command and its one-line description, from the NAME section's first line."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:12]):
        if line.strip() and not line.startswith(" ") and i + 1 < len(lines):
            found = NAME_LINE.match(lines[i + 1])
            if found and i > 0:
                rest = [found.group(2)]
                for more in lines[i + 2 :]:  # a description can go on over the next lines
                    if not more.strip() or not more.startswith(" "):
                        break
                    rest.append(more)
                return found.group(1).split(",")[0].strip(), " ".join(" ".join(rest).split())
    return None


# ------------------------------------------------------------------------------------------
# Questions
# ------------------------------------------------------------------------------------------


def make_questions(pages: Path) -> None:
    """``PER_LANGUAGE`` questions per language from pages with a distinct, long description."""
    QUESTIONS_DIR.mkdir(exist_ok=True)
    for language in PACKAGES:
        found: dict[str, tuple[str, str]] = {}
        seen: dict[str, int] = {}
        for page in sorted((pages / language).glob("*.txt")):
            line = name_line(page.read_text(encoding="utf-8"))
            if line is None:
                continue
            command, description = line
            seen[description] = seen.get(description, 0) + 1
            long_enough = len(description) >= 8 if language in ("ja", "zh") else len(description.split()) >= 3
            if long_enough and command.lower() in page.name.lower():
                found[page.name] = (command, description)
        usable = sorted(name for name, (_, d) in found.items() if seen[d] == 1)
        picked = sorted(random.Random(f"brag-{language}").sample(usable, PER_LANGUAGE))
        items = []
        for name in picked:
            command, description = found[name]
            described = description.rstrip("。.")
            if language == "fr":
                described = described[0].lower() + described[1:]
            items.append(
                {
                    "id": f"{language}-{name.removesuffix('.txt')}",
                    "question": TEMPLATES[language].format(d=described),
                    "answer": [command],
                    "file": name,
                    "description": description,
                    "what": ASK_WHAT[language].format(c=command),
                }
            )
        (QUESTIONS_DIR / f"{language}.json").write_text(
            json.dumps(items, ensure_ascii=False, indent=1) + "\n"
        )
        print(language, len(usable), "usable pages;", len(items), "questions", file=sys.stderr)


def load_questions(language: str) -> list[dict[str, Any]]:
    return json.loads((QUESTIONS_DIR / f"{language}.json").read_text(encoding="utf-8"))


def read_pages(folder: Path) -> list[brag.Passage]:
    files = [(p.name, p.read_bytes()) for p in sorted(folder.glob("*.txt"))]
    limits = documents.FileLimits(files=len(files), total_bytes=1 << 34, text_chars=1 << 34)
    return documents.read_files(files, limits)


def holds(passage: brag.Passage, item: dict[str, Any]) -> bool:
    """Whether ``passage`` is the one that answers ``item``: its page's, holding the description."""
    return passage.doc_id == item["file"] and " ".join(item["description"].split()) in " ".join(
        passage.text.split()
    )


# ------------------------------------------------------------------------------------------
# Recall
# ------------------------------------------------------------------------------------------


def recall_of(retrieve: Any, items: list[dict[str, Any]], key: str = "question") -> float:
    found = 0
    for item in items:
        found += any(holds(p, item) for p in retrieve(item[key]))
    return found / len(items)


def hotpotqa_recall(root: Path) -> float:
    """recall@5 of the 400 supporting paragraphs of HotpotQA's 200 test questions (bench/documents.py)."""
    corpus_items = json.loads((root / "hotpotqa/hotpotqa_ircot500_corpus.json").read_text(encoding="utf-8"))
    questions = json.loads((root / "hotpotqa/hotpotqa_ircot500.json").read_text(encoding="utf-8"))[60:260]
    corpus = brag.Corpus(corpus_items)
    titles = {item["title"] for item in corpus_items}
    found = wanted = 0
    for q in questions:
        supporting = [p["title"] for p in q["paragraphs"] if p.get("is_supporting") and p["title"] in titles]
        hits = {corpus[i].title for i, _ in corpus.retrieve(q["question"], K).hits}
        wanted += len(supporting)
        found += sum(title in hits for title in supporting)
    return found / wanted


def recall(pages: Path, label: str, milvus: bool) -> None:
    """recall@K per language for brag.Corpus (and Milvus Lite), with this checkout's code."""
    from bragkit import milvus as milvus_corpus

    rows: dict[str, Any] = {}
    for language in PACKAGES:
        items = load_questions(language)
        passages = read_pages(pages / language)
        corpus = brag.Corpus(passages)
        search = lambda q, c=corpus: [c[i] for i, _ in c.retrieve(q, K).hits]  # noqa: E731
        row = {
            "passages": len(corpus),
            "corpus": recall_of(search, items),
            "corpus_what": recall_of(search, items, "what"),
        }
        if milvus:
            with tempfile.TemporaryDirectory() as folder:
                client = milvus_corpus.connect(str(Path(folder) / "lang.db"))
                milvus_corpus.ingest(passages, client, language)
                collection = milvus_corpus.MilvusCorpus("", language, client=client)
                search = lambda q, c=collection: [c[i] for i, _ in c.retrieve(q, K).hits]  # noqa: E731
                row["milvus"], row["milvus_what"] = recall_of(search, items), recall_of(search, items, "what")
                client.close()
        rows[language] = row
        print(label, language, row, file=sys.stderr, flush=True)
    data_dir = Path(os.environ.get("BRAG_DATA_DIR", ROOT.parent / "shared" / "data"))
    rows["hotpotqa"] = {"corpus": hotpotqa_recall(data_dir)}
    save("recall", label, rows)


def save(kind: str, label: str, value: Any) -> None:
    path = RESULTS / "languages.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(kind, {})[label] = value
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")


# ------------------------------------------------------------------------------------------
# End to end: /brag with the files uploaded, the embedded model
# ------------------------------------------------------------------------------------------


def in_language(answer: str, language: str, item: dict[str, Any], english: str | None) -> bool:
    """Whether ``answer`` is written in ``language``.

    Japanese: kana or Han; Chinese: Han and no kana. German and French: the answer is closer
    (token F1) to the page's description in that language than to the English page's, or,
    without an English page, brag.language_of does not call it English.
    """
    if language == "ja":
        return re.search("[\u3040-\u30ff\u4e00-\u9fff]", answer) is not None
    if language == "zh":
        return (
            re.search("[\u4e00-\u9fff]", answer) is not None and re.search("[\u3040-\u30ff]", answer) is None
        )
    if english:
        return brag.token_f1(answer, item["description"]) >= brag.token_f1(answer, english) and bool(
            brag.normalize_answer(answer)
        )
    return brag.language_of(answer) != "en"


def answers(pages: Path, languages: list[str]) -> None:
    """``END_TO_END`` questions per language through /brag: accuracy and the answers' language.

    Each request uploads ``UPLOADED`` pages of that language, as a user would (the app's limit of
    files per request): the page that answers and others. The question is "what does the
    command X do?" in the language; an answer is right when its token F1 with the page's
    description (by character, for Japanese and Chinese) is at least 0.5.
    """
    from app_server import AppProcess
    from gradio_client import Client, handle_file

    rows: dict[str, list[dict[str, Any]]] = {}
    with AppProcess({"BRAG_MODEL": "local", "HF_TOKEN": ""}, startup_timeout=300) as app:
        client = Client(app.url, verbose=False)
        for language in languages:
            items = load_questions(language)[:END_TO_END]
            others = sorted(p.name for p in (pages / language).glob("*.txt"))
            rows[language] = []
            for number, item in enumerate(items):
                rng = random.Random(item["id"])
                chosen = [item["file"], *rng.sample([o for o in others if o != item["file"]], UPLOADED - 1)]
                files = [handle_file(str(pages / language / name)) for name in chosen]
                english_page = pages / "en" / item["file"]
                english = name_line(english_page.read_text()) if english_page.exists() else None
                for kind, question in [("what", item["what"])]:
                    inputs = [question, "", "", 0.05, "", "", "auto", "", "tokens", None, None]
                    answer, report = client.predict(*inputs, files, api_name="/brag")
                    right = (
                        brag.exact_match(answer, item["answer"])
                        if kind == "which"
                        else brag.token_f1(answer, item["description"]) >= 0.5
                    )
                    rows[language].append(
                        {
                            "id": item["id"],
                            "kind": kind,
                            "answer": answer,
                            "right": bool(answer) and right,
                            "in_language": bool(answer)
                            and in_language(answer, language, item, english[1] if english else None),
                            "calls": report["totals"]["llm_calls"],
                            "read": any(
                                holds(brag.Passage(p["title"], p.get("text", ""), item["file"]), item)
                                or p["title"].startswith(item["file"])
                                for s in report["steps"]
                                for p in (s.get("observation") or {}).get("passages", [])
                            ),
                            "source": (report["confidence"].get("source") or {}).get("passage"),
                        }
                    )
                    print(language, number, rows[language][-1], file=sys.stderr, flush=True)
    path = RESULTS / "languages.json"
    earlier = json.loads(path.read_text()).get("answers", {}).get("after", {}) if path.exists() else {}
    save("answers", "after", {**earlier, **rows})  # a run of some languages keeps the others


# ------------------------------------------------------------------------------------------
# Scale: index time and memory, Japanese against English of the same size in bytes
# ------------------------------------------------------------------------------------------


def sentences(texts: list[str], pattern: str) -> list[str]:
    return [s.strip() for t in texts for s in re.split(pattern, t) if len(s.strip()) > 10]


def synthetic(pool: list[str], passages: int, target_bytes: int, seed: int) -> list[str]:
    """``passages`` distinct passages of about ``target_bytes`` in all, each a few sentences."""
    rng = random.Random(seed)
    per = target_bytes / passages
    out = []
    for _ in range(passages):
        chosen, size = [], 0
        while size < per:
            chosen.append(rng.choice(pool))
            size += len(chosen[-1].encode())
        out.append(" ".join(chosen))
    return out


def index_cost(texts: list[str]) -> dict[str, float]:
    """Seconds and peak memory of indexing ``texts`` in a fresh process (``--code``'s brag)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    command = [sys.executable, __file__, "index-one", "--texts", f.name, "--code", str(CODE)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    os.unlink(f.name)
    return json.loads(done.stdout)


def index_one(path: Path) -> None:
    """Index the texts in ``path`` once; print seconds, the peak-RSS increase and the vocabulary."""
    texts = json.loads(path.read_text(encoding="utf-8"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    corpus = brag.Corpus(texts)
    seconds = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"seconds": seconds, "peak_mb": peak, "vocabulary": len(corpus._vocab)}))


def scale(pages: Path, passages: int, runs: int) -> None:
    """Index time and memory of ``passages`` Japanese passages and English ones of equal bytes."""
    japanese = sentences(
        [p.read_text(encoding="utf-8") for p in sorted((pages / "ja").glob("*.txt"))], r"(?<=。)|\n\s*\n"
    )
    english = sentences(
        [p.read_text(encoding="utf-8") for p in sorted((pages / "en").glob("*.txt"))], r"(?<=\.)\s|\n\s*\n"
    )
    ja = synthetic(japanese, passages, 60_000_000, 1)
    size = sum(len(t.encode()) for t in ja)
    # English sentences are longer, so passages overshoot more: aim lower until the sizes agree.
    aim = size
    for _ in range(3):
        en = synthetic(english, passages, aim, 2)
        aim = int(aim * size / sum(len(t.encode()) for t in en))
    result: dict[str, Any] = {
        "passages": passages,
        "bytes": {"ja": size, "en": sum(len(t.encode()) for t in en)},
    }
    for name, texts in (("ja", ja), ("en", en)):
        measured = [index_cost(texts) for _ in range(runs)]
        result[name] = {
            "seconds": sorted(m["seconds"] for m in measured)[runs // 2],
            "peak_mb": sorted(m["peak_mb"] for m in measured)[runs // 2],
            "vocabulary": measured[0]["vocabulary"],
        }
        print(name, result[name], file=sys.stderr, flush=True)
    result["seconds_per_byte_ratio"] = (result["ja"]["seconds"] / result["bytes"]["ja"]) / (
        result["en"]["seconds"] / result["bytes"]["en"]
    )
    save("scale", "before" if CODE != ROOT else "after", result)


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def report() -> None:
    """``bench/results/languages.md`` from ``languages.json`` and the notes beside it."""
    data = json.loads((RESULTS / "languages.json").read_text())
    how, commands = __doc__.split("\n\n")[1:3]
    lines = ["# Documents in other languages", "", how, ""]
    lines += ["Commands (this machine, 2 cores):", "", "```"]
    lines += [line.strip() for line in commands.strip().splitlines()]
    lines += ["```", ""]
    lines += recall_table(data.get("recall", {}))
    lines += answers_table(data.get("answers", {}).get("after", {}))
    lines += scale_table(data.get("scale", {}))
    notes = RESULTS / "languages_notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    (RESULTS / "languages.md").write_text("\n".join(lines))


def recall_table(rows: dict[str, Any]) -> list[str]:
    if not rows:
        return []
    before, after = rows.get("before", {}), rows.get("after", {})
    lines = [f"## Recall@{K} of the answering passage", ""]
    lines += [
        "| set | question | asked | passages before / after | Corpus | Milvus Lite |",
        "|---|---|---|---|---|---|",
    ]
    for language in PACKAGES:
        b, a = before.get(language, {}), after.get(language, {})
        for suffix, said in (("", "which command …?"), ("_what", "what does … do?")):
            passages = f"{b.get('passages', 0):,} / {a.get('passages', 0):,}"
            corpus, milvus = (
                change(b.get(engine + suffix), a.get(engine + suffix)) for engine in ("corpus", "milvus")
            )
            lines.append(
                f"| {NAMES[language]} | {said} | {PER_LANGUAGE} | {passages} | {corpus} | {milvus} |"
            )
    hotpot = change(before.get("hotpotqa", {}).get("corpus"), after.get("hotpotqa", {}).get("corpus"))
    lines += [f"| HotpotQA, 400 supporting paragraphs | its own | 200 | 4,858 | {hotpot} | |", ""]
    return lines


def answers_table(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    if not rows:
        return []
    lines = [f"## End to end: /brag, {UPLOADED} pages uploaded per request, embedded model", ""]
    lines += [
        "| language | asked | right | in the question's language | page read | calls |",
        "|---|---|---|---|---|---|",
    ]
    for language, answered in rows.items():
        calls = sum(r["calls"] for r in answered) / len(answered)
        lines.append(
            f"| {NAMES[language]} | {len(answered)} | {mean(answered, 'right'):.2f} | "
            f"{mean(answered, 'in_language'):.2f} | {mean(answered, 'read'):.2f} | {calls:.2f} |"
        )
    return [*lines, ""]


def scale_table(runs: dict[str, Any]) -> list[str]:
    if not runs:
        return []
    lines = ["## Index time and memory (median of runs, a fresh process each)", ""]
    lines += [
        "| code | passages | MB ja / en | s ja / en | s per byte, ja / en | peak MB ja / en |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in runs.items():
        lines.append(
            f"| {label} | {s['passages']:,} | {s['bytes']['ja'] / 1e6:.1f} / {s['bytes']['en'] / 1e6:.1f} | "
            f"{s['ja']['seconds']:.1f} / {s['en']['seconds']:.1f} | {s['seconds_per_byte_ratio']:.2f} | "
            f"{s['ja']['peak_mb']:.0f} / {s['en']['peak_mb']:.0f} |"
        )
    return [*lines, ""]


def change(before: float | None, after: float | None) -> str:
    return f"{fmt(before)} → **{fmt(after)}**"


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(bool(r[key]) for r in rows) / len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what", choices=("fetch", "questions", "recall", "answers", "scale", "report", "index-one")
    )
    parser.add_argument("--texts", type=Path, help="index-one: a JSON list of texts")
    parser.add_argument("--pages", type=Path, default=Path(tempfile.gettempdir()) / "brag-manpages")
    parser.add_argument("--code", type=Path, help="another checkout's brag to measure (the code before)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--milvus", action="store_true", help="recall of Milvus Lite too")
    parser.add_argument("--languages", nargs="+", default=["ja", "zh", "de"])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.what == "fetch":
        fetch(args.pages)
    elif args.what == "questions":
        make_questions(args.pages)
    elif args.what == "recall":
        recall(args.pages, args.label, args.milvus)
    elif args.what == "answers":
        answers(args.pages, args.languages)
    elif args.what == "scale":
        scale(args.pages, args.passages, args.runs)
    elif args.what == "index-one":
        index_one(args.texts)
    else:
        report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
