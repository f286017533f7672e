"""The corpora a request can name, each indexed once per process.

The demo and benchmark corpora, the owner's own index (``BRAG_CORPUS_DIR``) and Milvus
collections (``BRAG_MILVUS_URI``), and the documents a request brings, read in capped workers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brag
from bragkit import documents as doc_files
from bragkit import storage
from bragkit.serving import parse_worker

from .inputs import check_documents, documents_from_files
from .limits import Limits, refused, too_big

log = logging.getLogger("brag.app")
HERE = storage.CHECKOUT  # the checkout (or site-packages): data/ is there


DEMO = "Demo"


DEMO_CORPUS_PATH = HERE / "data" / "demo_corpus.json"


HIPPORAG_REPO = "osunlp/HippoRAG_2"


YOUR_DOCUMENTS = "Your documents"


# Display name -> (folder under BRAG_DATA_DIR, local file names to try in order, Hub file name).
# The shared data holds HippoRAG's own 2Wiki corpus and faithful subsets for the other two.
CORPORA: dict[str, tuple[str, tuple[str, ...], str]] = {
    "HotpotQA": (
        "hotpotqa",
        ("hotpotqa_corpus.json", "hotpotqa_ircot500_corpus.json"),
        "hotpotqa_corpus.json",
    ),
    "2WikiMultihopQA": ("2wikimultihopqa", ("2wikimultihopqa_corpus.json",), "2wikimultihopqa_corpus.json"),
    "MuSiQue": ("musique", ("musique_corpus.json", "musique_migres200_corpus.json"), "musique_corpus.json"),
}


def corpus_file(name: str) -> Path:
    """The corpus JSON: from BRAG_DATA_DIR when there, else downloaded once from the Hub."""
    if name == DEMO:
        return DEMO_CORPUS_PATH
    folder, local_names, hub_name = CORPORA[name]
    root = storage.data_dir()
    if root is not None:
        for candidate in (root / folder / f for f in local_names):
            if candidate.is_file():
                return candidate
    from huggingface_hub import hf_hub_download

    repo = os.environ.get("BRAG_CORPUS_REPO", HIPPORAG_REPO)
    try:
        return Path(hf_hub_download(repo_id=repo, filename=hub_name, repo_type="dataset"))
    except Exception as err:  # offline, repository gone, file renamed
        raise refused(f"cannot download the {name} corpus ({hub_name} from {repo}): {err}") from None


@dataclass(frozen=True)
class MilvusSettings:
    """``BRAG_MILVUS_URI`` (with ``BRAG_MILVUS_TOKEN``): the owner's Milvus, never a caller's.

    ``BRAG_MILVUS_COLLECTIONS`` (comma-separated, default ``brag``) are offered in the corpus
    picker under their own names.
    """

    uri: str
    token: str
    collections: tuple[str, ...]

    @classmethod
    def from_env(cls) -> MilvusSettings | None:
        """The owner's Milvus, or None when ``BRAG_MILVUS_URI`` is unset."""
        uri = os.environ.get("BRAG_MILVUS_URI", "").strip()
        if not uri:
            return None
        names = os.environ.get("BRAG_MILVUS_COLLECTIONS", "brag")
        collections = tuple(n.strip() for n in names.split(",") if n.strip())
        if not collections:
            raise SystemExit("BRAG_MILVUS_COLLECTIONS: name at least one collection")
        return cls(uri, os.environ.get("BRAG_MILVUS_TOKEN", ""), collections)


def open_milvus(settings: MilvusSettings, collection: str) -> Any:
    """A Milvus collection as the corpus (``milvus_corpus.py``); a clear error when it cannot be."""
    from bragkit import milvus as milvus_corpus

    try:
        return milvus_corpus.open_corpus(settings.uri, collection, settings.token)
    except milvus_corpus.MilvusError as err:
        raise refused(f"The corpus {collection} is not available: {err}.") from None


def own_index() -> tuple[str, Path] | None:
    """``BRAG_CORPUS_DIR``: the owner's collection, indexed by ``python -m brag index``; its name."""
    configured = os.environ.get("BRAG_CORPUS_DIR", "").strip()
    if not configured:
        return None
    folder = Path(configured)
    try:
        return brag.Corpus.saved_name(folder), folder
    except ValueError:
        raise SystemExit(
            f"BRAG_CORPUS_DIR: {folder} is not a folder written by `python -m brag index`"
        ) from None


