#!/usr/bin/env bash
# The device calls for what sessions 7 and 8 built without a GPU. Two calls of up to 10 minutes
# each: `tests` (the GPU tests and the V4 profile) and `benches` (the two benchmarks).
#   - GPU tests: expert streaming (its chunk cost model timed on the GPU), CPU experts under CUDA
#     (the auto chunk), online hot experts, V4 on CUDA with every Triton kernel, and the graph-replay
#     paths of Qwen3 (test_gpu.py, test_attention.py) for the runner's packed replay inputs (the
#     quantized-tile decode and V4 compressor-entry kernels passed in session 8's first call);
#   - V4-Flash's batch-1 decode profile (bench_v4.py --profile: replay vs host time);
#   - streamed prefill with MXFP4 experts in RAM (V4-Flash's format; 3.4 GB a layer, so 12 layers
#     fit the box's RAM) at the chunk the cost model picks, the stream gap, and the CPU experts;
#   - hot experts under the demo's routing, bracketed none -> hot -> none, with the gain the hit
#     rate predicts from the CPU experts' share of a step.
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/run_device_followups.sh tests    # then: ... benches
# After session 9, `v4` is what is left to run (one call, up to ~9 minutes): issue 18's measurement
# in one run at the current code (transformers on the same layers, 8K prefill, async off/on), then
# the GPU tests of the V4 kernels and of async scheduling; `gpu` (up to 9 minutes) every GPU test,
# the engine's now with async scheduling on by default (CPU experts, hot experts, graphs, drafters);
# `v4prefix` (~3 minutes) is the same decode with prefix caching on (the server's default).
# Session 10 ran `v4` (issue 18's run), `gpu` and `v4prefix` (BENCHMARKS.md, 2026-12-03 session 10).
# Session 8's `tests` ran in session 9: 39 of 40 GPU tests passed, and the online hot-experts test
# that failed is fixed since. `final` and `benches` are session 8's calls (the MXFP4 streaming and
# hot-experts benchmarks), kept to re-run.
# After session 14 (its device time went to starts that found no machine), two calls wait:
# `auto` (~5 minutes; carry the llguidance wheel): the K policies live after 701ee06 / b70490d,
# DSpark at Kmax 7 and the draft model under auto, at 1-16 requests; `cpukernel` (~2 minutes): the
# CPU kernel's prefetch distances on the box's Xeon, MXFP4 with exact and int8 activations and bf16
# weights, which decides whether the 4 KiB L1 default of afa88b2 holds there.
# After session 15 (three calls found no machine), `handoff` (~6 minutes; carry the llguidance wheel) waits: the GPU
# tests of the doorbell and of V4's shared-expert overlap (bec6c7c), auto live without the stage clock, the hand-offs
# interleaved three times with the L2 prefetch default; then `xeon` (~3 minutes, right after on the same machine): MXFP4 at
# longer L2 distances on the box's Xeon with the kernel's per-thread phase profile, and one thread on weights in the L3
# (what a core computes when the RAM is not what waits).
# After session 16 (its budget went on starts that found no machine), `claims` (~8 minutes; carry the llguidance
# wheel) waits: the kernel's claimed chunks (7e96c4a) A/B'd on the box's Xeon with the phase profile, V4 end to end with
# them under both hand-offs, the GPU tests of V4's graphs with the doorbell (call 1's 60 s cut them off), and where the
# draft model's steps go at 16 requests (profile_spec_host.py --concurrency 16, against no speculation).
# After session 17 (six calls ran; 204 s of budget left could not start a seventh), `after17` (~9 minutes; carry the
# llguidance wheel): the fixed GPU test of the draft model's chained steps (ef91f97), the AMX kernel against avx512bf16
# where experts get several tokens (16 and 8 of 256 kept), auto live with the held batch choices of 0bef271 and the
# stage clock, and where the draft model's K = 0 steps go at 16 requests against no speculation.
# After session 22, `after22` (issue 15) and `offload22` (issue 16), one call each: see their parts below. Session 23
# ran both; `after23` (~5 minutes; carry the llguidance wheel) is what it could not: the GPU tests of the CPU experts
# with poll the default hand-off (acc74c5), then DSpark auto against K=7 at 16 and 8 requests in both engine orders.
# Session 24 started no machine: run `after23` first, then `after24` (~7 minutes; carry the llguidance wheel): where
# the V4 stand-in's GPU side goes at batch 1 (bench_offload --profile-gpu-side; issue 16's batch-1 miss), and the draft
# model at K = 0 against none at 1 request in both engine orders (profile_step_intervals --spec-first; issue 15).
# Session 25 ran `after23` and `after24`, then found no machine: `after25` then `after25b` (one call each, ~7 and
# ~9 minutes; carry the llguidance wheel) measure what it built. `after25`: the host's wait for a step asleep against
# spinning, with the V4 experts in RAM (batch 1 and 4, interleaved three times, the GPU side profiled again with q/k/v
# as one GEMM), then 16 kernel threads (the core the spinning wait took, given to the experts). `after25b`: the
# stacked projections (q/k/v as one GEMM, a dense layer's gate/up as one) against separate ones, bracketed, on the
# Qwen3-30B-A3B shape and at the demo draft model's dense shape; the GPU tests; and the draft model's auto against
# none at 1 and 4 requests, uninstrumented, with an A/A engine.
# After session 21 (its budget ran out before its last fixes were measured), `after21` (~5 minutes; carry the
# llguidance wheel): the draft model's auto at K = 0 and at 16 requests after 94684c4 (zero holds kept across request
# changes) and 8701cf1 (a landing that holds a prompt launch is not timed): the interval profile with its tallies and
# learned residuals at 16 and 8, then auto live with an A/A engine (bench_auto --aa) for the run's own noise.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
part=${1:-v4}
# Where the draft model's steps under auto go at 16 requests, against no speculation ($1: each run's timeout, s).
profile_draft_model_c16() {
    for spec in none '{"method": "draft_model", "num_speculative_tokens": 7, "adaptive": "auto"}'; do
        args=(); [ "$spec" != none ] && args=(--spec "$spec")
        name=$([ "$spec" = none ] && echo none || echo draft_model_auto)
        timeout "$1" python3 benchmarks/profile_spec_host.py --device cuda "${args[@]}" --prompts 32 --concurrency 16 \
            --top 40 > "$out/profile_c16_$name.txt" 2>&1
        grep "tok/s" "$out/profile_c16_$name.txt"
    done
}
if [ "$part" = after25 ]; then
timeout 250 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --num-experts-kept 64 \
    --gpu-budget 24GiB --threads 15 --batches 1,4 --new-tokens 16 --handoff poll --host-wait spin,asleep --repeats 3 \
    --profile-gpu-side --out "$out/offload_v4_host_wait.json" 2>&1 | grep --line-buffered "^batch\|GPU side\|us/step\|Error" | tail -40
