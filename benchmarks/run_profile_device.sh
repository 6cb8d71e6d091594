#!/usr/bin/env bash
# One device call (about 8 minutes): the GPU tests not re-run since the last refactors (Qwen3's
# engine with graphs and drafters, the fp8 attention tolerance), where the V4-Flash shape's
# batch-1 decode spends its GPU time (graph replay vs engine step, kernels by GPU time), and the
# hot-expert run in the other order (cached first). Results under $OUT (default ./out).
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_profile_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_attention.py tests/test_kv_fp8_full.py \
    2>&1 | tail -30 | tee "$out/gpu_tests.txt"
timeout 200 python3 benchmarks/bench_v4.py --layers 4 --batches 1 --prompt 512 --new-tokens 64 --prefill 2048 --skip-hf \
    --profile --out "$out/v4_profile.json" 2>&1 | grep -v "INFO\|Loading" | tail -70 | tee "$out/v4_profile.txt"
timeout 150 python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --hot-first --out "$out/hot_first.json" \
    2>&1 | grep -v "INFO\|Loading" | tail -12 | tee "$out/hot_first.txt"
