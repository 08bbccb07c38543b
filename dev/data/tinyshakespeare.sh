#!/usr/bin/env bash
# Puts tiny Shakespeare and GPT-2's BPE files in place and tokenizes them like llm.c's
# dev/data/tinyshakespeare.py. Run by `make data`; safe to rerun (files that exist and match
# their sha256 are left alone).
#
# Writes, relative to the repository root (llm.c's default locations):
#   dev/data/tinyshakespeare/input.txt                          tiny Shakespeare (char-rnn)
#   dev/data/gpt2/encoder.json, dev/data/gpt2/vocab.bpe         GPT-2's vocabulary and merges
#   dev/data/tinyshakespeare/tiny_shakespeare_{val,train}.bin   llm.c token files
#   gpt2_tokenizer.bin                                          llm.c tokenizer file
#
# Each input is downloaded from its canonical public location and checked against the
# sha256 below (the hashes listed in ../shared/data/SOURCES.md). Without internet, it is
# copied from ../shared/data/ when that directory exists. The outputs are checked too: the
# token files against the bytes llm.c's recipe gives, the tokenizer file against the one
# built from this encoder.json.
set -euo pipefail
cd "$(dirname "$0")/../.."

SHAKESPEARE_URL=https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
GPT2_URL=https://openaipublic.blob.core.windows.net/gpt-2/models/124M
SHARED=${LLMC_SHARED_DATA:-../shared/data}   # override with LLMC_SHARED_DATA

# path | sha256 | url | file under ../shared/data
INPUTS=(
  "dev/data/tinyshakespeare/input.txt|86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed|$SHAKESPEARE_URL|tinyshakespeare.txt"
  "dev/data/gpt2/encoder.json|196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783|$GPT2_URL/encoder.json|gpt2/encoder.json"
  "dev/data/gpt2/vocab.bpe|1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5|$GPT2_URL/vocab.bpe|gpt2/vocab.bpe"
)
# path | sha256
OUTPUTS=(
  "dev/data/tinyshakespeare/tiny_shakespeare_val.bin|fe99db720dc7c83e694806d4e047a952909411da1daccde4ccc2e55f40882a62"
  "dev/data/tinyshakespeare/tiny_shakespeare_train.bin|8a70606be574040c26d225694f5f9759973b419852d22f7fe5c118e1b359dcc8"
  "gpt2_tokenizer.bin|6f3abc21e444e4e8300e225f4e03da48ea121cf17e30f67009b8dad7a66c2f13"
)

say() { echo "tinyshakespeare.sh: $*"; }
die() { echo "error: tinyshakespeare.sh: $*" >&2; exit 1; }

sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}
verified() { [ -f "$1" ] && [ "$(sha256 "$1")" = "$2" ]; }

# After one failed download the machine is taken to be offline: no more waiting on timeouts.
online=1
missing=()
fetch() {
  local path=$1 sum=$2 url=$3 shared=$SHARED/$4 tmp=$1.tmp.$$
  if verified "$path" "$sum"; then say "$path is in place"; return; fi
  [ -e "$path" ] && say "$path does not match its sha256: replacing it"
  mkdir -p "$(dirname "$path")"
  if [ $online = 1 ] && command -v curl >/dev/null &&
     curl -fsSL --connect-timeout 5 --max-time 20 -o "$tmp" "$url"; then
    if verified "$tmp" "$sum"; then mv "$tmp" "$path"; say "downloaded $path"; return; fi
    say "download of $url does not match sha256 $sum"
  else
    online=0
  fi
  rm -f "$tmp"
  if verified "$shared" "$sum"; then
    cat "$shared" >"$tmp" && mv "$tmp" "$path"  # cat: a copy of a read-only file stays writable
    say "copied $path from $shared (download failed)"
    return
  fi
  missing+=("  $path  (sha256 $sum)  from $url")
}

for entry in "${INPUTS[@]}"; do
  IFS='|' read -r path sum url shared <<<"$entry"
  fetch "$path" "$sum" "$url" "$shared"
done
if [ ${#missing[@]} -ne 0 ]; then
  echo "error: tinyshakespeare.sh: downloads failed and $SHARED has no verified copies; place" \
       "these files by hand and rerun:" >&2
  printf '%s\n' "${missing[@]}" >&2
  exit 1
fi

outputs_ok() {
  local entry path sum
  for entry in "${OUTPUTS[@]}"; do
    IFS='|' read -r path sum <<<"$entry"
    verified "$path" "$sum" || return 1
  done
}

if outputs_ok; then say "tokens and gpt2_tokenizer.bin are up to date"; exit 0; fi
[ -x dev/data/tokenize ] || make dev/data/tokenize
dev/data/tokenize prepare --out dev/data/tinyshakespeare --name tiny_shakespeare \
  --encoder dev/data/gpt2/encoder.json --bpe dev/data/gpt2/vocab.bpe \
  --tokenizer-out gpt2_tokenizer.bin dev/data/tinyshakespeare/input.txt
for entry in "${OUTPUTS[@]}"; do
  IFS='|' read -r path sum <<<"$entry"
  verified "$path" "$sum" || die "$path does not have the expected sha256 $sum"
done
say "done"