class CorpusStore:
    """Named corpora, indexed once and shared; pasted document sets, kept to a memory budget."""

    def __init__(
        self, limits: Limits, own: tuple[str, Path] | None = None, milvus: MilvusSettings | None = None
    ) -> None:
        self.limits, self.own, self.milvus = limits, own, milvus
        self.readers = parse_worker.FileReaders(limits.parse_caps())
        # Every corpus a request may name: the demo, the owner's own index and Milvus
        # collections, and the HippoRAG ones.
        collections = list(milvus.collections) if milvus else []
        self.names = [DEMO, *([own[0]] if own else []), *collections, *CORPORA]
        self._corpora: dict[str, brag.Corpus] = {}
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in self.names}
        # Each pasted set with its memory estimate, taken once: the estimate walks every passage.
        self._documents: OrderedDict[str, tuple[brag.Corpus, int, dict[str, Any] | None]] = OrderedDict()
        self._documents_lock = threading.Lock()
        self.documents_budget = limits.documents_cache_bytes

    def named(self, name: str) -> brag.Corpus:
        """A named corpus, opened once and shared.

        The owner's own index (``BRAG_CORPUS_DIR``) is memory-mapped; a HippoRAG corpus is
        indexed the first time its file is seen and kept under ``BRAG_CACHE_DIR``, so a restart
        memory-maps it instead of indexing it again.
        """
        with self._locks[name]:
            if name not in self._corpora:
                started = time.perf_counter()
                if self.own is not None and name == self.own[0]:
                    corpus = brag.Corpus.load(self.own[1])
                elif self.milvus is not None and name in self.milvus.collections:
                    corpus = open_milvus(self.milvus, name)
                else:
                    corpus = brag.cached_corpus(corpus_file(name), name)
                self._corpora[name] = corpus
                log.info(
                    "opened %s (%d passages) in %.2f s", name, len(corpus), time.perf_counter() - started
                )
            return self._corpora[name]

    def documents(
        self,
        text: str,
        files: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
    ) -> brag.Corpus:
        """Pasted documents and uploaded files as one corpus (:meth:`documents_read`)."""
        return self.documents_read(text, files, cancelled, caller)[0]

    def documents_read(
        self,
        text: str,
        files: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
        cancelled: Callable[[], bool] = lambda: False,
        caller: str = "",
        *,
        not_read: Sequence[doc_files.Unreadable] = (),
        on_file: Callable[[int, int, str], None] | None = None,
    ) -> tuple[brag.Corpus, dict[str, Any] | None]:
        """Pasted documents and uploaded files, checked against the limits and indexed once.

        Files are read in capped worker processes (``parse_worker.py``), within the request's
        deadline and only while ``cancelled()`` is False; a file that cannot be read is named
        with why (``not_read``: those refused before reading) and the others are read. Returns
        the corpus and what was read of the files (``documents.Reading.summary``; None without
        files). The corpora stay cached in memory while the budget allows, and are never
        written to disk.
        """
        digest = hashlib.sha256(text.encode())
        for name, data in files:
            digest.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(data).digest())
        for failure in not_read:
            digest.update(b"\1" + str(failure).encode())
        key = digest.hexdigest()
        with self._documents_lock:
            if key in self._documents:
                self._documents.move_to_end(key)
                corpus, _, summary = self._documents[key]
                return corpus, summary
        pasted = check_documents(text, self.limits) if text.strip() else []
        uploaded, summary = [], None
        if files or not_read:
            uploaded, reading = documents_from_files(
                files, self.limits, self.readers, cancelled, caller, not_read=not_read, on_file=on_file
            )
            summary = reading.summary()
        if len(pasted) + len(uploaded) > self.limits.passages:
            count = len(pasted) + len(uploaded)
            raise too_big("The documents", count, self.limits.passages, "passages", "BRAG_MAX_PASSAGES")
        corpus = brag.Corpus([*pasted, *uploaded])
        self._keep(key, corpus, summary)
        return corpus, summary

    def _keep(self, key: str, corpus: brag.Corpus, summary: dict[str, Any] | None) -> None:
        """Cache a corpus (with what was read of its files) within the memory budget, oldest out first."""
        size = corpus.memory_bytes()
        with self._documents_lock:
            self._documents[key] = corpus, size, summary
            while self._documents and self.cached_bytes() > self.documents_budget:
                self._documents.popitem(last=False)
            log.info(
                "documents cache: %d sets, %d of %d bytes",
                len(self._documents),
                self.cached_bytes(),
                self.documents_budget,
            )

    def cached_bytes(self) -> int:
        """Estimated memory held by the cached pasted corpora."""
        return sum(size for _, size, _ in self._documents.values())
