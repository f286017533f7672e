"""Retrieval on Milvus: a ``brag.Retriever`` over a Milvus collection, and the ingestion into one.

The same client code talks to Milvus Lite (a local file: the tests and a laptop) and to a Milvus
server or cluster (``http(s)://host:19530``, with a token). A collection holds each passage once,
keyed by the hash of its title and text, with a ``BM25`` function that turns the analysed text
into a sparse vector, and optionally a dense vector from one of our embedders; ``retrieve`` is a
BM25 full-text search, or a hybrid search with Milvus's RRF ranker when there are dense vectors.

The text Milvus analyses is brag's own analysis (``brag.Analyzer``: words, character bigrams
of Han, kana, hangul and Thai, the corpus's stop words), each token written in hex. Milvus Lite
offers only its ``standard`` and ``jieba`` tokenizers, and a server's ``standard`` tokenizer
cuts Han text into single characters; a hex token is one word to every tokenizer, so a
collection ranks with the tokens ``brag.Corpus`` ranks with, in any language. A collection
records its analyzer (chosen from the first passages indexed into it) as a property, as it
records its embedder.

    MilvusError (ValueError)    unreachable server, bad token, missing collection, wrong schema
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import brag

FIELDS = ("pid", "title", "text", "doc_id", "content", "sparse")
RRF_K = 60
# Hex tokens are single lower-case words to any tokenizer (see the module's docstring).
ANALYZER = {"tokenizer": "standard", "filter": ["lowercase"]}
# Collections made before brag analysed their text: Unicode words, English stop words.
LEGACY_ANALYZER = {
    "tokenizer": "standard",
    "filter": ["lowercase", {"type": "stop", "stop_words": sorted(brag.STOPWORDS["en"])}],
}
BATCH = 500
BM25_PARAMS = {"bm25_k1": 1.5, "bm25_b": 0.75}  # brag.Corpus's (Milvus's own default k1 is 1.2)
EMBEDDER_PROPERTY = "brag.embedder"  # the collection property naming its dense vectors' embedder
ANALYSIS_PROPERTY = "brag.analysis"  # the name of the brag.Analyzer that analysed its text
MAX_TOKEN_CHARS = 100  # a longer token is no word (Milvus drops tokens past 255 bytes)
_LEGACY_TOKEN = re.compile(r"^[\w-]{1,64}$")


class MilvusError(ValueError):
    """A Milvus server or collection BRAG cannot use, and why."""


def passage_id(passage: brag.Passage) -> int:
    """A passage's key: the first 63 bits of the SHA-256 of its title and text.

    The same text gives the same key, so ingestion is idempotent.
    """
    digest = hashlib.sha256(f"{passage.title}\n{passage.text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def connect(uri: str, token: str = "", timeout: float = 10.0) -> Any:
    """A client for ``uri``: a file path is Milvus Lite, ``http(s)://`` a server."""
    from pymilvus import MilvusClient

    shown = re.sub(r"//[^/@]*@", "//", uri)
    try:
        return MilvusClient(uri=uri, token=token, timeout=timeout)
    except Exception as err:  # pymilvus raises many kinds: connection, auth, server errors
        if _refused(err):
            raise MilvusError(f"Milvus at {shown} refused the token") from None
        said = str(err).replace(token, "***") if token else str(err)
        raise MilvusError(f"cannot reach Milvus at {shown}: {type(err).__name__}: {said[:200]}") from None


