#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: proves Tandem loads, generates and serves
# on CUDA. Wheels the machine lacks (fastapi, uvicorn, pydantic) travel in .whl/. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

# 1. Tests: the CUDA ones, plus the CPU suite under this machine's torch 2.11.
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_engine.py tests/test_models.py \
    tests/test_loader.py tests/test_kv.py tests/test_scheduler.py tests/test_sampler.py 2>&1 | tee "$OUT/pytest.txt"

# 2. Serve the built-in model on CUDA (bf16) and talk to it over HTTP.
PORT=8123
python3 -m tandem.cli serve --device cuda --port $PORT --max-model-len 4096 >"$OUT/serve.log" 2>&1 &
PID=$!
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
{
    echo "== /v1/models"; curl -s "http://127.0.0.1:$PORT/v1/models"; echo
    echo "== chat"
    curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model":"tandem-builtin","messages":[{"role":"user","content":"Say hello."}],"max_tokens":24,"temperature":0}'
    echo; echo "== chat stream"
    curl -sN "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model":"tandem-builtin","messages":[{"role":"user","content":"Count."}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}'
    echo "== completions"
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model":"tandem-builtin","prompt":"def add(a, b):","max_tokens":16,"temperature":0}'
    echo; echo "== too long (expect 400)"
    curl -s -w ' HTTP %{http_code}' "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model":"tandem-builtin","prompt":"hi","max_tokens":100000}'
    echo; echo "== metrics"; curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^tandem:(generation_tokens|prompt_tokens|request_success)' 
} 2>&1 | tee "$OUT/http.txt"
kill -INT $PID; wait $PID; echo "serve exit code $?" | tee -a "$OUT/http.txt"
