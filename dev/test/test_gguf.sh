#!/usr/bin/env bash
# Tests build/export_gguf (an llm.c checkpoint -> GGUF for llama.cpp) on a d2 fixture of GPT-2's
# vocabulary that build/test_gguf writes (dev/test/test_gguf.c):
#  - f32 and f16 exports read back by test_gguf's own GGUF parser: every key, token, merge, tensor
#    info and element (f16: the compiler's _Float16 rounding), offsets packed at 32 bytes;
#  - the checker catches a changed token byte, tensor byte and padding byte (it can fail);
#  - bad inputs (no checkpoint, --type bf16, an unknown flag, a vocabulary that is not
#    encoder.json's, a missing encoder.json): exit status 1, one "error:" line naming the
#    problem, and no output file (nor a temporary one) left behind.
# That llama.cpp loads the file and computes what our decoder computes is
# dev/bench/bench_llamacpp.sh's check (it needs npm), not this test's.
set -u
cd "$(dirname "$0")/../.."
TOOL=build/export_gguf
GEN=build/test_gguf
if [ ! -x "$TOOL" ] || [ ! -x "$GEN" ]; then
  make -s "$TOOL" "$GEN" >/dev/null || { echo "FAIL: cannot build $TOOL / $GEN"; exit 1; }
fi
G=dev/data/gpt2
[ -s $G/encoder.json ] || G=../shared/data/gpt2
D=$(mktemp -d "${TMPDIR:-/tmp}/test_gguf.XXXXXX")
trap 'rm -rf "$D"' EXIT
fails=0
pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
TOK=(--encoder $G/encoder.json --bpe $G/vocab.bpe)

"$GEN" fixture "$D/ck.bin" 50257 && "$GEN" fixture "$D/ck1000.bin" 1000 || { echo "FAIL: cannot write fixtures"; exit 1; }
for type in f32 f16; do
  if "$TOOL" "$D/ck.bin" "$D/$type.gguf" --type $type "${TOK[@]}" >"$D/out.txt" 2>&1; then
    "$GEN" check "$D/$type.gguf" "$D/ck.bin" $G/encoder.json $G/vocab.bpe $type && pass "--type $type: the file read back" ||
      fail "--type $type: the file read back differs"
  else
    fail "--type $type: export failed: $(cat "$D/out.txt")"
  fi
done

# The checker must see one changed byte: in a token's string, in a tensor's data, in padding.
corrupt() {   # NAME OFFSET: f32.gguf with the byte at OFFSET changed must fail the check
  cp "$D/f32.gguf" "$D/bad.gguf"
  printf '\x7f' | dd of="$D/bad.gguf" bs=1 seek="$2" conv=notrunc status=none
  if "$GEN" check "$D/bad.gguf" "$D/ck.bin" $G/encoder.json $G/vocab.bpe f32 >/dev/null 2>&1; then
    fail "the checker passed a file with a changed byte in $1"
  else
    pass "the checker catches a changed byte in $1"
  fi
}
size=$(stat -c %s "$D/f32.gguf")
token_at=$(grep -abo 'Collider' "$D/f32.gguf" | head -1 | cut -d: -f1)
corrupt "a token ('Collider')" "$token_at"
corrupt "the last tensor's data" $((size - 20))   # output_norm.bias: 36 floats, then 16 bytes of padding
corrupt "the padding after the last tensor" $((size - 1))

bad() {   # NAME EXPECTED_TEXT ARGS...: must exit 1 with one error line, no output file
  local name=$1 want=$2; shift 2
  rm -f "$D"/new.gguf*
  "$TOOL" "$@" >"$D/out.txt" 2>"$D/err.txt"
  local rc=$?
  if [ $rc -ne 1 ]; then fail "$name: exit status $rc, expected 1"
  elif [ "$(wc -l <"$D/err.txt")" -ne 1 ] || ! grep -q "^error: .*$want" "$D/err.txt"; then
    fail "$name: expected one error line with '$want', got: $(cat "$D/err.txt")"
  elif ls "$D"/new.gguf* >/dev/null 2>&1; then fail "$name: left an output file"
  else pass "$name: $(cat "$D/err.txt")"; fi
}
bad "no checkpoint" "$D/none.bin" "$D/none.bin" "$D/new.gguf" "${TOK[@]}"
bad "--type bf16" "expected f32 or f16" "$D/ck.bin" "$D/new.gguf" --type bf16 "${TOK[@]}"
bad "unknown flag" "unknown flag '--outtype'" "$D/ck.bin" "$D/new.gguf" --outtype f16 "${TOK[@]}"
bad "flag without value" "needs a value" "$D/ck.bin" "$D/new.gguf" --type
bad "V=1000 checkpoint" "V=1000 tokens" "$D/ck1000.bin" "$D/new.gguf" "${TOK[@]}"
bad "missing encoder.json" "$D/none.json" "$D/ck.bin" "$D/new.gguf" --encoder "$D/none.json" --bpe $G/vocab.bpe

[ $fails -eq 0 ] && echo "test_gguf: all passed" || { echo "test_gguf: $fails failed"; exit 1; }