sleep 10  # the pinned experts released before the next run probes RAM
timeout 170 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --num-experts-kept 64 \
    --gpu-budget 24GiB --threads 16 --batches 1,4 --new-tokens 16 --handoff poll --host-wait spin,asleep --repeats 2 \
    --out "$out/offload_v4_host_wait_t16.json" 2>&1 | grep --line-buffered "^batch\|Error" | tail -20
elif [ "$part" = after25b ]; then
timeout 120 python3 benchmarks/bench_gpu.py --batches 1,8 --new-tokens 128 --prefill 2048 --skip-hf --compare-stacked \
    --out "$out/gpu_stacked.json" 2>&1 | grep "stacked=\|tandem decode\|Error"
timeout 60 python3 benchmarks/bench_gpu.py --shape demo-draft --batches 1,8 --new-tokens 128 --prefill 256 --skip-hf \
    --compare-stacked --out "$out/gpu_stacked_demo_draft.json" 2>&1 | grep "stacked=\|tandem decode\|Error"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_offload.py tests/test_gpu.py tests/test_fused_kernels.py \
    2>&1 | tail -4 | tee "$out/gpu_tests.txt"
timeout 200 python3 benchmarks/bench_auto.py --device cuda --methods draft_model --kmax 7 --concurrency 1,4 --rounds 5 \
    --prompts 32 --prompts-per-slot 16 --only "none,draft_model auto" --aa --out "$out/auto_dm_c1c4_aa.json" 2>&1 \
    | grep -v "INFO\|Loading\|Capturing\|^round" | tail -12
elif [ "$part" = after24 ]; then
timeout 220 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --num-experts-kept 64 \
    --gpu-budget 24GiB --threads 15 --batches 1,4 --new-tokens 16 --handoff poll --profile-gpu-side \
    --out "$out/offload_v4_gpu_side_profile.json" 2>&1 | grep --line-buffered "^batch\|GPU side\|us/step\|Error" | tail -40
