#!/usr/bin/env bash
# Tests the quick start (scripts/quickstart.sh, make train) and the weights' checksum
# (scripts/download_gpt2_weights.sh) without the network: every URL points at a port nothing
# listens on (GPT2_HF_BASE=http://127.0.0.1:9), so any download fails at once.
#  - offline: the download fails, the quick start prints exactly one line saying what failed
#    and how to get the weights by hand, falls back to a fresh model and completes the run
#    (3 steps, a tiny model): validation loss at step 0 and at the end, a sample, a checkpoint,
#    the summary line with main.log's first and last validation loss, the SVG
#  - the sha256 check on local files (GPT2_HF_DIR holds the files, GPT2_HF_API_JSON a listing in
#    Hugging Face's format written here with sha256sum's value of the file): a matching file is
#    imported (byte-identical to the checkpoint it was exported from) and the quick start's GPT-2
#    path runs llm.c's recipe on it; a corrupted file (one byte changed, or one byte longer) is
#    refused with one line naming the file and its actual sha256 (or size), and deleted; the quick
#    start stops on it with one line instead of falling back; a listing without the file is
#    refused with one line
#  - without a GPU, `quickstart.sh gpu` stops at once with one line
# Run from the repository root (make test); needs ./train_gpt2, dev/tools/gpt2_weights and tiny
# Shakespeare (made here by dev/data/tinyshakespeare.sh when missing, offline from ../shared/data).
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d "${TMPDIR:-/tmp}/test_quickstart.XXXXXX")
trap 'rm -rf "$W"' EXIT
fails=0
pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

for t in ./train_gpt2 dev/tools/gpt2_weights; do
  [ -x $t ] || make -s $t >/dev/null || { echo "FAIL: cannot build $t"; exit 1; }
done
if [ ! -s dev/data/tinyshakespeare/tiny_shakespeare_val.bin ] || [ ! -s gpt2_tokenizer.bin ]; then
  dev/data/tinyshakespeare.sh >/dev/null || { echo "FAIL: cannot prepare tiny Shakespeare (make data)"; exit 1; }
fi
export GPT2_HF_BASE=http://127.0.0.1:9   # nothing listens there: a download fails at once
unset GPT2_HF_API_JSON GPT2_ERROR_FILE QUICKSTART_ARGS 2>/dev/null || true
TINY=d2c64h2                             # L=2, C=64, GPT-2's vocabulary: seconds per step
QUICK=(QUICKSTART_STEPS=3 QUICKSTART_FALLBACK_MODEL=$TINY "QUICKSTART_ARGS=-m 2 -g 16")

# lines FILE PATTERN: how many lines of FILE match the extended regex PATTERN
lines() { grep -Eac -- "$2" "$1"; }
# tel LOG: "STEP LOSS" of every validation line of a main.log, read independently of the script
tel() { awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^tel:/) { s = $1; sub(/^s:/, "", s); l = $i; sub(/^tel:/, "", l); print s, l } }' "$1"; }

# --- 1. offline: one line, the fallback, a complete run ------------------------------------
SECONDS=0
env GPT2_OUT_DIR=$W/w1 GPT2_HF_DIR=$W/w1/hf QUICKSTART_OUT=$W/o1 "${QUICK[@]}" \
  scripts/quickstart.sh >$W/o1.out 2>$W/o1.err
rc=$?
secs=$SECONDS
cat $W/o1.out $W/o1.err >$W/o1.all
run=$W/o1/$TINY
if [ $rc -eq 0 ]; then pass "offline quick start exits 0 (${secs} s)"; else fail "offline quick start exited $rc"; cat $W/o1.all; fi
n=$(lines $W/o1.all '^quickstart: no GPT-2 124M: ')
if [ "$n" = 1 ]; then pass "exactly one offline line"; else fail "$n offline lines, expected 1"; cat $W/o1.all; fi
line=$(grep -a '^quickstart: no GPT-2 124M: ' $W/o1.all | head -1)
for want in "127.0.0.1:9" "curl: (7)" "by hand" "scripts/download_gpt2_weights.sh gpt2" "$W/w1/hf/" "fresh $TINY"; do
  case "$line" in *"$want"*) pass "the offline line says '$want'" ;; *) fail "the offline line lacks '$want': $line" ;; esac
