#!/usr/bin/env bash
# The next device call for issue 17 and 18 (about 8 minutes; nothing here has run on a GPU yet
# unless BENCHMARKS.md says so): the GPU tests of the quantized-tile decode kernel, the fp32 guard
# of expert streaming, online hot experts' engine path, then streamed prefill with MXFP4 experts in
# RAM (V4-Flash's format; 3.4 GB a layer, so 12 layers fit the box's RAM), and online hot experts
# under the demo's routing against none (cached run first).
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_stream_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_expert_unpack_kernel.py tests/test_expert_streaming.py \
    tests/test_gpu_offload.py tests/test_hot_experts.py 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
timeout 200 python3 benchmarks/bench_stream_prefill.py --layers 12 --fmt mxfp4 --lengths 2048,8192,32768 --cpu-lengths 2048 \
    --chunk 16384 --out "$out/stream_mxfp4.json" 2>&1 | grep -E "Expert streaming|PCIe|prefill|Error" | tee "$out/stream_mxfp4.txt"
timeout 200 python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --hot-first --online \
    --out "$out/hot_online.json" 2>&1 | grep -v "INFO\|Loading" | tail -12 | tee "$out/hot_online.txt"
