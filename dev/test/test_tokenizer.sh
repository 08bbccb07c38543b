#!/usr/bin/env bash
# Tests of the dev/data/tokenize tool, run from the repository root (make test):
#  - encode of the first 1000 characters of tiny Shakespeare == GPT-2's ids (reference file)
#  - prepare reproduces llm.c's tiny_shakespeare_{val,train}.bin byte for byte, and the
#    tokenizer file; sharded prepare writes the same token stream
#  - decode(encode(x)) == x for heldout.txt and random bytes (mostly invalid UTF-8)
#  - bad input ends in one "error: ..." line and a non-zero exit
# Inputs come from dev/data/ (`make data`) when present, else ../shared/data/. Expected
# outputs are checked by the sha256 listed in ../shared/data/SOURCES.md, and compared with
# the reference files there when they exist.
set -u
cd "$(dirname "$0")/../.."

TOK=dev/data/tokenize
SHARED=${LLMC_SHARED_DATA:-../shared/data}   # override with LLMC_SHARED_DATA
WORK=build/test_tokenizer_sh
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }
sha256() { sha256sum "$1" | cut -d' ' -f1; }

[ -x $TOK ] || { echo "FAIL: $TOK is not built (make $TOK)"; exit 1; }
rm -rf $WORK && mkdir -p $WORK

# first existing path of the arguments, or nothing
pick() { for p in "$@"; do [ -f "$p" ] && { echo "$p"; return; }; done; }
SHAKESPEARE=$(pick dev/data/tinyshakespeare/input.txt $SHARED/tinyshakespeare.txt)
ENCODER=$(pick dev/data/gpt2/encoder.json $SHARED/gpt2/encoder.json)
BPE=$(pick dev/data/gpt2/vocab.bpe $SHARED/gpt2/vocab.bpe)
HELDOUT=$(pick $SHARED/heldout.txt)
GPT2=(--encoder "$ENCODER" --bpe "$BPE")

# Runs a command that must fail: exit status 1 and one stderr line "error: ...PATTERN...".
expect_error() {
  local what=$1 pattern=$2; shift 2
  "$@" >$WORK/out 2>$WORK/err
  local rc=$? lines
  lines=$(wc -l <$WORK/err)
  if [ $rc -eq 1 ] && [ "$lines" -eq 1 ] && grep -q '^error: ' $WORK/err &&
     grep -qF -- "$pattern" $WORK/err; then
    pass "$what: $(cat $WORK/err)"
  else
    fail "$what: expected exit 1 and one line 'error: ...$pattern...', got exit $rc and:"
    cat $WORK/err
  fi
}

# Compares FILE with the sha256 it must have, and with the reference copy when there is one.
expect_sha() {
  local what=$1 file=$2 sum=$3 reference=${4:-}
  if [ "$(sha256 "$file")" = "$sum" ]; then pass "$what"; return; fi
  fail "$what: $file has sha256 $(sha256 "$file"), expected $sum"
  [ -n "$reference" ] && [ -f "$reference" ] && cmp "$file" "$reference" | head -1
}

# --- errors that need no data ----------------------------------------------------------
expect_error "no command" "no command given" $TOK
expect_error "unknown command" "unknown command 'tokenise'" $TOK tokenise x
expect_error "unknown option" "unknown option '--bogus'" $TOK encode --bogus x
expect_error "option without value" "option --out needs a value" $TOK prepare x --out
expect_error "prepare-only option" "--out is only for prepare" $TOK encode --out d x
expect_error "bad number" "--shard-tokens expects a whole number" \
  $TOK prepare --out $WORK --shard-tokens 10k x
expect_error "two files for encode" "exactly one FILE" $TOK encode a b
expect_error "prepare without --out" "prepare needs --out DIR" $TOK prepare x
expect_error "val and shard" "cannot be combined" \
  $TOK prepare --out $WORK --val-tokens 5 --shard-tokens 5 x