done
if [ ! -s $W/o1.err ]; then pass "nothing on stderr offline"; else fail "stderr offline:"; cat $W/o1.err; fi
if [ "$(lines $W/o1.all '^quickstart: ')" = 3 ]; then pass "three quickstart lines: offline, command, summary"
else fail "quickstart lines:"; grep -a '^quickstart: ' $W/o1.all; fi
if [ ! -e $W/w1/gpt2_124M.bin ] && [ -z "$(ls -A $W/w1/hf 2>/dev/null)" ]; then pass "no weights or partial downloads left"
else fail "files left: $(ls -A $W/w1 $W/w1/hf 2>&1 | tr '\n' ' ')"; fi
tel $run/main.log >$W/tel1
if [ "$(cat $W/tel1 | cut -d' ' -f1 | tr '\n' ' ')" = "0 3 " ]; then pass "validation at steps 0 and 3"
else fail "validation steps in main.log: $(cut -d' ' -f1 $W/tel1 | tr '\n' ' ')"; fi
if [ "$(lines $run/main.log 'trl:')" = 3 ]; then pass "3 training steps"; else fail "$(lines $run/main.log 'trl:') training steps in main.log"; fi
if [ "$(lines $W/o1.all '^generating:')" = 1 ] && [ -e $run/DONE_00000003 ]; then pass "a sample and a checkpoint at the end"
else fail "no sample or no checkpoint"; fi
first=$(head -1 $W/tel1); last=$(tail -1 $W/tel1)
want="quickstart: val loss ${first#* } at step 0 -> ${last#* } at step 3, "
if grep -aqF -- "$want" $W/o1.all; then pass "summary: $want..."; else fail "no summary '$want'"; tail -2 $W/o1.all; fi
if [ -s $run/loss.svg ] && [ "$(grep -o '<polyline' $run/loss.svg | wc -l)" = 2 ]; then pass "loss.svg with the train and val curves"
elif [ ! -x dev/tools/plot_log ]; then pass "no dev/tools/plot_log: no SVG expected"
else fail "loss.svg missing or without 2 curves"; fi

# a rerun starts over (no checkpoint of the first run left behind)
env GPT2_OUT_DIR=$W/w1 GPT2_HF_DIR=$W/w1/hf QUICKSTART_OUT=$W/o1 QUICKSTART_STEPS=2 \
  QUICKSTART_FALLBACK_MODEL=$TINY "QUICKSTART_ARGS=-m 1 -g 4" scripts/quickstart.sh >$W/o1b.all 2>&1 ||
  fail "the rerun exited $?"
if [ ! -e $run/DONE_00000003 ] && [ -e $run/DONE_00000002 ] && [ "$(tel $run/main.log | wc -l)" = 2 ]; then
  pass "a rerun starts over"
else fail "a rerun left the first run's files: $(ls $run | tr '\n' ' ')"; fi

# --- 2. the checksum, on local files -----------------------------------------------------------
# GPT-2-shaped weights: the fallback run's checkpoint exported as Hugging Face's files
ck=$run/model_00000002.bin
mkdir -p $W/hf
dev/tools/gpt2_weights export $ck $W/hf/model.safetensors >/dev/null || fail "export of $ck"
cp $W/hf/model.safetensors $W/good.safetensors
sha=$(sha256sum $W/good.safetensors | cut -d' ' -f1)
size=$(wc -c <$W/good.safetensors | tr -d ' ')
other=$(printf 'another file' | sha256sum | cut -d' ' -f1)
# Hugging Face's tree listing (https://huggingface.co/api/models/openai-community/gpt2/tree/main):
# a JSON array, LFS files with "lfs":{"oid":SHA256,"size":N,"pointerSize":..}; decoys around it
listing() {   # listing SHA SIZE
  printf '[{"type":"file","oid":"4b6f3b6a","size":445,"path":".gitattributes"},'
  printf '{"type":"file","oid":"9f9d1c1d","size":%s,"lfs":{"oid":"%s","size":%s,"pointerSize":135},"path":"flax_model.msgpack"},' 111 "$other" 111
  printf '{"type":"file","oid":"1f2e3d4c","size":%s,"lfs":{"oid":"%s","size":%s,"pointerSize":135},"path":"model.safetensors"},' "$2" "$1" "$2"
  printf '{"type":"file","oid":"5a6b7c8d","size":7,"lfs":{"oid":"%s","size":7,"pointerSize":134},"path":"model.safetensors.index.json"},' "$other"
  printf '{"type":"directory","oid":"0a0b0c0d","size":0,"path":"onnx"}]\n'
}
listing $sha $size >$W/tree.json
# the same, pretty-printed (one key per line, as a browser saves it)
sed -e 's/,"/,\n    "/g' -e 's/{/{\n    /g' -e 's/}/\n}/g' $W/tree.json >$W/tree_pretty.json
listing $other $size >$W/tree_othersha.json
printf '[{"type":"file","oid":"4b6f3b6a","size":445,"path":".gitattributes"}]\n' >$W/tree_nomodel.json

