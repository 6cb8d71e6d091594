#!/usr/bin/env bash
# The device calls after session 7, for what that session built without a GPU. Two calls of up to
# 10 minutes each: `tests` (the GPU tests and the V4 profile) and `benches` (the two benchmarks).
#   - GPU tests: the quantized-tile decode kernel, expert streaming (fp32 guard), online hot
#     experts, the V4 compressor-entry kernel and V4 on CUDA with every Triton kernel;
#   - V4-Flash's batch-1 decode profile again (bench_v4.py --profile; 314 tok/s before the
#     compressor kernel);
#   - streamed prefill with MXFP4 experts in RAM (V4-Flash's format; 3.4 GB a layer, so 12 layers
#     fit the box's RAM);
#   - online hot experts under the demo's routing against none (cached run first).
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_device_followups.sh tests    # then: ... benches
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
part=${1:-tests}
if [ "$part" = tests ]; then
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_expert_unpack_kernel.py tests/test_expert_streaming.py \
    tests/test_gpu_offload.py tests/test_hot_experts.py tests/test_v4_compress_kernel.py tests/test_deepseek_v4_engine.py \
    2>&1 | tail -15 | tee "$out/gpu_tests.txt"
timeout 150 python3 benchmarks/bench_v4.py --layers 4 --batches 1,8 --prompt 512 --new-tokens 64 --prefill 2048 --skip-hf \
    --profile --out "$out/v4_profile.json" 2>&1 | grep -E "^HBM|^tandem|tok_s|ms\"" | tee "$out/v4_profile.txt"
else
timeout 200 python3 benchmarks/bench_stream_prefill.py --layers 12 --fmt mxfp4 --lengths 2048,8192,32768 --cpu-lengths 2048 \
    --chunk 16384 --out "$out/stream_mxfp4.json" 2>&1 | grep -E "Expert streaming|PCIe|prefill|Error" | tee "$out/stream_mxfp4.txt"
timeout 200 python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --hot-first --online \
    --out "$out/hot_online.json" 2>&1 | grep -v "INFO\|Loading" | tail -12 | tee "$out/hot_online.txt"
fi
