#!/usr/bin/env bash
# Fit the shipped calibrations with the embedded local model on each dataset's calibration split
# (the first questions of each file; bench/run.py tests only on the questions after them).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${BRAG_DATA_DIR:-../shared/data}"
PY="${PYTHON:-python}"
"$PY" calibrate.py --model local --split 0:60 --name HotpotQA \
  --questions "$DATA/hotpotqa/hotpotqa_ircot500.json" --corpus "$DATA/hotpotqa/hotpotqa_ircot500_corpus.json" \
  --out data/calibration.json
"$PY" calibrate.py --model local --split 0:40 --name 2WikiMultihopQA \
  --questions "$DATA/2wikimultihopqa/2wikimultihopqa.json" --corpus "$DATA/2wikimultihopqa/2wikimultihopqa_corpus.json" \
  --out data/calibration_2wikimultihopqa.json
"$PY" calibrate.py --model local --split 0:40 --name MuSiQue \
  --questions "$DATA/musique/musique_migres200.json" --corpus "$DATA/musique/musique_migres200_corpus.json" \
  --out data/calibration_musique.json
