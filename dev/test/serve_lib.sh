# The servers' tests' shared part (sourced by test_serve.sh and test_serve_cu.sh, which set W, D,
# CK and fail): a server on checkpoint $CK, its output in $W/server.out.
start_server() {   # flags...: URL and SERVER_PID of a fresh $SERVE_BIN (default ./serve_gpt2)
  "${SERVE_BIN:-./serve_gpt2}" -e "$CK" --port 0 --encoder $D/encoder.json --bpe $D/vocab.bpe "$@" >"$W/server.out" 2>&1 &
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
