#!/usr/bin/env bash
# Encoding speed of dev/data/tokenize (one thread), median of 5 runs per file. Each run
# times `tokenize encode FILE > /dev/null` (total) and, right before it, the same on an empty
# file (load: reading encoder.json + vocab.bpe), so machine noise hits both alike.
#   total ms     : the whole command
#   encode ms    : total - load, the encoder alone (its word cache starts empty)
#   MB/s         : file size / encode time; end-to-end MB/s = size / total
# Files come from dev/data/ (`make data`) when present, else ../shared/data/.
set -euo pipefail
cd "$(dirname "$0")/../.."
TOK=dev/data/tokenize
SHARED=../shared/data
[ -x $TOK ] || make $TOK >/dev/null

pick() { for p in "$@"; do [ -f "$p" ] && { echo "$p"; return; }; done; }
SHAKESPEARE=$(pick dev/data/tinyshakespeare/input.txt $SHARED/tinyshakespeare.txt)
HELDOUT=$(pick $SHARED/heldout.txt)
[ -n "$SHAKESPEARE" ] || { echo "error: no tiny Shakespeare: run \`make data\`" >&2; exit 1; }

empty=$(mktemp)
trap 'rm -f "$empty"' EXIT
us() { local start=$(date +%s%N); $TOK encode "$1" >/dev/null; echo $(( ($(date +%s%N) - start) / 1000 )); }
median() { printf '%s\n' "$@" | sort -n | sed -n 3p; }

printf '%-18s %6s %8s %9s %10s %8s %10s\n' file MB "load ms" "total ms" "encode ms" "MB/s" "e2e MB/s"
for f in "$SHAKESPEARE" $HELDOUT; do
  name=$(basename "$f")
  [ "$f" = "$SHAKESPEARE" ] && name="tiny Shakespeare"
  loads=() totals=() encodes=()
  for i in 1 2 3 4 5; do
    load=$(us "$empty")
    total=$(us "$f")
    loads+=("$load") totals+=("$total") encodes+=($((total - load)))
  done
  awk -v n="$name" -v b="$(wc -c <"$f")" -v l="$(median "${loads[@]}")" \
      -v t="$(median "${totals[@]}")" -v e="$(median "${encodes[@]}")" 'BEGIN {
    printf "%-18s %6.2f %8.1f %9.1f %10.1f %8.1f %10.1f\n", n, b / 1e6, l / 1000, t / 1000,
           e / 1000, (e > 0 ? b / e : 0), b / t
  }'
done
