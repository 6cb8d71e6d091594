#!/usr/bin/env bash
# DeepSeek-V4 on the H200 in one device call (issue 18; about 8 minutes): first the GPU tests of
# what no GPU has run yet (the V4 Triton attention, graph replay included; the engine on CUDA with
# it; the MoE clamp in the small-batch kernel; the CPU-expert paths changed since the last GPU run),
# then the V4-Flash shape on 4 layers against transformers and the roofline. Results under $OUT
# (default ./out). The engine imports llguidance: carry its wheel (.whlg/) and put it on the path:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whlg/*.whl
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_v4_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_v4_attention_kernel.py tests/test_v4_indexer_kernel.py tests/test_deepseek_v4_engine.py \
    tests/test_moe_small.py tests/test_moe_kernels.py tests/test_gpu.py tests/test_gpu_offload.py tests/test_hot_experts.py \
    tests/test_attention.py tests/test_v4_decode_kernels.py \
    2>&1 | tail -30 | tee "$out/gpu_tests.txt"
# The CPU expert kernel on the Xeon's AVX-512 (not gpu-marked: it runs on every ISA the CPU has).
python3 -m pytest -q -p no:cacheprovider tests/test_cpu_experts.py tests/test_deepseek_v4.py 2>&1 | tail -5 \
    | tee "$out/cpu_tests.txt"
python3 benchmarks/bench_v4.py --layers 4 --batches 1,8 --prompt 512 --new-tokens 64 --prefill 8192 \
    --out "$out/v4.json" 2>&1 | grep -v "INFO\|Loading" | tail -40 | tee "$out/v4.txt"
# Issue 17's hot-expert cache under the demo model's recorded routing: decode with every expert in
# RAM, then with 8 GiB of hot experts on the GPU (V4-Flash expert shape, 4 layers, bf16).
python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --out "$out/hot.json" 2>&1 \
    | grep -v "INFO\|Loading" | tail -12 | tee "$out/hot.txt"