def _refused(err: BaseException | None) -> bool:
    """Whether the server refused the credentials: pymilvus wraps the gRPC status it got."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:  # exception chains may loop
        seen.add(id(err))
        code = getattr(err, "code", None)
        status = code() if callable(code) else None
        if getattr(status, "name", "") in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return True
        text = str(err).lower()
        if "auth" in text or "password" in text or "permission" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


class MilvusCorpus:
    """A Milvus collection as BRAG's retriever (``brag.Retriever``).

    ``embedder`` must be the one the collection's dense vectors came from (its name is checked);
    without it, or without dense vectors, retrieval is BM25 only. ``open_corpus`` loads the
    recorded embedder itself.
    """

    def __init__(
        self,
        uri: str,
        collection: str,
        *,
        token: str = "",
        embedder: brag.Embedder | None = None,
        client: Any = None,
        cache_size: int = 10_000,
    ) -> None:
        self.uri, self.collection = uri, collection
        self.client = client if client is not None else connect(uri, token)
        described = _check_schema(self.client, collection)  # one description serves every check
        self.dense = "dense" in _field_names(described)
        self.embedder_name = recorded_embedder(described) if self.dense else None
        if embedder is not None and self.dense and embedder.name != self.embedder_name:
            raise MilvusError(
                f"collection {collection!r} holds dense vectors from {self.embedder_name}, "
                f"not {embedder.name}: search it with that embedder"
            )
        self.embedder = embedder if self.dense else None
        self.analyzer = recorded_analyzer(described, collection)
        self._passages: OrderedDict[int, brag.Passage] = OrderedDict()
        self._vectors: dict[int, np.ndarray] = {}
        self._shares: OrderedDict[str, float] = OrderedDict()  # least recently used first
        self._fingerprint: str | None = None
        self._cache_size = cache_size
        self._size = _count(self.client, collection)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, pid: int) -> brag.Passage:
        if pid not in self._passages:
            rows = self.client.get(self.collection, ids=[int(pid)], output_fields=["title", "text", "doc_id"])
            if not rows:
                raise KeyError(pid)
            self._keep(rows[0])
        return self._passages[pid]

    def retrieve(self, query: str, k: int = 5) -> brag.Retrieval:
        """BM25 full-text search (hybrid with the dense vectors when the collection has them)."""
        analysed = self._analysed(query)
        if k <= 0 or not analysed.strip():
            return brag.Retrieval([], [], 0)
        wanted = ["title", "text", "doc_id", *(["dense"] if self.embedder is not None else [])]
        if self.embedder is None:
            found = self.client.search(
                self.collection, data=[analysed], anns_field="sparse", limit=k, output_fields=wanted
            )[0]
            # Milvus gives BM25 as a distance to minimise (its negative) on some builds.
            hits = [(int(h["pid"]), abs(float(h["distance"]))) for h in found]
            for h in found:
                self._keep({"pid": h["pid"], **h["entity"]})
            return brag.Retrieval(hits, [], len(hits))
        return self._hybrid(query, analysed, k, wanted)

    def _analysed(self, query: str) -> str:
        """``query`` as the collection's content field holds its text (raw, in a legacy collection)."""
        return analysed(query, self.analyzer) if self.analyzer is not None else query

    def _hybrid(self, query: str, analysed: str, k: int, wanted: list[str]) -> brag.Retrieval:
        from pymilvus import AnnSearchRequest, RRFRanker

        pool = max(4 * k, 50)
        vector = self.embedder.embed([query])[0].astype(np.float32).tolist()
        requests = [
            AnnSearchRequest(data=[analysed], anns_field="sparse", param={}, limit=pool),
            AnnSearchRequest(data=[vector], anns_field="dense", param={"metric_type": "IP"}, limit=pool),
        ]
        found = self.client.hybrid_search(
            self.collection, requests, RRFRanker(RRF_K), limit=pool, output_fields=wanted
        )[0]
        best = 2 / (RRF_K + 1)  # first in both lists: a fused score of 1.0, as brag.Corpus scales it
        ranked = [(int(h["pid"]), float(h["distance"]) / best) for h in found]
        for h in found:
            self._keep({"pid": h["pid"], **h["entity"]})
        vectors = {pid: self._vectors[pid] for pid, _ in ranked if pid in self._vectors}
        hits, removed = brag.dedup_ranked(ranked, vectors, brag.DedupConfig(), k)
        return brag.Retrieval(hits, removed, len(hits) + len(removed))

    def document_share(self, token: str) -> float:
        """Share of the passages whose analysed title and text hold ``token`` (a text-match count).

        Each count is a query, so the last ``cache_size`` are kept (and the gate asks for at most
        ``brag.MAX_TERM_LOOKUPS`` per question).
        """
        if token in self._shares:
            self._shares.move_to_end(token)
            return self._shares[token]
        # A hex token cannot break out of the filter's quotes; a legacy one is checked.
        word = _hex(token) if self.analyzer is not None else token
        if not word or not self._size or (self.analyzer is None and not _LEGACY_TOKEN.match(token)):
            return 0.0
        rows = self.client.query(
            self.collection, filter=f"TEXT_MATCH(content, '{word}')", output_fields=["count(*)"]
        )
        self._shares[token] = rows[0]["count(*)"] / self._size if rows else 0.0
        while len(self._shares) > self._cache_size:
            self._shares.popitem(last=False)
        return self._shares[token]

    def novel(self, candidates: Sequence[int], read: Sequence[int]) -> list[int]:
        """Candidates that repeat none of the passages read (by their dense vectors, when any)."""
        if self.embedder is None or not read:
            return list(candidates)
        seen = [self._vectors[i] for i in read if i in self._vectors]
        if not seen:
            return list(candidates)
        threshold = brag.DedupConfig().retrieval_similarity_threshold
        stack = np.stack(seen)
        return [
            i
            for i in candidates
            if i not in self._vectors or float(np.max(stack @ self._vectors[i])) < threshold
        ]

    def fingerprint(self) -> str:
        """SHA-256 of what retrieval depends on, which a calibration's progress file checks.

        That is every passage's key (the hash of its text), the analysis, BM25's settings and
        the embedder.
        """
        if self._fingerprint is None:
            keys = []
            iterator = self.client.query_iterator(self.collection, batch_size=10_000, output_fields=["pid"])
            while batch := iterator.next():
                keys.extend(int(row["pid"]) for row in batch)
            iterator.close()
            analysis = self.analyzer.name if self.analyzer is not None else LEGACY_ANALYZER
            digest = hashlib.sha256(json.dumps([analysis, BM25_PARAMS, self.embedder_name]).encode())
            digest.update(np.sort(np.array(keys, dtype=np.int64)).tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def stats(self) -> dict[str, Any]:
        """Figures for reports, with the engine that served the passages."""
        return {
            "passages": self._size,
            "engine": "milvus",
            "collection": self.collection,
            "search": "hybrid (BM25 + dense, RRF)" if self.embedder is not None else "BM25 full text",
            "embedder": self.embedder.name if self.embedder is not None else None,
            "analysis": self.analyzer.name if self.analyzer is not None else "milvus standard (legacy)",
        }

    def _keep(self, row: dict[str, Any]) -> None:
        pid = int(row["pid"])
        self._passages[pid] = brag.Passage(row.get("title", ""), row.get("text", ""), row.get("doc_id", ""))
        self._passages.move_to_end(pid)
        if row.get("dense") is not None:
            self._vectors[pid] = np.asarray(row["dense"], dtype=np.float32)
        while len(self._passages) > self._cache_size:
            old, _ = self._passages.popitem(last=False)
            self._vectors.pop(old, None)


# ------------------------------------------------------------------------------------------
# The collection: schema, checks, ingestion
# ------------------------------------------------------------------------------------------


def _check_schema(client: Any, collection: str) -> dict[str, Any]:
    """The collection's description (fields, properties), or MilvusError when it is missing or not BRAG's."""
    try:
        exists = client.has_collection(collection)
    except Exception as err:
        raise MilvusError(f"Milvus refused the request ({type(err).__name__}): check the token") from None
    if not exists:
        raise MilvusError(
            f"no collection {collection!r} on this Milvus; index one with "
            f"`python -m brag index DOCS --milvus URI --collection {collection}`"
        )
    described = client.describe_collection(collection)
    fields = _field_names(described)
    missing = [f for f in FIELDS if f not in fields]
    if missing:
        raise MilvusError(
            f"collection {collection!r} is not a BRAG collection: it lacks the fields {', '.join(missing)}"
        )
    client.load_collection(collection)  # a collection another process made starts released
    return described


def _field_names(described: dict[str, Any]) -> set[str]:
    return {f["name"] for f in described.get("fields", [])}


def recorded_embedder(described: dict[str, Any]) -> str | None:
    """The name of the embedder a collection's dense vectors came from, as ingestion recorded it."""
    return (described.get("properties") or {}).get(EMBEDDER_PROPERTY)


def recorded_analyzer(described: dict[str, Any], collection: str) -> brag.Analyzer | None:
    """The analyzer a collection's text went through, as ingestion recorded it.

    ``described`` is the collection's description (``_check_schema``). None for a collection
    made before brag analysed the text (Milvus's own words and English stop words); MilvusError
    for one analysed in a way this BRAG does not know.
    """
    name = (described.get("properties") or {}).get(ANALYSIS_PROPERTY)
    if name is None:
        return None
    try:
        return brag.Analyzer.named(name)
    except ValueError as err:
        raise MilvusError(
            f"collection {collection!r}: {err}; index the documents into a new collection"
        ) from None


def _hex(token: str) -> str:
    return token.encode().hex() if len(token) <= MAX_TOKEN_CHARS else ""


def analysed(text: str, analyzer: brag.Analyzer) -> str:
    """``text`` as a collection's content field holds it: the analyzer's tokens, each in hex."""
    return " ".join(filter(None, map(_hex, analyzer.tokens(text))))


def _count(client: Any, collection: str) -> int:
    rows = client.query(collection, filter="", output_fields=["count(*)"])
    return int(rows[0]["count(*)"]) if rows else 0


def create_collection(
    client: Any,
    collection: str,
    embedder: brag.Embedder | None = None,
    dim: int = 0,
    analyzer: brag.Analyzer | None = None,
) -> None:
    """A collection for passages: BM25 over the analysed text, and optionally dense vectors.

    The vectors are ``dim`` wide, from ``embedder``, whose name a collection property records;
    the ``analyzer`` that turns passages and queries into tokens is recorded too.
    """
    from pymilvus import DataType, Function, FunctionType

    schema = client.create_schema(auto_id=False)
    schema.add_field("pid", DataType.INT64, is_primary=True)
    schema.add_field("title", DataType.VARCHAR, max_length=4096)
    schema.add_field("text", DataType.VARCHAR, max_length=65535)
    # What BM25 reads, as brag.Corpus does: the title, then the text.
    schema.add_field(
        "content",
        DataType.VARCHAR,
        max_length=65535,
        enable_analyzer=True,
        enable_match=True,
        analyzer_params=ANALYZER,
    )
    schema.add_field("doc_id", DataType.VARCHAR, max_length=4096)
    schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    schema.add_function(
        Function(
            name="bm25",
            function_type=FunctionType.BM25,
            input_field_names=["content"],
            output_field_names=["sparse"],
        )
    )
    index = client.prepare_index_params()
    index.add_index(
        field_name="sparse",
        index_type="SPARSE_INVERTED_INDEX",
        metric_type="BM25",
        params=BM25_PARAMS,
    )
    if embedder is not None:
        schema.add_field("dense", DataType.FLOAT_VECTOR, dim=dim)
        index.add_index(field_name="dense", index_type="FLAT", metric_type="IP")
    properties = {ANALYSIS_PROPERTY: (analyzer or brag.Analyzer()).name}
    if embedder is not None:
        properties[EMBEDDER_PROPERTY] = embedder.name
    client.create_collection(collection, schema=schema, index_params=index, properties=properties)


def ingest(
    passages: Sequence[Any],
    client: Any,
    collection: str,
    *,
    embedder: brag.Embedder | None = None,
    batch: int = BATCH,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Dedup ``passages`` as ``brag.Corpus`` does at ingestion, then insert the kept ones.

    Each passage's key is the hash of its text, and a batch inserts only the keys the
    collection lacks: a re-run after an interruption resumes, and inserts nothing twice.
    """
    parsed = [p for p in brag.parse_passages(list(passages)) if p is not None] if passages else []
    if not parsed:
        raise brag.InputError("nothing to index: no passage holds any text")
    embeddings = embedder.embed([p.render() for p in parsed]) if embedder is not None else None
    kept = brag.dedup_ingestion(parsed, embeddings, brag.DedupConfig()).kept
    if not client.has_collection(collection):
        recorded: brag.Analyzer | None = brag.Analyzer.of([parsed[i].render() for i in kept])
        width = embeddings.shape[1] if embeddings is not None else 0
        create_collection(client, collection, embedder, width, recorded)
    else:
        recorded = recorded_analyzer(_check_schema(client, collection), collection)
    inserted = 0
    for start in range(0, len(kept), batch):
        rows = [
            _row(parsed[i], embeddings[i] if embeddings is not None else None, recorded)
            for i in kept[start : start + batch]
        ]
        present = {
            int(r["pid"]) for r in client.get(collection, ids=[r["pid"] for r in rows], output_fields=["pid"])
        }
        fresh = list({r["pid"]: r for r in rows if r["pid"] not in present}.values())
        if fresh:
            client.insert(collection, fresh)
            inserted += len(fresh)
        if progress is not None:
            progress(min(start + batch, len(kept)), len(kept))
    # Sealed segments are indexed; rows left in a growing segment are searched by brute force
    # (a query on 100,000 unflushed passages took seconds in Milvus Lite).
    client.flush(collection)
    return {"passages": len(parsed), "kept": len(kept), "inserted": inserted}


def _row(passage: brag.Passage, vector: np.ndarray | None, analyzer: brag.Analyzer | None) -> dict[str, Any]:
    content = analysed(passage.render(), analyzer) if analyzer is not None else passage.render()
    row: dict[str, Any] = {
        "pid": passage_id(passage),
        "title": passage.title[:4000],
        "text": passage.text[:60000],
        "doc_id": passage.doc_id[:4000],
        "content": content[: content.rfind(" ", 0, 65000) if len(content) > 65000 else None],
    }
    if vector is not None:
        row["dense"] = vector.astype(np.float32).tolist()
    return row


# ------------------------------------------------------------------------------------------
# Command lines: --milvus URI --collection NAME instead of --corpus
# ------------------------------------------------------------------------------------------


def open_corpus(uri: str, collection: str, token: str = "") -> MilvusCorpus:
    """A collection as BRAG's corpus, with the embedder its dense vectors came from, if any."""
    corpus = MilvusCorpus(uri, collection, token=token)
    if corpus.embedder_name is not None:  # the collection named it: no mismatch to check
        from bragkit import embedders

        corpus.embedder = embedders.embedder_named(corpus.embedder_name)
    return corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--milvus URI --collection NAME``: retrieve from a Milvus collection instead of ``--corpus``."""
    group = parser.add_argument_group("Milvus (instead of --corpus)")
    group.add_argument(
        "--milvus",
        metavar="URI",
        help="a Milvus Lite file or http(s)://host:19530 (a server's token from BRAG_MILVUS_TOKEN)",
    )
    group.add_argument("--collection", help="the collection, made by python -m brag index --milvus")


def from_arguments(args: argparse.Namespace) -> MilvusCorpus | None:
    """The collection ``--milvus`` and ``--collection`` name, or None when neither is given."""
    if not args.milvus and not args.collection:
        return None
    if not (args.milvus and args.collection):
        raise brag.InputError(
            "--milvus and --collection go together: the server (or file) and the collection"
        )
    return open_corpus(args.milvus, args.collection, os.environ.get("BRAG_MILVUS_TOKEN", ""))
