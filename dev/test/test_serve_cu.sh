#!/usr/bin/env bash
# serve_gpt2cu on the emulated GPU (serve_gpt2cu_emu: serve_gpt2.cu's device kernels, launches
# and memory on dev/gpu/emu, device memory unreadable by the host) against serve_gpt2, the CPU
# build, token for token and bit for bit (a hash of every distribution drawn from): greedy and
# seeded requests, on a tiny model (64-token vocabulary), the
# CPU server answering each alone, the emulated one all of them at once in a KV cache small
# enough that requests are preempted and recomputed, with prefill in chunks; a dense model and
# a mixture-of-experts one (4 experts, top 2); the emulated one on one process, and across two
# ranks under real mpirun (dev/test/mpi.sh): --tp 2, --pp 2 and --kvp 2 (Helix's KV
# parallelism: llmc/kernels_kvp_det.cuh on each rank's stretches of the cache) on the dense
# model, --ep 2 and --kvp 2 --ep 2 on the experts.
# Exits non-zero on the first difference, saying which.
set -u
cd "$(dirname "$0")/../.."
. dev/test/serve_lib.sh   # D, J, W, fail, pass; start_server, stop_server
export MPI_TIMEOUT=120    # dev/test/mpi.sh: a hung layout fails instead of blocking
for bin in ./serve_gpt2 ./serve_gpt2cu_emu ./train_gpt2 build/testdata $J; do
  [ -x $bin ] || fail "$bin is not built (make serve_gpt2 serve_gpt2cu_emu train_gpt2 build/testdata build/serve_json)"
done

build/testdata tokens "$W/train.bin" 4000 64 1 || fail "could not write test tokens"

post() {   # NAME BODY: the completion in $W/NAME.json, its HTTP status in $W/NAME.code
  curl -s -o "$W/$1.json" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
    --data-binary "$2" >"$W/$1.code"
}
ids() { $J "$W/$1.json" choices.0.token_ids; }
bits() { $J "$W/$1.json" choices.0.probs_fnv1a; }   # the hash of every distribution drawn from

# request I: a prompt of 3 .. 12 token ids; greedy, or seeded sampling (temperature, top-k, top-p)
body() {
  local i=$1 n=$((3 + (i * 5) % 10)) prompt=
  for t in $(seq 1 $n); do prompt="$prompt${prompt:+,}$(((i * 17 + t * 29) % 64))"; done
  local temps=(0 1 0.8 1.2 1 0)
  echo "{\"prompt\":[$prompt],\"max_tokens\":$((8 + i % 3 * 2)),\"temperature\":${temps[$i]},\"top_k\":$((i % 2 * 20)),\"top_p\":0.9,\"seed\":$((1000 + i)),\"ignore_eos\":true}"
}
N=6

compare() {   # MODEL LAYOUTS...: train a checkpoint of that descriptor, serve_gpt2 on it, then
              # serve_gpt2cu_emu in each layout (words: NP FLAGS..., as emu_layout takes them)
  ./train_gpt2 -e "$1" -i "$W/train.bin" -b 4 -t 32 -x 4 -v 0 -s 0 -l 1e-2 -n 4 -o "$W/ck_$1" >"$W/train.out" 2>&1 ||
    fail "could not train the $1 checkpoint: $(tail -3 "$W/train.out")"
  CK=$W/ck_$1/model_00000004.bin
  SERVE_BIN=./serve_gpt2 start_server
  for i in $(seq 0 $((N - 1))); do
    post cpu_$i "$(body $i)"
    [ "$(cat "$W/cpu_$i.code")" = 200 ] || fail "serve_gpt2, request $i: HTTP $(cat "$W/cpu_$i.code"): $(cat "$W/cpu_$i.json")"
  done
  stop_server || fail "the server exited with status $? on SIGTERM"
  [ "$(ids cpu_0)" != "$(ids cpu_1)" ] || fail "requests 0 and 1 gave the same tokens: the comparison cannot tell requests apart"

  for layout in "${@:2}"; do emu_layout "$1" $layout; done
}

