#!/usr/bin/env bash
# Fit the shipped calibrations of the embedded local model on each dataset's calibration split:
# the first 60 questions of each file (bench/run.py tests only on the questions after them).
# Every action runs on every question, R2 up to HOPS times, through bench/cache/llm.sqlite, so
# bench/controller.py can replay any policy on these questions and a refit needs no LLM.
# Each fit keeps its outcomes beside it (NAME.outcomes.jsonl); the model's pooled fit is made
# from all three, and says which datasets it serves better than their own fit (cross-validated).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${BRAG_DATA_DIR:-../shared/data}"
PY="${PYTHON:-python}"
HOPS="${HOPS:-2}"  # brag.DEFAULT_HOPS
CACHE_MODE="${CACHE_MODE:-read-write}"  # replay: refit from the cache alone, no LLM
OUT=data/calibrations
# The benchmarks' reads keep two evidence levels: fitted on two datasets, each read's own
# reliability (an evidence curve) predicted the third's votes worse than the levels did
# (bench/results/confidence_documents.md); the documents fit uses curves.
EVIDENCE="${EVIDENCE:-levels}"
fit() {  # corpus-name questions corpus file-stem
  "$PY" calibrate.py --model local --split 0:60 --hops "$HOPS" --cache-mode "$CACHE_MODE" --name "$1" \
    --evidence "$EVIDENCE" \
    --questions "$DATA/$2" --corpus "$DATA/$3" --out "$OUT/qwen2.5-coder-0.5b-$4.json"
}
fit HotpotQA hotpotqa/hotpotqa_ircot500.json hotpotqa/hotpotqa_ircot500_corpus.json hotpotqa
fit 2WikiMultihopQA 2wikimultihopqa/2wikimultihopqa.json 2wikimultihopqa/2wikimultihopqa_corpus.json 2wikimultihopqa
fit MuSiQue musique/musique_migres200.json musique/musique_migres200_corpus.json musique
"$PY" calibrate.py pool "$OUT"/qwen2.5-coder-0.5b-{hotpotqa,2wikimultihopqa,musique}.json \
  --out "$OUT/qwen2.5-coder-0.5b-pooled.json"