for order in "" --spec-first; do
    timeout 100 python3 benchmarks/profile_step_intervals.py --device cuda --concurrency 1 --warmup-rounds 1 --rounds 3 \
        $order --out "$out/iv_draft_model_c1${order:+_spec_first}.json" 2>&1 | grep "^round\|wrote\|Error" | cut -c1-260
done
elif [ "$part" = after23 ]; then
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_offload.py tests/test_cpu_handoff.py \
    tests/test_deepseek_v4_engine.py 2>&1 | tail -6 | tee "$out/gpu_tests.txt"
K7='{"method": "dspark", "num_speculative_tokens": 7}'
AUTO='{"method": "dspark", "num_speculative_tokens": 7, "adaptive": "auto"}'
for c in 16 8; do
    timeout 80 python3 benchmarks/profile_step_intervals.py --device cuda --concurrency $c --warmup-rounds 1 --rounds 2 \
        --base "$K7" --spec "$AUTO" --out "$out/iv_dspark_c$c.json" 2>&1 | grep "^round\|wrote\|Error" | cut -c1-300
    timeout 80 python3 benchmarks/profile_step_intervals.py --device cuda --concurrency $c --warmup-rounds 1 --rounds 2 \
        --base "$AUTO" --spec "$K7" --out "$out/iv_dspark_swapped_c$c.json" 2>&1 | grep "^round\|wrote\|Error" | cut -c1-300
done
elif [ "$part" = after22 ]; then
# After session 22 (~4 minutes; carry the llguidance wheel): DSpark auto against K=7 at 16 and 8 requests after
# c4fabaa (a changed padded batch weighed per phase between searches) and cada271 (a hold at the deepest depth survives
# request changes): the interval profile with auto's tallies (choose, searches), then live with an A/A engine.
K7='{"method": "dspark", "num_speculative_tokens": 7}'
AUTO='{"method": "dspark", "num_speculative_tokens": 7, "adaptive": "auto"}'
for c in 16 8; do
    timeout 110 python3 benchmarks/profile_step_intervals.py --device cuda --concurrency $c --warmup-rounds 1 --rounds 2 \
        --base "$K7" --spec "$AUTO" --out "$out/iv_dspark_c$c.json" 2>&1 | grep "^round\|wrote\|Error" | cut -c1-400
done
timeout 200 python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 7 --concurrency 1,8,16 \
    --rounds 4 --prompts 32 --prompts-per-slot 16 --only "none,dspark K=7,dspark auto,draft_model auto" --aa \
    --out "$out/auto_live_aa.json" 2>&1 | grep -v "INFO\|Loading\|Capturing\|^round" | tail -8
elif [ "$part" = offload22 ]; then
# Issue 16's end-to-end run, one call of its own (~5 minutes): V4 with 128 of 256 experts kept and the two hand-offs
# interleaved did not fit 300 s beside other work in session 22. One repeat each; Qwen3 after, never overlapping.
timeout 330 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --num-experts-kept 128 \
    --gpu-budget 24GiB --threads 15 --batches 1,2,4,8 --new-tokens 16 --handoff hostfunc,poll --out "$out/offload_v4_128.json" \
    2>&1 | grep "^batch\|Error" | tail -16
sleep 20  # the V4 process's 69 GiB of pinned experts released before the next run probes RAM
timeout 200 python3 benchmarks/bench_offload.py --shape qwen3-30b-a3b --gpu-budget 8GiB --threads 15 --batches 1,2,4,8 \
    --new-tokens 16 --handoff hostfunc,poll --out "$out/offload_qwen3.json" 2>&1 | grep "^batch\|Error" | tail -16
elif [ "$part" = after21 ]; then
for c in 16 8; do
    timeout 110 python3 benchmarks/profile_step_intervals.py --device cuda --concurrency $c --warmup-rounds 1 --rounds 2 \
        --out "$out/intervals_draft_model_c$c.json" 2>&1 | grep -v "INFO\|Loading\|Capturing" | tail -4
done
timeout 200 python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 7 --concurrency 1,8,16 \
    --rounds 4 --prompts 32 --prompts-per-slot 16 --only "none,dspark K=7,dspark auto,draft_model auto" --aa \
    --out "$out/auto_live_aa.json" 2>&1 | grep -v "INFO\|Loading\|Capturing\|^round" | tail -8
elif [ "$part" = after17 ]; then
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k "draft or drafters" 2>&1 | tail -30 \
    | tee "$out/gpu_chain_tests.txt"