$TOK --help | grep -q "usage: dev/data/tokenize" && pass "--help" || fail "--help prints no usage"
# A copy of the tool outside any checkout finds no GPT-2 files and says what to do.
lonely=$(mktemp -d)
mkdir -p "$lonely/dev/data" && cp $TOK "$lonely/dev/data/"
expect_error "no GPT-2 files" "run \`make data\` or pass --encoder PATH" \
  "$lonely/dev/data/tokenize" encode /dev/null
rm -rf "$lonely"

if [ -z "$ENCODER" ] || [ -z "$BPE" ] || [ -z "$SHAKESPEARE" ]; then
  echo "SKIP: ../shared/data not found (nor dev/data/ from \`make data\`): tests with GPT-2 files skipped"
  [ $fails -eq 0 ] || { echo "test_tokenizer.sh: $fails FAILED"; exit 1; }
  exit 0
fi
echo "using $SHAKESPEARE, $ENCODER, $BPE${HELDOUT:+, $HELDOUT}"

# --- errors with GPT-2 files -----------------------------------------------------------
expect_error "missing input" "cannot open input file '$WORK/nope.txt'" \
  $TOK encode "${GPT2[@]}" $WORK/nope.txt
expect_error "missing prepare input" "cannot open input file '$WORK/nope.txt'" \
  $TOK prepare "${GPT2[@]}" --out $WORK/p $WORK/nope.txt
touch $WORK/a_file
expect_error "output dir is a file" "'$WORK/a_file' exists and is not a directory" \
  $TOK prepare "${GPT2[@]}" --out $WORK/a_file "$SHAKESPEARE"
expect_error "output dir under a file" "exists and is not a directory" \
  $TOK prepare "${GPT2[@]}" --out $WORK/a_file/sub "$SHAKESPEARE"
expect_error "too few tokens" "nothing is left for training" \
  $TOK prepare "${GPT2[@]}" --out $WORK/few --val-tokens 400000 "$SHAKESPEARE"
[ -z "$(ls $WORK/few 2>/dev/null)" ] && pass "a failed prepare leaves no files" ||
  fail "a failed prepare left files: $(ls $WORK/few)"
printf '{"a": 1,}' >$WORK/bad.json
expect_error "malformed encoder.json" "$WORK/bad.json: invalid JSON at byte offset 8" \
  $TOK encode --encoder $WORK/bad.json --bpe "$BPE" /dev/null
printf '#version: 0.2\nh e\nbad\n' >$WORK/bad.bpe
expect_error "malformed vocab.bpe" "$WORK/bad.bpe line 3: expected a merge" \
  $TOK encode --encoder "$ENCODER" --bpe $WORK/bad.bpe /dev/null
printf '15496 50257 11\n' >$WORK/bad_ids.txt
expect_error "id out of range" "byte offset 6: token id 50257 is out of range" \
  $TOK decode --encoder "$ENCODER" $WORK/bad_ids.txt
printf '15496 12x\n' >$WORK/bad_ids.txt
expect_error "not an id" "byte offset 8: expected a token id (digits), got 'x'" \
  $TOK decode --encoder "$ENCODER" $WORK/bad_ids.txt
# A vocabulary of 65537 tokens (the 256 bytes, <|endoftext|>, filler): id 65536 cannot be
# stored as uint16. Keys are the bytes' code points in GPT-2's alphabet, as \u escapes.
awk 'BEGIN {
  printf "{"; n = 0
  for (b = 0; b < 256; b++) {
    printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174
    printf "\"\\u%04x\": %d, ", printable ? b : 256 + n++, b
  }
  printf "\"<|endoftext|>\": 256"
  for (i = 257; i < 65537; i++) printf ", \"x%d\": %d", i, i
  printf "}"
}' >$WORK/big.json
printf '#version: 0.2\n' >$WORK/none.bpe
expect_error "vocabulary too big for uint16" "ids >= 65536 cannot be stored as uint16" \
  $TOK prepare --encoder $WORK/big.json --bpe $WORK/none.bpe --out $WORK/big "$SHAKESPEARE"

