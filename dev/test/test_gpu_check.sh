#!/usr/bin/env bash
# dev/gpu/check.sh's dry run, without a GPU, so that the GPU check cannot rot and provably
# fails when it should. DRY_RUN=1: the emulated CUDA trainer (./train_gpt2cu_emu) stands in for
# the deterministic runs, dev/gpu/cpu_as_fast.sh (./train_gpt2) for fast mode, tiny models.
#   clean     every stage runs and passes: exit 0, a complete table (the file, and printed last
#             on stdout), the archive with the logs; the benchmark's "largest B that fits"
#             falls back from B=32 (a wrapper says "out of GPU memory" there) to B=16
#   negative  each must exit non-zero with a FAIL (or SKIP) row naming the check:
#             - one logged loss corrupted (main.log of the GPU run) -> stage 1
#             - 'nan' printed for a norm on the console            -> stage 3
#             - no real tokens                                      -> stage 2 refuses
#             - a fast-mode step-0 loss off by 0.01                 -> stage 2, step 0
#             - a budget too small for a stage                      -> SKIP, a failure
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_gpu_check_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }
export OMP_NUM_THREADS=1   # 2 shared cores: OpenMP threads would only wait on each other
for f in ./train_gpt2 ./train_gpt2cu_emu build/testdata; do
  [ -x "$f" ] || fail "$f is not built (make test builds it)"
done
if [ ! -f dev/data/tinyshakespeare/tiny_shakespeare_train.bin ]; then
  make data >"$W/data.out" 2>&1 || { tail -3 "$W/data.out"; fail "make data failed: the dry run needs tiny Shakespeare"; }
fi