for kept in 16:4 8:8; do  # experts kept : layers cycled (a cold working set of 0.8-0.9 GB)
    timeout 50 python3 benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4 --batches 2,4,8 --threads 15 --no-torch \
        --calls 8 --layers "${kept#*:}" --num-experts-kept "${kept%:*}" --isa avx512bf16,amx \
        --out "$out/kernel_amx_kept${kept%:*}.json" 2>&1 | grep "tandem-\|RAM read" | grep -v "layers x" \
        | tee "$out/kernel_amx_kept${kept%:*}.txt"
done
timeout 230 python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 7 --concurrency 1,4,8,16 \
    --rounds 3 --prompts 96 --only "none,dspark K=7,dspark phase-fit,dspark auto,draft_model auto" --stage-clock --step-clock \
    --phase-k-fit '{"reasoning": 7, "content": 5, "tool_call": 7}' --out "$out/auto.json" 2>&1 | grep -A8 "^median" \
    | tee "$out/auto.txt"
profile_draft_model_c16 70
elif [ "$part" = claims ]; then
timeout 90 python3 benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4,bf16 --batches 1,4 --threads 15 --no-torch --calls 8 \
    --layers 3 --num-experts-kept 64 --act-dtype auto,int8 --dynamic 0,25,40 --profile --out "$out/kernel_dyn.json" 2>&1 \
    | grep "tandem-\|RAM read\|profile" | grep -v "layers x" | tee "$out/kernel_dyn.txt"
timeout 110 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --act-dtype int8 --num-experts-kept 32 \
    --gpu-budget 24GiB --threads 15 --batches 1,4 --new-tokens 16 --handoff hostfunc,poll --repeats 2 \
    --out "$out/offload_v4.json" 2>&1 | grep "^batch\|measured:\|Error" | tee "$out/offload_v4.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_offload.py tests/test_deepseek_v4_engine.py 2>&1 \
    | tail -4 | tee "$out/gpu_tests.txt"
profile_draft_model_c16 80
elif [ "$part" = handoff ]; then
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_offload.py tests/test_deepseek_v4_engine.py 2>&1 \
    | tail -4 | tee "$out/gpu_tests.txt"
timeout 160 python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 7 --concurrency 1,4,8,16 \
    --rounds 3 --prompts 96 --only "none,dspark K=7,dspark phase-fit,dspark auto,draft_model auto" --step-clock \
    --phase-k-fit '{"reasoning": 7, "content": 5, "tool_call": 7}' --out "$out/auto.json" 2>&1 | grep -A8 "^median" | tee "$out/auto.txt"
timeout 120 python3 benchmarks/bench_offload.py --shape v4-flash-experts --cpu-moe --fmt mxfp4 --act-dtype int8 --num-experts-kept 32 \
    --gpu-budget 24GiB --threads 15 --batches 1,4 --new-tokens 16 --handoff hostfunc,poll --repeats 3 \
    --out "$out/offload_v4_handoff.json" 2>&1 | grep "^batch\|measured:\|Error" | tee "$out/offload_v4_handoff.txt"
timeout 130 python3 benchmarks/bench_offload.py --shape qwen3-30b-a3b --gpu-budget 8GiB --threads 15 --batches 1,4 --new-tokens 16 \
    --handoff hostfunc,poll --repeats 3 --out "$out/offload_qwen3_handoff.json" 2>&1 | grep "^batch\|measured:\|Error" \
    | tee "$out/offload_qwen3_handoff.txt"
elif [ "$part" = xeon ]; then
timeout 150 python3 benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4 --batches 1,4 --threads 15 --no-torch --calls 8 \
    --layers 3 --num-experts-kept 64 --act-dtype auto,int8 --prefetch 4096:16384,4096:32768,4096:65536,2048:16384,8192:32768,0:16384 \
    --profile --out "$out/cpu_moe_pf.json" 2>&1 \
    | grep "tandem-\|RAM read\|profile" | grep -v "layers x" | tee "$out/cpu_moe_pf.txt"
timeout 60 python3 benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4,bf16 --batches 1,4 --threads 1 --no-torch --calls 15 \
    --layers 1 --num-experts-kept 8 --act-dtype auto,int8 --profile --out "$out/cpu_moe_hot_t1.json" 2>&1 \
    | grep "tandem-\|RAM read\|profile" | grep -v "layers x" | tee "$out/cpu_moe_hot_t1.txt"
