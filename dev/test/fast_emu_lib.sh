# dev/test/fast_emu_lib.sh: what the several-rank fast-mode tests on the emulated GPU share
# (test_fast_pp.sh, test_fast_tp.sh), sourced after lib.sh with $W their scratch directory:
# the binaries they need, synthetic V=512 tokens, the model and run flags ARGS (4 layers, C=32,
# NH=2, 4 microbatches of B*T = 32 a step, validation and a sample at the end), FAST, and run.
export OMP_NUM_THREADS=1   # 2 shared cores: OpenMP threads would only wait on each other
for f in ./train_gpt2 ./train_gpt2cu_emu build/testdata; do [ -x "$f" ] || fail "$f is not built (make test builds it)"; done

build/testdata tokens "$W/train.bin" 20000 512 1 || fail "could not write test tokens"
build/testdata tokens "$W/val.bin" 3000 512 2 || fail "could not write test tokens"
ARGS=(-e d4c32h2v512t32 -i "$W/train.bin" -j "$W/val.bin" -b 1 -t 32 -d 128 -l 1e-3 --shuffle 0
      -x 2 -n 2 -v 2 -m 1 -s 2 -g 4)
FAST=(./train_gpt2cu_emu --deterministic 0)

# run NAME NP BIN... : output in $W/NAME (+ NAME.out); fails on an error exit
run() {
  local name=$1 np=$2; shift 2
  $MPI "$np" "$@" -o "$W/$name" >"$W/$name.out" 2>&1 || { tail -5 "$W/$name.out"; fail "$name: $1 exited with an error"; }
}

# vs_cpu NAME LABEL [LAYERS]: $W/NAME's main.log against ./train_gpt2's ($W/cpu, run first)
# within dev/gpu/fast_tolerance.awk's bf16 tolerances (L = LAYERS, ARGS' 4 unless given; N = the
# step's 128 positions: step 0, then the later steps' drift); passes saying by how much, or
# fails with the table
vs_cpu() {
  local res s0 dr
  res=$(awk -v L="${3:-4}" -v N=128 -v drift="$W/drift.txt" -f dev/gpu/fast_tolerance.awk \
        "$W/cpu/main.log" "$W/cpu/main.log" "$W/$1/main.log")
  s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
  [ "${s0%% *}" = ok ] || { cat "$W/drift.txt"; fail "$2: step 0 vs the CPU: ${s0#* }"; }
  [ "${dr%% *}" = ok ] || { cat "$W/drift.txt"; fail "$2: drift vs the CPU: ${dr#* }"; }
  pass "fast mode $2 vs the CPU: step 0 ${s0#* }; ${dr#* }"
}
