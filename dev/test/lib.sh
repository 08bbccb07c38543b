# Shared by the multi-rank end-to-end tests (source it after setting W, the work directory).
MPI=dev/test/mpi.sh
BIN=./train_gpt2

fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }

# run NAME NP args...: train_gpt2 on NP ranks, output in $W/NAME.out; fails the test on error
run() {
  local name=$1 np=$2; shift 2
  $MPI "$np" $BIN "$@" >"$W/$name.out" 2>&1 || { tail -20 "$W/$name.out"; fail "$name: exit code $?"; }
}

# same REF NAME STEP: the logs, the samples and the checkpoint of STEP of two runs are identical
same() {
  cmp -s "$W/$1/main.log" "$W/$2/main.log" || fail "$2: losses differ from $1"
  cmp -s "$W/$1/model_$(printf %08d "$3").bin" "$W/$2/model_$(printf %08d "$3").bin" || fail "$2: parameters differ from $1"
  diff <(grep -A2 generating "$W/$1.out") <(grep -A2 generating "$W/$2.out") >/dev/null || fail "$2: samples differ from $1"
}

# kill_one_rank NP INDEX args...: start a long job on NP ranks, kill its INDEX-th rank with
# SIGKILL once it trains, and expect the job to end with an error within a minute (no hang)
kill_one_rank() {
  local np=$1 index=$2; shift 2
  $MPI "$np" $BIN "$@" -o "$W/kill" >"$W/kill.out" 2>&1 &
  local job=$!
  for _ in $(seq 200); do [ -s "$W/kill/main.log" ] && break; sleep 0.1; done
  local victim
  victim=$(pgrep -f "train_gpt2 .*$W/kill" | sed -n "${index}p")
  [ -n "$victim" ] || fail "could not find a rank to kill"
  kill -9 "$victim"
  local start
  start=$(date +%s)
  wait $job && fail "the job survived a killed rank"
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "the job took too long to notice a killed rank"
}
