#!/usr/bin/env bash
# The decode benchmark (a table, not a test): one request's decode step against the bandwidth a
# streaming read really achieves on this machine, for GPT-2 124M's shape (-e d12, random
# weights), B=1, on this machine's cores:
#  - stream read: build/bench_decode's read of a buffer the size of d12's matrices (494 MB),
#    every thread, many accumulators;
#  - serving: build/bench_decode's median decode step of the serving engine, one request, with
#    the packed weight copies (llmc/decode_matmul.h), with bf16 ones (--weights bf16: 247 MB a
#    step, its GB/s of those bytes) and with the row-major weights;
#  - the trainer's sampler: seconds to generate -g tokens with the KV cache (one position per
#    token) and with a full forward over the -g positions per token (--kv-cache 0), each a
#    one-step run that samples once (after its step) minus the same run without sampling.
# A decode step reads every matrix once (4 bytes x 123.5M: 12 layers' 12 C^2 and wte), so
# GB/s = 494 MB / (s/token). The rounds alternate the variants and every figure is the median
# over them; the load average is printed beside, as other work on the machine slows them all.
# Usage: dev/bench/bench_sampler.sh [tokens] [rounds] (default 64, the quick start's -g, and 3)
set -euo pipefail
cd "$(dirname "$0")/../.."
G=${1:-64}
R=${2:-3}
make -s train_gpt2 build/testdata build/bench_decode >/dev/null
W=$(mktemp -d /tmp/llmc_bench_sampler.XXXXXX)
trap 'rm -rf "$W"' EXIT
build/testdata tokens "$W/train.bin" 20000 50257 1 >/dev/null
secs() {   # the run's wall time in seconds
  local t0 t1
  t0=$(date +%s.%N)
  ./train_gpt2 -e d12 -i "$W/train.bin" -b 1 -t 64 -x 1 -v 0 "$@" >"$W/out" 2>&1 || { tail -3 "$W/out"; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }'
}
. dev/bench/bench_lib.sh   # median
echo "load before: $(uptime)"
: > "$W/rounds"
for r in $(seq "$R"); do
  base=$(secs -s 0)
  kv=$(secs -s 1 -g "$G" --kv-cache 1)
  full=$(secs -s 1 -g "$G" --kv-cache 0)
  build/bench_decode d12 "$G" 1 > "$W/decode"
  awk -v b="$base" -v kv="$kv" -v full="$full" -v g="$G" '
    /^stream read/ { stream = $(NF - 1) }
    /^serving, one request: packed/ { packed = $6 }
    /^serving, one request: row-major/ { rowmajor = $6 }
    /^serving, one request: bf16/ { bf16 = $7 }
    END { printf "%s %s %s %.3f %.3f %s\n", stream, packed, rowmajor, 1000 * (kv - b) / (g - 1), 1000 * (full - b) / (g - 1), bf16 }' \
    "$W/decode" >> "$W/rounds"
done
echo "load after:  $(uptime)"
echo "the last round's matmuls at one row (bench_decode):"
sed -n '/^one row/,/^  logits/p' "$W/decode"
col() { awk -v c="$1" '{ print $c }' "$W/rounds" | median; }
stream=$(col 1)
printf "%-44s %10s %9s %9s\n" "d12, -g $G, $(nproc) cores, median of $R" "ms/token" "GB/s" "of stream"
row() { awk -v n="$1" -v ms="$2" -v s="$stream" -v mb="${3:-494}" 'BEGIN { gb = mb / ms; printf "%-44s %10.1f %9.1f %8.0f%%\n", n, ms, gb, 100 * gb / s }'; }
printf "%-44s %10.1f %9.1f\n" "stream read (494 MB, all threads)" "$(awk -v s="$stream" 'BEGIN { print 494 / s }')" "$stream"
row "serving, one request, packed weights" "$(col 2)"
row "serving, one request, bf16 packed weights" "$(col 6)" 247
row "serving, one request, row-major weights" "$(col 3)"
row "trainer's sampler, KV cache" "$(col 4)"
row "trainer's sampler, full forward per token" "$(col 5)"
