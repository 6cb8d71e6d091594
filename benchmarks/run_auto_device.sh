#!/usr/bin/env bash
# The issue-15 measurements in one device call (about 6 minutes on the H200; every policy: none, K = 1..4, phase, auto): the K policies live
# on the demo pair, the speculative stage's host time, fresh traces with confidences, and their
# replay against the Qwen3-30B-A3B shape. Results under $OUT (default ./out). The engine imports
# llguidance: on the device machine carry its wheel (.whlg/) and put it on the path first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whlg/*.whl
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_auto_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
python3 benchmarks/bench_spec_host.py --batches 1,4,16 --steps 2000 | tee "$out/spec_host.txt"
python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 4 --concurrency 1,4,16 \
    --rounds 6 --warmup-rounds 1 --prompts 24 --max-tokens 256 --stage-clock --step-clock \
    --out "$out/auto.json" --traces "$out/traces.json" 2>&1 | grep -v "INFO\|Loading\|Capturing\|^round"
python3 benchmarks/bench_auto_replay.py --traces "$out/traces.json" --device cuda --kv-gib 4 \
    --concurrency 1,4,16 --out "$out/replay.json" 2>&1 | grep -v "INFO\|Loading\|Capturing"
