#!/usr/bin/env bash
# Downloads OpenAI's GPT-2 weights from Hugging Face, checks them against the sha256 Hugging
# Face publishes, and imports them into llm.c's checkpoint format (fp32, version 3) with
# dev/tools/gpt2_weights.
#
#   scripts/download_gpt2_weights.sh [gpt2|gpt2-medium|gpt2-large|gpt2-xl]   (default gpt2)
#
# Files: model.safetensors, config.json and api_tree_main.json (Hugging Face's file listing,
# which holds model.safetensors' sha256 and size) go to $GPT2_HF_DIR (default
# dev/data/gpt2_hf/<name>/); the checkpoint to $GPT2_OUT_DIR (default: the repository root)
# under llm.c's names gpt2_124M.bin, gpt2_350M.bin, gpt2_774M.bin, gpt2_1558M.bin.
# Files already there are used as they are (downloads go to *.part first, so a broken download
# never looks complete), but model.safetensors is checked every time: a size or sha256 that
# differs from the listing's deletes it and fails. Offline: copy that directory from a machine
# where this script ran (or the checkpoint itself) and rerun.
#
# Environment: GPT2_HF_BASE (default https://huggingface.co), GPT2_HF_API_JSON (a listing file
# to use instead of downloading one), GPT2_CONNECT_TIMEOUT (seconds, default 10), GPT2_RETRIES
# (default 2), GPT2_ERROR_FILE (write the error line there instead of to stderr).
# Exit status: 0 done, 1 usage or other error, 2 a download failed (offline? no curl?), 3 a file does not
# match the listing (deleted).
set -euo pipefail
cd "$(dirname "$0")/.."
me=download_gpt2_weights.sh

die() {   # die STATUS MESSAGE: one line, to GPT2_ERROR_FILE when set
  local status=$1; shift
  if [ -n "${GPT2_ERROR_FILE:-}" ]; then printf '%s\n' "$*" >"$GPT2_ERROR_FILE"
  else printf 'error: %s: %s\n' "$me" "$*" >&2; fi
  exit "$status"
}

name=${1:-gpt2}
case "$name" in
  gpt2)        out=gpt2_124M.bin;  size_text="0.5 GB" ;;
  gpt2-medium) out=gpt2_350M.bin;  size_text="1.5 GB" ;;
  gpt2-large)  out=gpt2_774M.bin;  size_text="3.3 GB" ;;
  gpt2-xl)     out=gpt2_1558M.bin; size_text="6.4 GB" ;;
  -h|--help)   sed -n '2,21p' "$0"; exit 0 ;;
  *) die 1 "unknown model '$name': expected gpt2, gpt2-medium, gpt2-large or gpt2-xl" ;;
