#!/usr/bin/env bash
# llama.cpp side by side with our decoder (a table, not a test; issue 26): one request's decode
# time per token on GPT-2 124M's shape (d12, the random checkpoint the serving benchmarks use),
# THREADS threads each:
#  - llama.cpp: node-llama-cpp's prebuilt CPU binaries (npm; installed once into build/llamacpp),
#    on the checkpoint exported by build/export_gguf as GGUF f32 and f16 (2-D tensors), through
#    its low-level sequence API (dev/bench/llamacpp_decode.mjs): a 16-token prompt, then N
#    single-token evaluations, greedy; the prompt excluded; one warm-up round in each process,
#    no mmap. Its ms/token is the wall time per evaluation as node sees it (sampling and the
#    binding's overhead included, as our step includes sampling); llama.cpp's own eval timer,
#    the threads its context used, the process's CPU time over wall time during the decode and
#    the ggml CPU variant it loaded are printed beside;
#  - ours: build/bench_decode's serving engine, one request (the same 16-token prompt, N steps;
#    median step), fp32 packed weights and --weights bf16's packed weights, and its stream read
#    (the bandwidth a read of the matrices' size achieves, all threads).
# GB/s of weights read = the bytes of a step's matrices (12 layers' 12 C^2 and the head's V x C:
# 494 MB f32, with our padded Vp or llama.cpp's V alike; 247 MB in f16/bf16) / time.
# Rounds alternate llama.cpp f32, llama.cpp f16, ours; each figure is the median over rounds.
# First the export is checked against independent ends: llama.cpp's tokens of tiny Shakespeare's
# first 1000 characters must be GPT-2's (the 285 ids of tiktoken in the data folder), and its 32
# greedy tokens on the f32 file our sampler's (./train_gpt2 --prompt, the same 16 ids); a
# mismatch ends the benchmark (exit 1).
# Without npm, node, a reachable registry, or on a machine other than Linux x86-64: one line,
# exit 0.
# Usage: dev/bench/bench_llamacpp.sh  (env: ROUNDS, default 3; N decode tokens, default 64;
# THREADS, default 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
. dev/bench/bench_lib.sh   # median, random_d12_checkpoint
ROUNDS=${ROUNDS:-3}; N=${N:-64}; THREADS=${THREADS:-2}
NLC=3.22.1                  # node-llama-cpp's version (its llama.cpp: llama/llama.cpp.info.json)
LD=build/llamacpp
D=dev/data
[ -s $D/tinyshakespeare.txt ] || D=../shared/data
G=$D/gpt2
skip() { echo "bench-llamacpp: skipped: $*"; exit 0; }
[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] || skip "node-llama-cpp's linux-x64 binaries need Linux x86-64"
command -v node >/dev/null && command -v npm >/dev/null || skip "node and npm not found (llama.cpp comes from npm's node-llama-cpp)"
if [ ! -d $LD/node_modules/node-llama-cpp ] || [ ! -d $LD/node_modules/@node-llama-cpp/linux-x64 ]; then
  mkdir -p $LD
  (cd $LD && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund --omit=optional \
    node-llama-cpp@$NLC @node-llama-cpp/linux-x64@$NLC >npm.log 2>&1) ||
    skip "npm install node-llama-cpp@$NLC failed ($(grep -m1 -E 'npm error (code|[A-Za-z]+Error)' $LD/npm.log || tail -1 $LD/npm.log); see $LD/npm.log)"
  echo "installed node-llama-cpp $NLC and its prebuilt linux-x64 CPU binaries into $LD"
fi
make -s train_gpt2 build/export_gguf build/bench_decode >/dev/null
W=$(mktemp -d /tmp/llmc_bench_llamacpp.XXXXXX)
trap 'rm -rf "$W"' EXIT

ckpt=$(random_d12_checkpoint $G)
for type in f32 f16; do   # 494 and 247 MB, removed at the end
  build/export_gguf "$ckpt" "$W/d12_$type.gguf" --type $type --encoder $G/encoder.json --bpe $G/vocab.bpe >/dev/null
done

# The export checked first: llama.cpp's tokens of tiny Shakespeare's first 1000 characters =
# GPT-2's (tiktoken's 285 ids), and its 32 greedy tokens after the first 16 = our sampler's.
head -c 1000 $D/tinyshakespeare.txt >"$W/first1000.txt"
node dev/bench/llamacpp_decode.mjs $LD $W/d12_f16.gguf tokenize "$W/first1000.txt" >"$W/tokens" 2>&1 || { cat "$W/tokens"; exit 1; }
[ "$(tr -s ' \n' ' ' <"$W/tokens" | sed 's/ $//')" = "$(tr -s ' \n' ' ' <$G/tinyshakespeare_first1000.tokens.txt | sed 's/ $//')" ] ||
  { echo "bench-llamacpp: llama.cpp's tokens of the first 1000 characters differ from GPT-2's: the exported tokenizer is wrong"; exit 1; }