# serve_gpt2cu_emu on NP ranks (under mpirun when NP > 1) with the layout's FLAGS, the N requests
# at once, against serve_gpt2's answers to each alone
emu_layout() {   # MODEL NP FLAGS...
  local model=$1 np=$2
  shift 2
  local launch= what="serve_gpt2cu_emu"
  if [ "$np" -gt 1 ] && ! command -v mpirun >/dev/null; then   # make builds it without MPI there
    echo "skip $model: mpirun -np $np serve_gpt2cu_emu $* (no mpirun)"
    return
  fi
  [ "$np" -gt 1 ] && launch="dev/test/mpi.sh $np" && what="mpirun -np $np serve_gpt2cu_emu $*"
  # 8 blocks of 4 positions: room for one request of maxT = 32, so the six at once preempt
  SERVE_LAUNCH=$launch SERVE_BIN=./serve_gpt2cu_emu start_server --kv-blocks 8 --block-size 4 --max-batch-tokens 8 "$@"
  grep -q "in device memory" "$W/server.out" || fail "$what does not say its tensors are in device memory"
  case $model in *e4k2) grep -q 'E=4 k=2' "$W/server.out" || fail "the server did not load the experts: $(head -1 "$W/server.out")";; esac
  clients=()
  for i in $(seq 0 $((N - 1))); do
    post emu_$i "$(body $i)" &
    clients+=($!)
  done
  wait "${clients[@]}"
  preemptions=$(curl -s "$URL/metrics" | awk '$1 == "serve_preemptions_total" { print $2 }')
  if [ "$np" -gt 1 ]; then   # SIGTERM to rank 0 (the HTTP server): it finishes, ends the others, mpirun exits 0
    kill -TERM "$(awk '/rank pids/ { for (i = 1; i < NF; i++) if ($i == "pids") { print $(i + 1); exit } }' "$W/server.out")"
    wait "$SERVER_PID" || fail "$what: exit status $? after SIGTERM to rank 0"
    SERVER_PID=
  else
    stop_server || fail "$what exited with status $? on SIGTERM"
  fi
  for i in $(seq 0 $((N - 1))); do
    [ "$(cat "$W/emu_$i.code")" = 200 ] || fail "$what, request $i: HTTP $(cat "$W/emu_$i.code"): $(cat "$W/emu_$i.json")"
    [ "$(ids emu_$i)" = "$(ids cpu_$i)" ] ||
      fail "$model, request $i: $what gave $(ids emu_$i), serve_gpt2 $(ids cpu_$i)"
    [ "$(bits emu_$i)" = "$(bits cpu_$i)" ] ||
      fail "$model, request $i: $what: the same tokens from other distributions (probs_fnv1a $(bits emu_$i), serve_gpt2 $(bits cpu_$i))"
  done
  local cache="$preemptions preemptions, prefill in chunks of 8"
  case " $* " in
    *" --kv-blocks "*) cache="the layout's cache and steps, $preemptions preemptions";;   # preempting or not
    *) [ "${preemptions:-0}" -gt 0 ] || fail "the small cache preempted nobody: preemption was not tested";;
  esac
  pass "$model: $what, $N requests at once (greedy and seeded, $cache) = serve_gpt2's tokens and distributions, each alone"
}

compare d2c32h2v64t32 1 "2 --tp 2" "2 --pp 2" "2 --kvp 2"
compare d2c32h2v64t32e4k2 1 "2 --ep 2" "2 --kvp 2 --ep 2"
./serve_gpt2cu_emu -e "$CK" --weights bf16 >"$W/bf16.out" 2>&1 && fail "serve_gpt2cu_emu accepted --weights bf16"
[ "$(wc -l <"$W/bf16.out")" = 1 ] && grep -q -- '--weights bf16' "$W/bf16.out" ||
  fail "serve_gpt2cu_emu --weights bf16: not one line naming the flag: $(cat "$W/bf16.out")"
pass "serve_gpt2cu_emu refuses --weights bf16 in one line"
echo "all serve_gpt2cu tests passed"