esac
dir=${GPT2_HF_DIR:-dev/data/gpt2_hf/$name}
out_dir=${GPT2_OUT_DIR:-.}
hf=${GPT2_HF_BASE:-https://huggingface.co}
base="$hf/openai-community/$name/resolve/main"
api_url="$hf/api/models/openai-community/$name/tree/main"
connect=${GPT2_CONNECT_TIMEOUT:-10}
retries=${GPT2_RETRIES:-2}
by_hand="to get the weights by hand, run scripts/download_gpt2_weights.sh $name on a machine that reaches $hf and copy its $dir/ (or $out_dir/$out) to the same place here"
mkdir -p "$dir" "$out_dir"

# fetch URL DEST [progress]: URL -> DEST unless DEST is there; exits 2 naming the reason. Small
# files silently (curl's message kept for the one error line), so that offline, where the first
# small download fails, the error line is all that is printed; with progress, a line and curl's
# progress bar (and its messages) on the terminal.
fetch() {
  local url=$1 dest=$2 err=/dev/null rc=0 reason
  if [ -s "$dest" ]; then echo "using existing $dest"; return 0; fi
  command -v curl >/dev/null || die 2 "curl not found: install it (apt-get install curl), or $by_hand"
  local opts=(--fail --location --connect-timeout "$connect" --retry "$retries" --retry-connrefused
              --speed-limit 1024 --speed-time 60 -o "$dest.part")
  if [ "${3:-}" = progress ]; then
    echo "downloading $url -> $dest"
    curl "${opts[@]}" --progress-bar "$url" || rc=$?
    reason="curl exit status $rc"
  else
    err=$(mktemp)
    curl "${opts[@]}" --silent --show-error "$url" 2>"$err" || rc=$?
    reason=$(grep '^curl: ' "$err" | tail -1) || true
    reason=${reason:-curl exit status $rc}
    rm -f "$err"
  fi
  if [ $rc -ne 0 ]; then
    rm -f "$dest.part"
    die 2 "could not download $url ($reason): $by_hand"
  fi
  mv "$dest.part" "$dest"
}

# listing_entry JSON FILE: prints "SHA256 SIZE" of FILE's "lfs" entry in Hugging Face's tree
# listing (a JSON array of {"type":..,"oid":..,"size":..,"lfs":{"oid":SHA256,"size":N,..},
# "path":FILE}); nothing when FILE is not listed with a well-formed lfs object.
listing_entry() {
  local entry lfs sha size
  # whitespace out, then one array element per line (the lfs object holds no '{' of its own)
  entry=$(tr -d ' \t\r\n' <"$1" | sed 's/},{/}\n{/g' | grep -F "\"path\":\"$2\"" | head -2) || true
  [ "$(printf '%s\n' "$entry" | grep -c .)" = 1 ] || return 0
  lfs=$(printf '%s\n' "$entry" | sed -n 's/.*"lfs":{\([^{}]*\)}.*/\1/p')
  sha=$(printf '%s\n' "$lfs" | sed -n 's/.*"oid":"\([0-9a-f]\{64\}\)".*/\1/p')
  size=$(printf '%s\n' "$lfs" | sed -n 's/.*"size":\([0-9][0-9]*\).*/\1/p')
  [ -n "$sha" ] && [ -n "$size" ] && echo "$sha $size"
  return 0
}

sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

# --- the listing first (small): it says whether we are online and what the weights must be
if [ -n "${GPT2_HF_API_JSON:-}" ]; then
  listing=$GPT2_HF_API_JSON
  [ -f "$listing" ] || die 1 "GPT2_HF_API_JSON=$listing: no such file (a copy of $api_url)"
else
  listing=$dir/api_tree_main.json
  fetch "$api_url" "$listing"
fi
want=$(listing_entry "$listing" model.safetensors)
want_sha=${want% *} want_size=${want#* }
if [ -z "$want" ]; then
  die 1 "$listing does not list model.safetensors with an lfs sha256 and size (not a copy of $api_url? delete it and rerun)"
fi

fetch "$base/config.json" "$dir/config.json"
fetch "$base/model.safetensors" "$dir/model.safetensors" progress

# --- the weights must be what the listing says: the size (cheap) first, then the sha256
model=$dir/model.safetensors
have_size=$(wc -c <"$model" | tr -d ' ')
if [ "$have_size" != "$want_size" ]; then
  rm -f "$model"
  die 3 "$model has $have_size bytes, $listing says $want_size: deleted it, rerun to download it again"
fi
have_sha=$(sha256 "$model")
if [ "$have_sha" != "$want_sha" ]; then
  rm -f "$model"
  die 3 "$model has sha256 $have_sha, $listing says $want_sha: deleted it, rerun to download it again"
fi
echo "verified $model: sha256 $have_sha, $have_size bytes"

if [ ! -x dev/tools/gpt2_weights ] || [ dev/tools/gpt2_weights.c -nt dev/tools/gpt2_weights ]; then
  make -s dev/tools/gpt2_weights
fi
# to a temporary name first, so an interrupted import never leaves a checkpoint that looks done
tmp="$out_dir/$out.tmp.$$"
if ! dev/tools/gpt2_weights import "$model" "$tmp" --config "$dir/config.json"; then
  rm -f "$tmp"
  die 1 "dev/tools/gpt2_weights could not import $model (its error is above)"
fi
mv "$tmp" "$out_dir/$out"
echo "wrote $out_dir/$out"