prompt=$(tr -s ' \n' ' ' <$G/tinyshakespeare_first1000.tokens.txt | cut -d' ' -f1-16 | tr ' ' ',')
./train_gpt2 -e "$ckpt" -i $G/tiny_shakespeare_train.bin -b 1 -t 64 -x 1 -l 0 -v 0 -s 1 -g 48 --temperature 0 \
  --tokenizer "$W/no_tokenizer.bin" --prompt "$prompt" >"$W/sampler" 2>&1 || { tail -3 "$W/sampler"; exit 1; }
ours=$(awk '/^generating:/ { getline; getline; print; exit }' "$W/sampler" | tr -s ' ' | sed 's/ $//; s/ /,/g')
node dev/bench/llamacpp_decode.mjs $LD $W/d12_f32.gguf greedy "$THREADS" "$prompt" 32 >"$W/greedy" 2>&1 || { cat "$W/greedy"; exit 1; }
[ "$(head -1 "$W/greedy")" = "$ours" ] ||
  { echo "bench-llamacpp: llama.cpp's greedy tokens $(head -1 "$W/greedy") differ from our sampler's $ours"; exit 1; }
echo "check: llama.cpp tokenizes tiny Shakespeare's first 1000 characters to GPT-2's 285 ids; its 32 greedy tokens on" \
     "the f32 file = our sampler's ($(tail -1 "$W/greedy"))"

echo "load before: $(uptime)"
for r in $(seq "$ROUNDS"); do
  for type in f32 f16; do
    node dev/bench/llamacpp_decode.mjs $LD $W/d12_$type.gguf time "$THREADS" 16 "$N" >"$W/llama_$type" 2>&1 ||
      { cat "$W/llama_$type"; exit 1; }
    grep '^ms_per_token' "$W/llama_$type" >>"$W/rounds_$type"
  done
  OMP_NUM_THREADS=$THREADS build/bench_decode d12 "$N" 1 >"$W/ours"
  awk '/^stream read/ { s = $(NF - 1) } /^serving, one request: packed/ { p = $6 } /^serving, one request: bf16/ { b = $7 }
       END { print s, p, b }' "$W/ours" >>"$W/rounds_ours"
done
echo "load after:  $(uptime)"

field() { awk -v k="$2" '{ for (i = 1; i < NF; i++) if ($i == k) print $(i + 1) }' "$W/rounds_$1"; }   # llama.cpp's
ours() { awk -v c="$1" '{ print $c }' "$W/rounds_ours"; }   # 1 stream GB/s, 2 fp32 ms, 3 bf16 ms
echo "rounds (ms/token): llama.cpp f32 $(field f32 ms_per_token | paste -sd' '), f16 $(field f16 ms_per_token | paste -sd' ');" \
     "ours fp32 $(ours 2 | paste -sd' '), bf16 $(ours 3 | paste -sd' ')"
for type in f32 f16; do
  echo "llama.cpp $type: threads $(field $type threads | sort -u | paste -sd/), CPU time / wall time in the decode" \
       "$(field $type cpu_per_wall | paste -sd' '), ggml CPU variant $(field $type variant | sort -u | paste -sd/)," \
       "its own eval timer $(field $type eval_ms_per_token | median) ms/token"
done
stream=$(ours 1 | median)
echo "d12, one request, prompt 16, $N decode tokens, $THREADS threads, median of $ROUNDS alternated rounds," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| decoder | weights | ms/token | GB/s of weights read |"
echo "|---|---|---|---|"
row() { awk -v n="$1" -v w="$2" -v ms="$3" -v mb="$4" 'BEGIN { printf "| %s | %s | %.1f | %.1f |\n", n, w, ms, mb / ms }'; }
row "llama.cpp (node-llama-cpp $NLC)" f32 "$(field f32 ms_per_token | median)" 494
row "llama.cpp (node-llama-cpp $NLC)" "f16 (2-D tensors)" "$(field f16 ms_per_token | median)" 247
row "ours: serving engine, one request" fp32 "$(ours 2 | median)" 494
row "ours: serving engine, one request" "bf16 (--weights bf16)" "$(ours 3 | median)" 247
row "stream read (all threads)" "fp32, the matrices' size" "$(awk -v s="$stream" 'BEGIN { print 494 / s }')" 494
