#!/usr/bin/env bash
# A complete, bounded tour of `sluice bench` against the fake OpenAI server (about 20 s):
#   bash examples/bench/run.sh [OUT_DIR]
# Point --url at any OpenAI-compatible server (sluice serve, vLLM, llama.cpp, a gateway) instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/bench-example}
PORT=${PORT:-18123}
URL=http://127.0.0.1:$PORT

# A fake server: 40 ms TTFT, 100 tokens/s per stream, 10 ms more TTFT per request past 48 in flight.
python -m sluice.bench.fake_server --port "$PORT" --ttft-ms 40 --tokens-per-s 100 \
    --knee-concurrency 48 --knee-ttft-ms 10 >/dev/null &
FAKE=$!
trap 'kill $FAKE 2>/dev/null' EXIT
sleep 1

# 1. one run: the example contract and workload, 64 connections (the contract's load)
sluice bench run --url "$URL" --contract examples/bench/contract.yaml \
    --workload examples/bench/workload.yaml -n 600 -d 30s --out "$OUT/run" || echo "contract failed (exit $?)"

# 2. a sweep: where does the contract stop holding?
sluice bench sweep --url "$URL" --contract examples/bench/contract.yaml \
    --workload examples/bench/workload.yaml --concurrencies 16,32,48,64,96 -n 300 -d 20s --out "$OUT/sweep" \
    || echo "no step held the contract (exit $?)"

# 3. a trace replay, then a comparison of the two runs
sluice bench run --url "$URL" --trace examples/bench/trace.jsonl --out "$OUT/trace"
sluice bench compare "$OUT/run/summary.json" "$OUT/sweep/summary.json"