# the stand-ins: each runs the emulated trainer and damages one thing
EMU=$PWD/train_gpt2cu_emu
cat >"$W/emu_oom.sh" <<EOF
#!/usr/bin/env bash
# B=32 "does not fit": the benchmark must go on to B=16
case " \$* " in *" -b 32 "*) echo "error: out of GPU memory allocating 9.99 GiB for activations (dry-run wrapper)"; exit 1 ;; esac
exec "$EMU" "\$@"
EOF
cat >"$W/emu_corrupt.sh" <<EOF
#!/usr/bin/env bash
# one logged loss off by one part in a million: step 2's train loss in DIR/main.log
"$EMU" "\$@" || exit
dir=""; prev=""
for a in "\$@"; do [ "\$prev" = -o ] && dir=\$a; prev=\$a; done
[ -n "\$dir" ] && awk '/^s:2 trl:/ { split(\$2, p, ":"); \$2 = sprintf("trl:%.9g", p[2] * (1 + 1e-6)) } { print }' "\$dir/main.log" >"\$dir/x" && mv "\$dir/x" "\$dir/main.log"
EOF
cat >"$W/emu_nan.sh" <<EOF
#!/usr/bin/env bash
# the console says "norm nan" on step 2 (main.log keeps the number)
set -o pipefail
"$EMU" "\$@" | sed -E '/^step +2\\// s/norm [0-9.]+/norm nan/'
EOF
cat >"$W/fast_off.sh" <<EOF
#!/usr/bin/env bash
# fast mode's step-0 loss 0.01 higher than the CPU's (tolerance: ~4e-3 for this tiny model)
"$PWD/dev/gpu/cpu_as_fast.sh" "\$@" || exit
dir=""; prev=""
for a in "\$@"; do [ "\$prev" = -o ] && dir=\$a; prev=\$a; done
[ -n "\$dir" ] && awk '/^s:0 trl:/ { split(\$2, p, ":"); \$2 = sprintf("trl:%.9g", p[2] + 0.01) } { print }' "\$dir/main.log" >"\$dir/x" && mv "\$dir/x" "\$dir/main.log"
EOF
chmod +x "$W"/*.sh

# check NAME ENV...: runs dev/gpu/check.sh with DRY_RUN=1 and the given settings; output in
# $W/NAME.out, table in $W/NAME/check_table.txt; sets RC
check() {
  local name=$1
  shift
  env DRY_RUN=1 OUT="$W/$name" BUDGET="${BUDGET:-240}" "$@" dev/gpu/check.sh >"$W/$name.out" 2>&1
  RC=$?
}
# has NAME REGEX: the table has a row matching REGEX
has() { grep -Eq "$2" "$W/$1/check_table.txt"; }
show() { echo "----- $1 -----"; cat "$W/$1.out"; echo "-----"; }

# --- clean: every stage, exit 0 ---
check clean GPU_BIN="$W/emu_oom.sh"
[ $RC = 0 ] || { show clean; fail "clean dry run: exit $RC, expected 0"; }
for r in '^INFO  machine' '^INFO  0\. build' '^PASS  1\. deterministic == CPU' '^PASS  1\. deterministic resume' \
         '^PASS  2\. fast \(cudnn\): step 0' '^PASS  2\. fast \(cudnn\): drift' '^PASS  2\. fast \(cudnn\): learns' \
         '^PASS  2\. fast \(flash\): step 0' '^PASS  2\. fast \(flash\): drift' '^PASS  2\. fast \(flash\): learns' \
         '^PASS  2\. fast cuDNN vs flash' '^PASS  4\. 2 ranks -z 3 --comm mpi' '^PASS  4\. 2 ranks --tp 2 --comm mpi' \
         '^PASS  4\. 2 ranks --pp 2 --comm mpi' '^PASS  4\. fast 4 ranks --tp 2 --pp 2 --schedule zb1 --comm mpi' \
         '^PASS  4\. fast 2 ranks --cp 2 --cp-mode a2a --comm mpi' \
         '^PASS  4\. fast 2 ranks --cp 2 --cp-mode ring --comm mpi' '^PASS  4\. fast 2 ranks experts --tp 2 --comm mpi' \
         '^PASS  4\. fast 4 ranks --cp 2 --tp 2 --sp 1 --cp-mode ring --comm mpi' \
         '^PASS  4\. fast 4 ranks --cp 2 --pp 2 --schedule zb1 --cp-mode a2a --comm mpi' \
         '^PASS  4\. fast 2 ranks experts --cp 2 --cp-mode a2a --comm mpi' \
         '^INFO  5\. fast cudnn .*B=32' '^INFO  5\. fast flash .*B=32' \
         '^INFO  5\. deterministic .*B=16: [0-9.]+ tok/s' '^INFO  5\. target: fast MFU' '^INFO  5\. target: deterministic' \
         '^PASS  3\. finite values +[1-9][0-9]* values' '^----  total .*all passed'; do
  has clean "$r" || { show clean; fail "clean dry run: no row matching /$r/"; }
done
! grep -Eq '^(FAIL|SKIP)' "$W/clean/check_table.txt" || { show clean; fail "clean dry run: a FAIL or SKIP row"; }
rows=$(wc -l <"$W/clean/check_table.txt")
[ "$(tail -n "$rows" "$W/clean.out")" = "$(cat "$W/clean/check_table.txt")" ] || { show clean; fail "the table is not printed last on stdout"; }
[ "$(ls "$W/clean")" = "$(printf 'check_logs.tar.gz\ncheck_table.txt')" ] || fail "OUT should hold exactly the table and the archive: $(ls "$W/clean" | tr '\n' ' ')"
tar tzf "$W/clean/check_logs.tar.gz" >"$W/archive.txt" || fail "the archive is not a tar.gz"
for f in logs/s1_cpu.out logs/s1_gpu.out logs/s1_gpu.main.log logs/drift_cudnn_vs_cpu.txt logs/drift_flash_vs_cudnn.txt \
         logs/s4_mpi_z3.out logs/check_table.txt; do
  grep -qx "$f" "$W/archive.txt" || fail "the archive lacks $f"
done
pass "clean dry run: exit 0, $rows rows, table last on stdout, archive of $(wc -l <"$W/archive.txt") entries, B=32 -> 16 on 'out of GPU memory'"

# --- negative cases ---
check corrupt STAGES="1 3" GPU_BIN="$W/emu_corrupt.sh"
[ $RC != 0 ] && has corrupt '^FAIL  1\. deterministic == CPU .*main\.log' || { show corrupt; fail "a corrupted logged loss did not fail stage 1"; }
pass "a corrupted logged loss: exit $RC, $(grep -E '^FAIL  1' "$W/corrupt/check_table.txt" | head -1 | cut -c1-110)"

check nan STAGES="1 3" GPU_BIN="$W/emu_nan.sh"
[ $RC != 0 ] && has nan '^FAIL  3\. finite values: s1_gpu .*norm "nan"' && has nan '^FAIL  3\. finite values  ' ||
  { show nan; fail "'norm nan' on the console did not fail stage 3"; }
pass "'norm nan' on the console: exit $RC, $(grep -E '^FAIL  3' "$W/nan/check_table.txt" | head -1 | cut -c1-110)"

check nodata STAGES="2" DATA_DIR="$W/no_such_dir"
[ $RC != 0 ] && has nodata '^FAIL  2\. fast mode vs CPU \(real tokens\) .*refusing synthetic tokens.*carry dev/data/tinyshakespeare' ||
  { show nodata; fail "missing real tokens did not fail stage 2 with a line saying what to carry"; }
pass "no real tokens: exit $RC, stage 2 refuses synthetic ones and says what to carry"

check fastoff STAGES="2" FAST_BIN="$W/fast_off.sh"
[ $RC != 0 ] && has fastoff '^FAIL  2\. fast \(cudnn\): step 0 vs CPU +loss \|d\| 1\.0e-02' ||
  { show fastoff; fail "a fast-mode step-0 loss off by 0.01 did not fail stage 2"; }
pass "fast-mode step-0 loss off by 0.01: exit $RC, FAIL row for step 0"

BUDGET=5 check budget STAGES="1 2"
[ $RC != 0 ] && has budget '^SKIP  1\. deterministic == CPU' && has budget 'skipped' ||
  { show budget; fail "a stage that does not fit the budget was not a SKIP failure"; }
pass "a budget too small: SKIP rows, exit $RC"