# dl NAME LISTING: the download script on $W/hf with LISTING; output in $W/NAME.{out,err}, status in $rc
dl() {
  rc=0
  env GPT2_HF_DIR=$W/hf GPT2_OUT_DIR=$W/$1 GPT2_HF_API_JSON=$2 scripts/download_gpt2_weights.sh gpt2 \
    >$W/$1.out 2>$W/$1.err || rc=$?
}
# refused NAME STATUS WORDS...: exit STATUS, exactly one stderr line that has each of WORDS, no
# checkpoint written, model.safetensors deleted
refused() {
  local name=$1 status=$2 w ok=1; shift 2
  [ $rc -eq $status ] || { fail "$name: exit status $rc, expected $status"; ok=0; }
  [ "$(wc -l <$W/$name.err)" = 1 ] || { fail "$name: $(wc -l <$W/$name.err) stderr lines, expected 1:"; cat $W/$name.err; ok=0; }
  for w in "$@"; do grep -qF -- "$w" $W/$name.err || { fail "$name: the error line lacks '$w': $(cat $W/$name.err)"; ok=0; }; done
  [ ! -e $W/$name/gpt2_124M.bin ] || { fail "$name: a checkpoint was written"; ok=0; }
  [ $ok = 1 ] && pass "$name: refused with one line: $(cut -c1-110 $W/$name.err)..."
}

for l in tree tree_pretty; do
  cp $W/good.safetensors $W/hf/model.safetensors
  dl good_$l $W/$l.json
  if [ $rc -eq 0 ] && cmp -s $W/good_$l/gpt2_124M.bin $ck; then
    pass "$l.json: the matching file is imported, byte-identical to the checkpoint it came from"
  else fail "$l.json: exit $rc or a different checkpoint"; cat $W/good_$l.out $W/good_$l.err; fi
done

# one byte changed: same size, another sha256 (computed here, before the script deletes it)
cp $W/good.safetensors $W/hf/model.safetensors
printf '\x5a' | dd of=$W/hf/model.safetensors bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
bad=$(sha256sum $W/hf/model.safetensors | cut -d' ' -f1)
[ "$bad" != "$sha" ] || { printf '\xa5' | dd of=$W/hf/model.safetensors bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
                          bad=$(sha256sum $W/hf/model.safetensors | cut -d' ' -f1); }
dl corrupt $W/tree.json
refused corrupt 3 "error: download_gpt2_weights.sh: " "$W/hf/model.safetensors" "sha256 $bad" "$sha" "deleted"
[ ! -e $W/hf/model.safetensors ] && pass "the corrupted file is deleted" || fail "the corrupted file is still there"

# one byte longer
cp $W/good.safetensors $W/hf/model.safetensors; printf 'x' >>$W/hf/model.safetensors
dl longer $W/tree.json
refused longer 3 "$W/hf/model.safetensors" "$((size + 1)) bytes" "$size" "deleted"

# the listing names another sha256 for the right size
cp $W/good.safetensors $W/hf/model.safetensors
dl othersha $W/tree_othersha.json
refused othersha 3 "sha256 $sha" "$other"

