#!/usr/bin/env bash
# FlexSP's cost model fitted on this machine (a table, not a test): the median step time (the
# steps after the first) of train_gpt2 --varlen G on one rank, on token files whose documents
# all have s tokens (an EOT every s tokens, so every sequence of a step has length s), for
# several s; then alpha1, alpha2 and beta of ms per sequence = alpha1 s^2 + alpha2 s + beta
# (varlen_flexsp.h's computation term for a group of one; with --varlen each sequence is its
# own microbatch, so beta is per sequence) by least squares. L=4 C=128 NH=4, GPT-2's
# vocabulary (EOT is token 50256), so the LM head's linear term dominates. One rank: the all-to-all
# term is measured apart, at the end (the trainer's cost model keeps FlexSP's bandwidths).
# Then the trainer running FlexSP's plans: the median step time of 4 ranks (-z 1, OMP_NUM_THREADS=1
# each) on tiny Shakespeare's documents (--varlen 16 -t 64, d4c64h2) per --flexsp-policy, against
# plain data parallelism (each rank a block of 4 sequences by index): with --flexsp-tokens 64
# (groups of one rank), then 16 (a sequence of 17-32 tokens needs a group of 2, of 33-64 one of
# 4: context parallelism over the pool's sub-groups). The ranks share this machine's 2 cores, so
# the times are those of an oversubscribed machine. Last, the all-to-all bandwidth per group
# size the cost model's bw[] stands for (build/bench_flexsp_a2a: every sub-group of g ranks of
# a pool of 4, then 8, at once), measured over shared memory between ranks on 2 cores.
# Usage: dev/bench/bench_flexsp.sh [steps] (lengths: SS="16 32 64 128 256", G=8; POLICY_STEPS=8;
# SS="" skips the fit; A2A_RANKS="4 8", A2A_MIB=4 per rank)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-4}
G=${G:-8}
make -s train_gpt2 build/bench_flexsp_a2a >/dev/null
W=$(mktemp -d /tmp/llmc_bench_flexsp.XXXXXX)
trap 'rm -rf "$W"' EXIT
printf "%-6s %12s %12s\n" "s" "ms/step" "ms/sequence"
for s in ${SS-16 32 64 128 256}; do
  python3 - "$W/docs$s.bin" "$s" <<'PY'
import struct, sys
path, s = sys.argv[1], int(sys.argv[2])
n = 64 * 256 + 1
tok = [50256 if i % s == 0 else (i * 7919) % 509 for i in range(n)]
header = [20240520, 1, n] + [0] * 253
with open(path, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack("<%dH" % n, *tok))
PY
  out=$(OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} ./train_gpt2 -e d4c128h4v50257t256 -i "$W/docs$s.bin" -t 256 --varlen "$G" \
        --shuffle 0 -x "$STEPS" -v 0 -s 0 -o "$W/run$s" 2>&1) || { echo "$out" | tail -3; exit 1; }
  ms=$(echo "$out" | awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | sort -n \
       | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  printf "%-6s %12s %12.3f\n" "$s" "$ms" "$(echo "$ms $G" | awk '{ print $1 / $2 }')"
  echo "$s $(echo "$ms $G" | awk '{ print $1 / $2 }')" >> "$W/points"
done
# least squares of y = a1 s^2 + a2 s + b: the normal equations, by Gaussian elimination
[ -s "$W/points" ] && python3 - "$W/points" <<'PY'
import sys
pts = [tuple(map(float, line.split())) for line in open(sys.argv[1])]
A = [[sum(x ** (4 - i - j) for x, _ in pts) for j in range(3)] + [sum(y * x ** (2 - i) for x, y in pts)] for i in range(3)]
for c in range(3):
    p = max(range(c, 3), key=lambda r: abs(A[r][c]))
    A[c], A[p] = A[p], A[c]
    for r in range(3):
        if r != c:
            f = A[r][c] / A[c][c]
            A[r] = [a - f * b for a, b in zip(A[r], A[c])]
a1, a2, b = (A[i][3] / A[i][i] for i in range(3))
print("fitted on one rank (this machine, %d lengths): alpha1 %.4g ms/token^2, alpha2 %.4g ms/token, "
      "beta %.4g ms per sequence" % (len(pts), a1, a2, b))
PY

# --- 4 ranks, FlexSP's policies on tiny Shakespeare's documents ---
DATA=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
[ -f "$DATA" ] || DATA=../shared/data/gpt2/tiny_shakespeare_train.bin
PSTEPS=${POLICY_STEPS:-8}
printf "\n4 ranks (2 cores shared), tiny Shakespeare, --varlen 16 -t 64, d4c64h2, -z 1, %d steps: median step ms\n" "$PSTEPS"
printf "%-22s %10s  %s\n" "layout" "ms/step" "groups over the steps (ranks x how many)"
for layout in "plain data parallelism:" "static:--flexsp 1 --flexsp-policy static" \
              "adaptive:--flexsp 1 --flexsp-policy adaptive" "milp:--flexsp 1 --flexsp-policy milp" \
              "static, 16 tokens:--flexsp 1 --flexsp-tokens 16 --flexsp-policy static" \
              "adaptive, 16 tokens:--flexsp 1 --flexsp-tokens 16 --flexsp-policy adaptive" \
              "milp, 16 tokens:--flexsp 1 --flexsp-tokens 16 --flexsp-policy milp"; do
  out=$(OMP_NUM_THREADS=1 dev/test/mpi.sh 4 ./train_gpt2 -e d4c64h2v50257t64 -i "$DATA" -t 64 --varlen 16 -z 1 \
        ${layout#*:} -x "$PSTEPS" -v 0 -s 0 2>&1) || { echo "$out" | tail -3; exit 1; }
  ms=$(echo "$out" | awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | sort -n \
       | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  groups=$(echo "$out" | sed -n 's/^ *group [0-9]* (\([0-9]*\) rank(s).*/\1/p' | sort -n | uniq -c | awk '{ printf "%sx%s ", $2, $1 }')
  printf "%-22s %10s  %s\n" "${layout%%:*}" "$ms" "$groups"
done

# --- the all-to-all bandwidth per group size (build/bench_flexsp_a2a), on 4 and 8 ranks ---
for np in ${A2A_RANKS-4 8}; do
  printf "\n"
  dev/test/mpi.sh "$np" build/bench_flexsp_a2a "${A2A_MIB:-4}"
done