# --- encode: GPT-2's ids for the first 1000 characters (ASCII, so 1000 bytes) ----------
head -c 1000 "$SHAKESPEARE" >$WORK/first1000.txt
$TOK encode "${GPT2[@]}" $WORK/first1000.txt >$WORK/first1000.ids
expect_sha "encode first 1000 chars" $WORK/first1000.ids \
  155d340379ce6538dba25eafd72050c9969f5a522129dc08106f18cba5b74619 $SHARED/gpt2/tinyshakespeare_first1000.tokens.txt
head -c 1000 "$SHAKESPEARE" | $TOK encode "${GPT2[@]}" - | cmp -s - $WORK/first1000.ids &&
  pass "encode from stdin" || fail "encode - (stdin) differs from encode FILE"

# --- prepare: llm.c's tiny Shakespeare files ---------------------------------------------
start=$(date +%s%N)
$TOK prepare "${GPT2[@]}" --out $WORK/ts --name tiny_shakespeare --tokenizer-out $WORK/tok.bin \
  "$SHAKESPEARE" >/dev/null || fail "prepare exited with an error"
echo "prepare took $(( ($(date +%s%N) - start) / 1000000 )) ms"
expect_sha "prepare val" $WORK/ts/tiny_shakespeare_val.bin \
  fe99db720dc7c83e694806d4e047a952909411da1daccde4ccc2e55f40882a62 $SHARED/gpt2/tiny_shakespeare_val.bin
expect_sha "prepare train" $WORK/ts/tiny_shakespeare_train.bin \
  8a70606be574040c26d225694f5f9759973b419852d22f7fe5c118e1b359dcc8 $SHARED/gpt2/tiny_shakespeare_train.bin
# the tokenizer file as the format defines it for this encoder.json (computed independently)
expect_sha "tokenizer file" $WORK/tok.bin 6f3abc21e444e4e8300e225f4e03da48ea121cf17e30f67009b8dad7a66c2f13

# Shards: val shard first, then train shards; together the same token stream, same headers.
$TOK prepare "${GPT2[@]}" --out $WORK/sh --name ts --shard-tokens 100000 "$SHAKESPEARE" >/dev/null
names=$(cd $WORK/sh && ls | tr '\n' ' ')
[ "$names" = "ts_train_000001.bin ts_train_000002.bin ts_train_000003.bin ts_val_000000.bin " ] &&
  pass "shard names" || fail "shard names: $names"
payload() { for f in "$@"; do tail -c +1025 "$f"; done; }  # the uint16 ids after the header
payload $WORK/ts/tiny_shakespeare_{val,train}.bin >$WORK/whole.u16
payload $WORK/sh/ts_val_000000.bin $WORK/sh/ts_train_00000{1,2,3}.bin >$WORK/shards.u16
cmp -s $WORK/whole.u16 $WORK/shards.u16 && pass "shards hold the same tokens" ||
  fail "shards differ from val+train"
header=$(od -An -t d4 -N 12 $WORK/sh/ts_train_000003.bin | tr -s ' ')
[ "$header" = " 20240520 1 38028" ] && pass "last shard header" || fail "last shard header: $header"

# --- round trips ---------------------------------------------------------------------------
round_trip() {
  local what=$1 file=$2
  if $TOK encode "${GPT2[@]}" "$file" >$WORK/rt.ids &&
     $TOK decode --encoder "$ENCODER" $WORK/rt.ids >$WORK/rt.out && cmp -s "$file" $WORK/rt.out; then
    pass "round trip: $what"
  else
    cp "$file" $WORK/failed_input.bin
    fail "round trip: $what (input kept as $WORK/failed_input.bin)"
  fi
}
if [ -n "$HELDOUT" ]; then round_trip "heldout.txt" "$HELDOUT"
else echo "SKIP: ../shared/data not found: heldout.txt round trip"; fi
round_trip "tiny Shakespeare" "$SHAKESPEARE"
for size in 0 1 2 3 5 64 4096 100000 2500000; do  # the last spans the tool's 1 MiB reads
  head -c $size /dev/urandom >$WORK/random.bin
  round_trip "$size random bytes" $WORK/random.bin
done

if [ $fails -ne 0 ]; then echo "test_tokenizer.sh: $fails FAILED"; exit 1; fi
echo "test_tokenizer.sh: all passed"
