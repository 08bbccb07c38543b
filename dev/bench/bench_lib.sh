# Sourced by the benchmark scripts (from the repository root).

# median: the median of the numbers on stdin, one a line.
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# random_d12_checkpoint G: prints the path of a random d12 checkpoint (GPT-2 124M's shape),
# written once to build/bench_serve/ by one step at learning rate 0 (the initial weights), with
# the token file G/tiny_shakespeare_train.bin.
random_d12_checkpoint() {
  local ckpt=build/bench_serve/ck/model_00000001.bin
  if [ ! -s "$ckpt" ]; then
    echo "writing a random d12 checkpoint to $ckpt (once)" >&2
    ./train_gpt2 -e d12 -i "$1/tiny_shakespeare_train.bin" -b 1 -t 64 -x 1 -l 0 -v 0 -s 0 -n 1 \
      -o build/bench_serve/ck >build/bench_serve.train.out 2>&1 || { tail -3 build/bench_serve.train.out >&2; return 1; }
    rm -f build/bench_serve/ck/state_*.bin
  fi
  echo "$ckpt"
}
