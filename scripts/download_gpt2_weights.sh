#!/usr/bin/env bash
# Downloads OpenAI's GPT-2 weights from Hugging Face and imports them into llm.c's checkpoint
# format (fp32, version 3) with dev/tools/gpt2_weights.
#
#   scripts/download_gpt2_weights.sh [gpt2|gpt2-medium|gpt2-large|gpt2-xl]   (default gpt2)
#
# Files: model.safetensors and config.json go to $GPT2_HF_DIR (default
# dev/data/gpt2_hf/<name>/); the checkpoint to $GPT2_OUT_DIR (default: the repository root)
# under llm.c's names gpt2_124M.bin, gpt2_350M.bin, gpt2_774M.bin, gpt2_1558M.bin.
# Files already there are used as they are (downloads go to *.part first, so a broken
# download never looks complete). Offline, place the two files by hand and rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

name=${1:-gpt2}
case "$name" in
  gpt2)        out=gpt2_124M.bin;  size="0.5 GB" ;;
  gpt2-medium) out=gpt2_350M.bin;  size="1.5 GB" ;;
  gpt2-large)  out=gpt2_774M.bin;  size="3.3 GB" ;;
  gpt2-xl)     out=gpt2_1558M.bin; size="6.4 GB" ;;
  -h|--help)   sed -n '2,12p' "$0"; exit 0 ;;
  *) echo "error: unknown model '$name': expected gpt2, gpt2-medium, gpt2-large or gpt2-xl" >&2; exit 1 ;;
esac
dir=${GPT2_HF_DIR:-dev/data/gpt2_hf/$name}
out_dir=${GPT2_OUT_DIR:-.}
base="https://huggingface.co/openai-community/$name/resolve/main"
mkdir -p "$dir" "$out_dir"

fetch() {   # fetch FILE: $base/FILE -> $dir/FILE unless present
  local file=$1 dest="$dir/$1"
  if [ -s "$dest" ]; then echo "using existing $dest"; return 0; fi
  echo "downloading $base/$file -> $dest"
  if ! curl --fail --location --connect-timeout 10 --retry 2 --retry-connrefused \
            --speed-limit 1024 --speed-time 60 --progress-bar \
            -o "$dest.part" "$base/$file"; then
    rm -f "$dest.part"
    echo "error: could not download $base/$file (offline, or Hugging Face unreachable)." >&2
    echo "       Download it elsewhere and place it at $dest (config.json and model.safetensors of" >&2
    echo "       openai-community/$name, $size), then rerun: $0 $name" >&2
    exit 1
  fi
  mv "$dest.part" "$dest"
}

command -v curl >/dev/null || { echo "error: curl not found; install it, or place $dir/model.safetensors and $dir/config.json by hand" >&2; exit 1; }
fetch config.json
fetch model.safetensors

if [ ! -x dev/tools/gpt2_weights ] || [ dev/tools/gpt2_weights.c -nt dev/tools/gpt2_weights ]; then
  make -s dev/tools/gpt2_weights
fi
dev/tools/gpt2_weights import "$dir/model.safetensors" "$out_dir/$out" --config "$dir/config.json"
