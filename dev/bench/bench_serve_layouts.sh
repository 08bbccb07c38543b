#!/usr/bin/env bash
# The serving benchmark per layout (issue 27; a table, not a test): decode tok/s and inter-token
# latency of serve_gpt2 across ranks (llmc/serve_parallel.h, serve_kvp.h, serve_pipeline.h)
# under build/serve_load, with long prompts:
#   on a random d12 (GPT-2 124M's shape, maxT 1024): one process, --tp 2, --pp 2, --kvp 2,
#     --tp 2 --kvp 2 (4 ranks);
#   on a random d12 with 8 experts per layer, top 2 (d12e8k2): one process, --ep 2, --tp 2 --ep 2,
#     --kvp 2 --ep 2 (Helix: attention KVP 2, the experts over the same 2 ranks).
# Every request: PROMPT_TOKENS token ids of tiny Shakespeare (the repo's tokenized
# tiny_shakespeare_val.bin, from a random offset; default 992, so that with OUT = 32 generated
# tokens the context reaches d12's maxT of 1024), greedy with ignore_eos; N requests per row, all
# CONC in flight at once (default 2 and 2). One OpenMP thread per rank (OMP_NUM_THREADS=1): the
# ranks share this machine's cores. Decode tok/s is serve_load's: the tokens after each
# request's first over the time some request was decoding (prefill excluded); ITL every gap
# between text chunks at the client. Each server first answers a short warm-up request (not
# counted: its first steps pack the decode copies of the weights) and is stopped by SIGTERM to
# rank 0 (the HTTP server), which ends the other ranks and mpirun.
# The checkpoints are written once to build/bench_serve/ (ck/ the d12 make bench-serve writes
# too, ck_moe/ the experts' d12): a step at learning rate 0 writes the initial weights.
# A row whose load does not complete within ROW_TIMEOUT s (default 600) says so and the next runs.
# Usage: dev/bench/bench_serve_layouts.sh  (env: N, CONC, OUT, PROMPT_TOKENS as above; ROWS, an
# extended regex: only the rows whose label matches, e.g. ROWS=d12e8k2)
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${N:-2}; CONC=${CONC:-2}; OUT=${OUT:-32}; PROMPT_TOKENS=${PROMPT_TOKENS:-992}
ROWS=${ROWS:-.}; ROW_TIMEOUT=${ROW_TIMEOUT:-600}
D=dev/data
[ -s $D/tinyshakespeare.txt ] || D=../shared/data
G=$D/gpt2
make -s serve_gpt2 train_gpt2 build/serve_load >/dev/null
export OMP_NUM_THREADS=1
checkpoint() {   # MODEL DIR: prints the path of a random MODEL written once to build/bench_serve/DIR
  local ck=build/bench_serve/$2/model_00000001.bin
  if [ ! -s "$ck" ]; then
    echo "writing a random $1 checkpoint to $ck (once)" >&2
    ./train_gpt2 -e "$1" -i $G/tiny_shakespeare_train.bin -b 1 -t 64 -x 1 -l 0 -v 0 -s 0 -n 1 \
      -o "build/bench_serve/$2" >"build/bench_serve.$2.train.out" 2>&1 || { tail -3 "build/bench_serve.$2.train.out" >&2; exit 1; }
    rm -f build/bench_serve/"$2"/state_*.bin
  fi
  echo "$ck"
}
DENSE=$(checkpoint d12 ck)
MOE=$(checkpoint d12e8k2 ck_moe)
W=$(mktemp -d /tmp/llmc_bench_serve_layouts.XXXXXX)
PID=
RANK0=
trap '[ -n "$RANK0" ] && kill -KILL $RANK0 2>/dev/null; [ -n "$PID" ] && wait $PID; rm -rf "$W"' EXIT
load() {   # LOAD_FLAGS...: serve_load against $port, its output in $W/load.out; fails past ROW_TIMEOUT s
  timeout "$ROW_TIMEOUT" build/serve_load --port "$port" --tokens $G/tiny_shakespeare_val.bin --output-tokens "$OUT:$OUT" "$@" >"$W/load.out"
}
stop() {   # SIGTERM to rank 0 (it finishes, ends the other ranks and mpirun); SIGKILL 60 s later if it has not
  kill -TERM "$RANK0"
  for _ in $(seq 600); do kill -0 "$RANK0" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$RANK0" 2>/dev/null && { echo "rank 0 ignored SIGTERM for 60 s: killed" >>"$W/server.out"; kill -KILL "$RANK0"; }
  wait "$PID"
}
row() {   # LABEL CHECKPOINT RANKS SERVER_FLAGS...: one row of the table (when LABEL matches ROWS)
  local label=$1 ck=$2 np=$3
  shift 3
  [[ $label =~ $ROWS ]] || return 0
  local launch=()
  [ "$np" = 1 ] || launch=(dev/test/mpi.sh "$np")
  MPI_TIMEOUT=1200 ${launch[@]+"${launch[@]}"} ./serve_gpt2 -e "$ck" --port 0 --encoder $G/encoder.json --bpe $G/vocab.bpe "$@" \
    >"$W/server.out" 2>&1 &
  PID=$!
  port=
  for _ in $(seq 1200); do
    port=$(grep -o 'http://127.0.0.1:[0-9]*' "$W/server.out" | sed 's/.*://' || true)
    [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || { cat "$W/server.out"; exit 1; }
  RANK0=$PID
  # rank 0's pid: the startup line's first of the rank pids (mpirun does not forward SIGTERM as one stop)
  [ "$np" = 1 ] || RANK0=$(awk '/rank pids/ { print $(NF - '$((np - 1))'); exit }' "$W/server.out")
  if ! load --num-prompts 1 --max-concurrency 1 --prompt-tokens 16 --output-tokens 4:4 ||
     ! load --num-prompts "$N" --max-concurrency "$CONC" --prompt-tokens "$PROMPT_TOKENS"; then
    # a layout that hangs or fails is a row saying so, and the benchmark goes on to the next
    local got
    got=$(grep '^requests' "$W/load.out" || echo "no answer in ${ROW_TIMEOUT} s")
    stop || true
    PID= RANK0=
    echo "| $label | $np | **failed**: $got; $(tail -1 "$W/server.out") | | | |"
    return
  fi
  stop || { echo "$label: exit status $? after SIGTERM to rank 0: $(tail -3 "$W/server.out")"; exit 1; }
  PID= RANK0=
  grep -q '^serve_gpt2: stopped' "$W/server.out" || { echo "$label: rank 0 did not stop cleanly: $(tail -3 "$W/server.out")"; exit 1; }
  # the row from serve_load's lines: "decode T tokens in S s decoding: R decode tok/s", "ITL mean X p50 Y p99 Z ms", TTFT alike
  awk -v label="$label" -v np="$np" '
    /^requests/ { done = $2 " of " $4 }
    /^decode/ { rate = $(NF - 2) }
    /^TTFT/ { ttft = sprintf("%.0f / %.0f / %.0f", $3, $5, $7) }
    /^ITL/ { itl = sprintf("%.0f / %.0f / %.0f", $3, $5, $7) }
    END { printf "| %s | %d | %s | %s | %s | %s |\n", label, np, done, rate, itl, ttft }' "$W/load.out"
}
echo "$N requests per row, $CONC in flight, prompts of $PROMPT_TOKENS tokens, $OUT generated (greedy); $(grep -c ^processor /proc/cpuinfo) cores shared by all ranks and by whatever else runs (OMP_NUM_THREADS=1 per rank), load average before $(cut -d' ' -f1 /proc/loadavg)"
echo "| layout | ranks | requests | decode tok/s | ITL ms (mean / p50 / p99) | TTFT ms (mean / p50 / p99) |"
echo "|---|---|---|---|---|---|"
row "d12, one process" "$DENSE" 1
row "d12, --tp 2" "$DENSE" 2 --tp 2
row "d12, --pp 2" "$DENSE" 2 --pp 2
row "d12, --kvp 2" "$DENSE" 2 --kvp 2
row "d12, --tp 2 --kvp 2" "$DENSE" 4 --tp 2 --kvp 2
row "d12e8k2, one process" "$MOE" 1
row "d12e8k2, --ep 2" "$MOE" 2 --ep 2
row "d12e8k2, --tp 2 --ep 2" "$MOE" 4 --tp 2 --ep 2
row "d12e8k2, --kvp 2 --ep 2" "$MOE" 2 --kvp 2 --ep 2
echo "load average after $(cut -d' ' -f1 /proc/loadavg)"
