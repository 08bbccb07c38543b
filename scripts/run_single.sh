#!/usr/bin/env bash
# One rank on the CPU: GPT-2 of depth 4 (L=4, C=256, 16M parameters) from scratch on tiny
# Shakespeare, the README's quick start with more steps. Extra arguments go to train_gpt2
# (e.g. `scripts/run_single.sh -e d12 -x 50`). Needs `make` and `make data`.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
exec ./train_gpt2 -e d4 -b 8 -t 64 -x 1000 -l 1e-3 -u 50 -q 0.1 -c 0.1 -v 100 -m 20 -s 250 -g 64 \
    -n 250 -o out/single "$@"
