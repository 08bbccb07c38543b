#!/usr/bin/env bash
# Tests GPT-2 weight import/export (dev/tools/gpt2_weights) on tiny GPT-2-shaped safetensors
# files that build/test_weights writes itself (see dev/test/test_weights.c):
#  - import of a canonical F32 file: every value of the checkpoint at its llm.c position
#    (Conv1D weights transposed, wte padded with zero rows), checked independently;
#  - export of that checkpoint reproduces the canonical file byte for byte, plus a config.json
#    that the importer reads back (NH from it) to the same checkpoint;
#  - a PyTorch-style file ("transformer." prefix, mask buffers, tied lm_head, unsorted header
#    with whitespace, data in another order, config.json next to it) imports identically; an
#    untied lm_head only warns;
#  - F16 (mixed with BF16 and F32 tensors) and BF16 files: every one of the 65536 bit patterns
#    converts exactly;
#  - NH from GPT-2's family table (C=768);
#  - ~60 corrupted or inconsistent inputs: exit status 1, one "error:" line that names the
#    problem, and no output file.
# Run from the repository root; builds what it needs when called directly.
set -u
cd "$(dirname "$0")/../.."
TOOL=${GPT2_WEIGHTS_TOOL:-dev/tools/gpt2_weights}   # override to test e.g. a sanitizer build
GEN=build/test_weights
if [ ! -x "$TOOL" ] || [ ! -x "$GEN" ]; then
  make -s "$TOOL" "$GEN" >/dev/null || { echo "FAIL: cannot build $TOOL / $GEN"; exit 1; }
fi
D=$(mktemp -d "${TMPDIR:-/tmp}/test_weights.XXXXXX")
trap 'rm -rf "$D"' EXIT
fails=0
pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

"$GEN" fixtures "$D" || { echo "FAIL: cannot write fixtures"; exit 1; }

# run NAME CMD...: must succeed
run() {
  local name=$1; shift
  if "$@" >"$D/out.txt" 2>"$D/err.txt"; then pass "$name"; return 0; fi
  fail "$name: '$*' exited $?"; cat "$D/out.txt" "$D/err.txt"; return 1
}

# --- F32: import, check every value, export byte for byte, round trip
run "import canonical F32 (--heads 4)" "$TOOL" import "$D/canon.safetensors" "$D/canon.bin" --heads 4
run "checkpoint values at llm.c positions" "$GEN" check "$D/canon.bin" f32
mkdir -p "$D/export"
run "export" "$TOOL" export "$D/canon.bin" "$D/export/model.safetensors"
if cmp "$D/canon.safetensors" "$D/export/model.safetensors"; then pass "export is byte-identical to the canonical file"
else fail "export differs from the canonical file"; "$TOOL" info "$D/export/model.safetensors"; fi
for kv in '"n_head": 4' '"n_layer": 2' '"n_embd": 16' '"vocab_size": 50' '"n_positions": 8' \
          '"n_ctx": 8' '"model_type": "gpt2"' '"GPT2LMHeadModel"' '"layer_norm_epsilon": 1e-05' \
          '"activation_function": "gelu_new"'; do
  grep -qF "$kv" "$D/export/config.json" || fail "exported config.json lacks $kv"
done
pass "exported config.json fields"
run "re-import the export (NH from its config.json)" "$TOOL" import "$D/export/model.safetensors" "$D/again.bin"
grep -q "NH=4 (from config.json)" "$D/out.txt" || fail "NH did not come from config.json: $(cat "$D/out.txt")"
cmp -s "$D/canon.bin" "$D/again.bin" && pass "round trip is identical" || fail "round trip changed the checkpoint"

# --- the PyTorch-style file
run "import prefixed file with mask buffers and tied lm_head" "$TOOL" import "$D/hf/model.safetensors" "$D/hf.bin"
[ -s "$D/err.txt" ] && fail "unexpected warnings: $(cat "$D/err.txt")"
cmp -s "$D/canon.bin" "$D/hf.bin" && pass "prefixed file gives the same checkpoint" || fail "prefixed file gives another checkpoint"
run "import with an untied lm_head" "$TOOL" import "$D/untied.safetensors" "$D/untied.bin" --config "$D/hf/config.json"
grep -q "warning: .*lm_head.weight.*differs from wte.weight in 1 of 800" "$D/err.txt" && pass "untied lm_head warns" \
  || fail "no lm_head warning: $(cat "$D/err.txt")"
cmp -s "$D/canon.bin" "$D/untied.bin" || fail "untied lm_head changed the checkpoint"

# --- F16 / BF16: every bit pattern
run "import F16 (mixed with BF16 and F32 tensors)" "$TOOL" import "$D/f16.safetensors" "$D/f16.bin" --heads 4
run "F16 values exact" "$GEN" check "$D/f16.bin" f16
run "import BF16" "$TOOL" import "$D/bf16.safetensors" "$D/bf16.bin" --heads 4
run "BF16 values exact" "$GEN" check "$D/bf16.bin" bf16

# --- NH from GPT-2's family table
run "import C=768 without --heads" "$TOOL" import "$D/family/model.safetensors" "$D/family.bin"
nh=$(od -An -t d4 -j 20 -N 4 "$D/family.bin" | tr -d ' ')
[ "$nh" = 12 ] && pass "NH=12 from the family table" || fail "family table gave NH=$nh"
run "info" "$TOOL" info "$D/canon.safetensors"

# --- corrupted and inconsistent inputs
n=0
while IFS=$'\t' read -r file kw args; do
  n=$((n + 1))
  out="$D/bad_out.bin"
  rm -f "$out"
  # shellcheck disable=SC2086
  "$TOOL" import "$file" "$out" $args >"$D/out.txt" 2>"$D/err.txt"
  rc=$?
  what="$(basename "$file") $args"
  if [ $rc -ne 1 ]; then fail "$what: exit status $rc, expected 1"; cat "$D/err.txt"; continue; fi
  if [ "$(grep -c '^error: ' "$D/err.txt")" != 1 ] || [ "$(wc -l <"$D/err.txt")" != 1 ]; then
    fail "$what: expected one 'error:' line, got:"; cat "$D/err.txt"; continue
  fi
  if ! grep -qE -- "$kw" "$D/err.txt"; then fail "$what: message lacks /$kw/: $(cat "$D/err.txt")"; continue; fi
  if [ -e "$out" ]; then fail "$what: wrote $out anyway"; continue; fi
  pass "$what rejected: $(cut -c1-150 "$D/err.txt")"
done <"$D/bad/cases.tsv"
[ "$n" -ge 50 ] || fail "only $n corrupted cases ran"

# export errors
"$TOOL" export "$D/canon.safetensors" "$D/x.safetensors" 2>"$D/err.txt" && fail "export of a non-checkpoint succeeded"
grep -q "magic" "$D/err.txt" && pass "export rejects a non-checkpoint" || fail "export error: $(cat "$D/err.txt")"
"$TOOL" frobnicate 2>/dev/null && fail "unknown command accepted"

# nothing half-written anywhere
left=$(find "$D" -name '*.tmp.*' | head -3)
[ -z "$left" ] && pass "no temporary files left" || fail "temporary files left: $left"

if [ $fails -ne 0 ]; then echo "test_weights: $fails FAILED"; exit 1; fi
echo "test_weights: all passed ($n corrupted inputs rejected)"
