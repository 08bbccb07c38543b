# The servers' tests' shared part, sourced by test_serve.sh and test_serve_cu.sh from the
# repository root: the tokenizer's files ($D), the JSON tool ($J), a work directory ($W) removed
# at exit with any server left running, fail and pass; a server on checkpoint $CK, its output in
# $W/server.out.
D=${LLMC_SHARED_DATA:-../shared/data}/gpt2   # override with LLMC_SHARED_DATA
J=build/serve_json
W=$(mktemp -d "/tmp/llmc_$(basename "$0" .sh).XXXXXX")
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill -9 "$SERVER_PID" 2>/dev/null; fi
  rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -f "$W/server.out" ] && tail -5 "$W/server.out"; exit 1; }
pass() { echo "ok   $* (${SECONDS}s)"; }
export OMP_NUM_THREADS=1   # the engine's kernels on one core each: the same bits, less contention here

start_server() {   # flags...: URL and SERVER_PID of a fresh $SERVE_BIN (default ./serve_gpt2),
                   # under $SERVE_LAUNCH when set (words, e.g. "dev/test/mpi.sh 2")
  ${SERVE_LAUNCH:-} "${SERVE_BIN:-./serve_gpt2}" -e "$CK" --port 0 --encoder $D/encoder.json --bpe $D/vocab.bpe "$@" >"$W/server.out" 2>&1 &
  SERVER_PID=$!
  local port=
  for _ in $(seq 1200); do   # a minute at most (the emulated GPU starts slowly)
    port=$(grep -o 'http://127.0.0.1:[0-9]*' "$W/server.out" | sed 's/.*://')
    [ -n "$port" ] && break
    sleep 0.05
  done
  [ -n "$port" ] || fail "the server did not start: $(cat "$W/server.out")"
  URL=http://127.0.0.1:$port
}
stop_server() {   # SIGTERM; returns the server's exit status
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID"
  local rc=$?
  SERVER_PID=
  return $rc
}