elif [ "$part" = auto ]; then
timeout 500 python3 benchmarks/bench_auto.py --device cuda --methods dspark,draft_model --kmax 7 --concurrency 1,4,8,16 \
    --rounds 3 --prompts 48 --only "none,dspark K=7,dspark phase-fit,dspark auto,draft_model auto" --stage-clock --step-clock \
    --phase-k-fit '{"reasoning": 7, "content": 5, "tool_call": 7}' --out "$out/auto.json" 2>&1 \
    | grep -v "INFO\|Loading\|Capturing" | tail -40 | tee "$out/auto.txt"
elif [ "$part" = cpukernel ]; then
timeout 150 python3 benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4,bf16 --batches 1,4 --threads 15 --no-torch --calls 10 \
    --layers 3 --num-experts-kept 64 --act-dtype auto,int8 --prefetch 1024:0,4096:0,2048:8192,0:0 --out "$out/cpu_moe_pf.json" 2>&1 \
    | grep "tandem-\|RAM read" | grep -v "layers x" | tee "$out/cpu_moe_pf.txt"
elif [ "$part" = v4 ]; then
timeout 400 python3 benchmarks/bench_v4.py --layers 4 --batches 1,8 --prompt 512 --new-tokens 64 --prefill 8192 \
    --profile --out "$out/v4_full.json" 2>&1 | grep -E "^HBM|^tandem|^transformers|tok_s|ms\"|Error" | tee "$out/v4_full.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_v4_*.py tests/test_deepseek_v4_engine.py \
    tests/test_async_scheduling.py 2>&1 | tail -8 | tee "$out/gpu_tests.txt"
elif [ "$part" = gpu ]; then
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -15 | tee "$out/gpu_all.txt"
elif [ "$part" = v4prefix ]; then
timeout 200 python3 benchmarks/bench_v4.py --layers 4 --batches 1,8 --prompt 512 --new-tokens 64 --prefill 2048 --skip-hf \
    --prefix-caching --profile --out "$out/v4_prefix.json" 2>&1 | grep -E "^tandem|tok_s|ms\"|Error" | tee "$out/v4_prefix.txt"
elif [ "$part" = final ]; then
timeout 165 python3 benchmarks/bench_stream_prefill.py --layers 8 --fmt mxfp4 --lengths 2048,8192,32768 --cpu-lengths 2048 \
    --gap-prefill 8192 --cpu-gap-prefill 2048 --out "$out/stream_mxfp4.json" 2>&1 \
    | grep -E "Expert streaming|PCIe|prefill|Prefill chunk|gap|peak|Error" | tee "$out/stream_mxfp4.txt"
timeout 145 python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --order none,hot,none --reps 1 \
    --new-tokens 40 --out "$out/hot_bracket.json" 2>&1 | grep -v "INFO\|Loading" | tail -14 | tee "$out/hot_bracket.txt"
timeout 30 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_expert_streaming.py tests/test_gpu_offload.py \
    tests/test_hot_experts.py 2>&1 | tail -8 | tee "$out/gpu_tests.txt"
elif [ "$part" = tests ]; then
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_expert_streaming.py tests/test_gpu_offload.py \
    tests/test_hot_experts.py tests/test_deepseek_v4_engine.py tests/test_gpu.py tests/test_attention.py \
    tests/test_runner_staging.py 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
timeout 150 python3 benchmarks/bench_v4.py --layers 4 --batches 1,8 --prompt 512 --new-tokens 64 --prefill 2048 --skip-hf \
    --profile --out "$out/v4_profile.json" 2>&1 | grep -E "^HBM|^tandem|tok_s|ms\"" | tee "$out/v4_profile.txt"
else
timeout 250 python3 benchmarks/bench_stream_prefill.py --layers 12 --fmt mxfp4 --lengths 2048,8192,32768 --cpu-lengths 2048 \
    --gap-prefill 8192 --cpu-gap-prefill 2048 --out "$out/stream_mxfp4.json" 2>&1 \
    | grep -E "Expert streaming|PCIe|prefill|Prefill chunk|gap|peak|Error" | tee "$out/stream_mxfp4.txt"
timeout 300 python3 benchmarks/bench_hot_experts.py --layers 4 --hot-gib 8 --batches 1,4 --order none,hot,none \
    --out "$out/hot_bracket.json" 2>&1 | grep -v "INFO\|Loading" | tail -14 | tee "$out/hot_bracket.txt"
fi
