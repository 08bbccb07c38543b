#!/usr/bin/env bash
# The serving benchmark (a table, not a test): serve_gpt2 on GPT-2 124M's shape (d12; the
# quick start's checkpoint when there is one, else a random d12 written once to
# build/bench_serve/) under build/serve_load (Poisson arrivals; tiny Shakespeare prompts; greedy,
# ignore_eos, output lengths uniform in OUT), one server per row:
#   lone request            in-flight batching, 1 request at a time from the client
#   in-flight, 16 conc.     in-flight batching (the default), 16 requests in flight
#   static, 16 conc.        --batching static: a batch admitted together, none joins until all finish
#   one at a time, 16 conc. --max-running 1: the engine runs one request, 15 queue
# TTFT, TPOT, ITL in ms (mean / p50 / p99), as vLLM's benchmark_serving reports them.
# Each server first answers one warm-up request, not counted (its first steps pack the decode
# copies of the weights, llmc/decode_matmul.h). The 16-concurrent rows send at RATE16 (default
# inf, as vLLM's benchmark_serving's default request rate: --max-concurrency keeps 16 in flight);
# a Poisson rate of a few per second keeps fewer than 16 in flight (Little's law: rate x
# latency), so it would measure the arrivals, not the batching.
# Last, the issue's two ratios: in-flight output tok/s over one at a time's (target >= 8) and
# the in-flight mean ITL over the lone request's (target <= 2).
# Usage: dev/bench/bench_serve.sh  (env: N requests per 16-concurrent row, default 48; N1 for
# the one-request-at-a-time rows, default 8; OUT=MIN:MAX output tokens, default 16:32;
# PROMPT=MIN:MAX characters, default 40:160; RATE requests/s for the 1-concurrent rows, default 4;
# RATE16 for the 16-concurrent rows, default inf)
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${N:-48}; N1=${N1:-8}; OUT=${OUT:-16:32}; PROMPT=${PROMPT:-40:160}; RATE=${RATE:-4}; RATE16=${RATE16:-inf}
D=dev/data
[ -s $D/tinyshakespeare.txt ] || D=../shared/data
G=$D/gpt2
make -s serve_gpt2 train_gpt2 build/serve_load >/dev/null
. dev/bench/bench_lib.sh
ckpt=$(ls -t out/quickstart/*/model_*.bin 2>/dev/null | head -1 || true)
[ -n "$ckpt" ] || ckpt=$(random_d12_checkpoint $G)
W=$(mktemp -d /tmp/llmc_bench_serve.XXXXXX)
PID=
trap '[ -n "$PID" ] && kill -TERM $PID 2>/dev/null; rm -rf "$W"' EXIT
row() {   # label, requests, concurrency, server flags...
  local label=$1 n=$2 conc=$3; shift 3
  ./serve_gpt2 -e "$ckpt" --port 0 --encoder $G/encoder.json --bpe $G/vocab.bpe "$@" >"$W/server.out" 2>&1 &
  PID=$!
  local port=
  for _ in $(seq 600); do
    port=$(grep -o 'http://127.0.0.1:[0-9]*' "$W/server.out" | sed 's/.*://' || true)
    [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || { cat "$W/server.out"; exit 1; }
  build/serve_load --port "$port" --text $D/tinyshakespeare.txt --num-prompts 1 --max-concurrency 1 \
    --output-tokens "$OUT" --prompt-chars "$PROMPT" --label warm-up >"$W/load.out" || { cat "$W/load.out"; exit 1; }
  local rate=$RATE
  [ "$conc" = 1 ] || rate=$RATE16
  build/serve_load --port "$port" --text $D/tinyshakespeare.txt --num-prompts "$n" --max-concurrency "$conc" \
    --rate "$rate" --output-tokens "$OUT" --prompt-chars "$PROMPT" --label "$label" >"$W/load.out" || { cat "$W/load.out"; exit 1; }
  kill -TERM $PID; wait $PID || true; PID=
  grep '^|' "$W/load.out" | tee -a "$W/rows"
}
echo "$ckpt, prompts $PROMPT chars, outputs $OUT tokens, Poisson arrivals at $RATE/s (1 concurrent), $RATE16/s (16), $(nproc) cores, load average $(cut -d' ' -f1 /proc/loadavg)"
echo "| schedule | requests | req/s | output tok/s | TTFT ms (mean / p50 / p99) | TPOT ms | ITL ms |"
echo "|---|---|---|---|---|---|---|"
row "lone request (1 concurrent)" "$N1" 1
row "in-flight, 16 concurrent" "$N" 16
row "static, 16 concurrent" "$N" 16 --batching static
row "one at a time (--max-running 1), 16 concurrent" "$N1" 16 --max-running 1
# the ratios: $5 output tok/s, $8 ITL "mean / p50 / p99" (fields of a row split at |)
awk -F'|' '/^\| lone/ { split($8, l, "/"); lone_itl = l[1] } /^\| in-flight/ { inflight = $5; split($8, i, "/"); itl = i[1] }
  /^\| one at a time/ { one = $5 }
  END { printf "in-flight / one at a time, output tok/s: %.2fx (target >= 8); in-flight mean ITL / lone mean ITL: %.2fx (target <= 2)\n",
        inflight / one, itl / lone_itl }' "$W/rows"