# a listing without model.safetensors: refused before anything is downloaded or deleted
cp $W/good.safetensors $W/hf/model.safetensors
dl nomodel $W/tree_nomodel.json
refused nomodel 1 "$W/tree_nomodel.json" "model.safetensors"
[ -e $W/hf/model.safetensors ] && pass "nomodel: the weights are left alone" || fail "nomodel: the weights were deleted"

# the quick start's GPT-2 path on the verified file: llm.c's recipe (constant lr 1e-4), 2 steps
mkdir -p $W/hf2; cp $W/good.safetensors $W/hf2/model.safetensors; cp $W/hf/config.json $W/hf2/
rc=0
env GPT2_OUT_DIR=$W/w2 GPT2_HF_DIR=$W/hf2 GPT2_HF_API_JSON=$W/tree.json QUICKSTART_OUT=$W/o2 \
  QUICKSTART_STEPS=2 "QUICKSTART_ARGS=-m 1 -g 4" scripts/quickstart.sh >$W/o2.all 2>&1 || rc=$?
log=$W/o2/gpt2_124M/main.log
if [ $rc -eq 0 ] && [ "$(tel $log | cut -d' ' -f1 | tr '\n' ' ')" = "0 2 " ] && cmp -s $W/w2/gpt2_124M.bin $ck &&
   [ "$(lines $W/o2.all 'no GPT-2 124M')" = 0 ] &&
   awk '/trl:/ { n++; for (i = 1; i <= NF; i++) if ($i ~ /^lr:/) { lr = substr($i, 4) + 0; if (lr < 0.99e-4 || lr > 1.01e-4) bad = 1 } }
        END { exit !(n == 2 && !bad) }' $log; then
  pass "the GPT-2 path: verified, imported, 2 steps at lr 1e-4, validation at 0 and 2"
else fail "the GPT-2 path: exit $rc"; tail -5 $W/o2.all; [ -f $log ] && cat $log; fi

# the quick start on a corrupted file stops with one line (no fallback, no run)
printf 'x' >>$W/hf2/model.safetensors; rm -f $W/w2/gpt2_124M.bin
rc=0
env GPT2_OUT_DIR=$W/w2 GPT2_HF_DIR=$W/hf2 GPT2_HF_API_JSON=$W/tree.json QUICKSTART_OUT=$W/o3 \
  QUICKSTART_STEPS=2 scripts/quickstart.sh >$W/o3.out 2>$W/o3.err || rc=$?
if [ $rc -ne 0 ] && [ "$(wc -l <$W/o3.err)" = 1 ] && grep -q "^error: quickstart: $W/hf2/model.safetensors has $((size + 1)) bytes" $W/o3.err &&
   [ ! -e $W/o3/gpt2_124M/main.log ] && [ ! -e $W/o3/d4/main.log ] && [ "$(lines $W/o3.out 'no GPT-2 124M')" = 0 ]; then
  pass "the quick start stops on a corrupted file: $(cut -c1-100 $W/o3.err)..."
else fail "the quick start on a corrupted file: exit $rc"; cat $W/o3.out $W/o3.err; fi

# --- 3. gpu without a GPU ------------------------------------------------------------------------
if nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1; then
  pass "a GPU is present: the no-GPU error is not tested here"
else
  rc=0
  SECONDS=0
  QUICKSTART_OUT=$W/o4 scripts/quickstart.sh gpu >$W/o4.out 2>$W/o4.err || rc=$?
  if [ $rc -ne 0 ] && [ "$(wc -l <$W/o4.err)" = 1 ] && grep -q '^error: quickstart: no NVIDIA GPU found' $W/o4.err &&
     [ ! -s $W/o4.out ] && [ $SECONDS -lt 10 ]; then
    pass "gpu without a GPU: one line at once: $(cat $W/o4.err)"
  else fail "gpu without a GPU: exit $rc"; cat $W/o4.out $W/o4.err; fi
fi

if [ $fails -ne 0 ]; then echo "$fails check(s) FAILED"; exit 1; fi
echo "all quick start checks passed"
