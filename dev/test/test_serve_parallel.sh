#!/usr/bin/env bash
# serve_gpt2 across ranks (llmc/serve_parallel.h) under real mpirun (dev/test/mpi.sh) and curl,
# every layout against the one-process server on the same requests, byte for byte:
#   1. a dense d2 checkpoint with 4 heads: --tp 2 (2 ranks), --tp 4 (4 ranks);
#   2. an expert checkpoint (4 experts, top 2, 2 heads): --ep 2 (2 ranks), --tp 2 --ep 2 (4 ranks),
#      each ep rank running the expert layers on its share of a step's rows;
#   each workload: greedy, seeded top-k, 6 concurrent requests of mixed lengths and sampling
#   (the batch-invariance test across ranks), a stream; compared are the token ids, the text,
#   and the FNV-1a of every distribution drawn from (probs_fnv1a: the probabilities' bits);
#   3. the collective bytes per generated token of a lone one-token request (every step one row)
#      against llmc/serve_parallel.h's formulas, computed here from the model's shape and, for the
#      experts' traffic, the routing the one-process server reports for the same request;
#   4. every refused layout: one line naming the flag, non-zero exit;
#   5. a follower rank killed mid-request: a 503 JSON error for the request in flight, an error
#      event ending the stream, one line naming the rank, the server gone (no hang).
set -u
cd "$(dirname "$0")/../.."
. dev/test/serve_lib.sh   # D, J, W, fail, pass; start_server, stop_server
. dev/test/serve_parallel_lib.sh   # train, post, metric, lone_request, routing, toks, PROMPT, workload
export MPI_TIMEOUT=120    # dev/test/mpi.sh: a hung layout fails instead of blocking
train d2c32h4t64 dense
train d2c32h2t64e4k2 moe

# Per generated token of a lone request (lone_request), what rank 0 sent by kind: "TP OTHER EP"
bytes_per_token() {
  lone_request "serve_collective_bytes_total{kind=\"tp\"}" "serve_collective_bytes_total{kind=\"other\"}" \
    "serve_collective_bytes_total{kind=\"ep\"}" | awk '{ print $1 / 8, $2 / 8, $3 / 8 }'
}

# llmc/serve_parallel.h's formulas for one row (N = M = 1), from the model's shape: tp: (2L+1)
# all-reduces of C floats, the head's max (1) and sums (2); other: the step broadcast of
# 2 + (2 + maxT/bs) + 1 ints, the gather of (K-1) * Vp/K floats, with EP (Q-1) ints per MoE layer
tp_formula() {   # K L C
  awk -v K=$1 -v L=$2 -v C=$3 'function ar(n) { return 2 * (K - 1) * int((n + K - 1) / K) * 4 }
                               BEGIN { print (2 * L + 1) * ar(C) + ar(1) + ar(2) }'
}
other_formula() {   # K Q: the broadcast (maxT 64, block size 16), the vocabulary gather (Vp 50304),
                    # and per MoE layer (L = 2) each ep rank's row count to the others (expert_parallel.h)
  echo $(( (2 + (2 + 64 / 16) + 1) * 4 + ($1 - 1) * 50304 / $1 * 4 + 2 * ($2 - 1) * 4 ))
}

layouts() {   # CK NAME NP:FLAGS...: each layout's workload = the one process's
  CK=$1
  local name=$2
  shift 2
  start_server
  workload "${name}_1"
  # an expert model's routing of the lone request, slots per expert over its layers and 8 steps
  # (the one process routes every row itself): what the experts' traffic is recomputed from
  [ "$name" = moe ] && read -r -a slots <<<"$(routing 4 0 2)"
  [ "$name" != moe ] || [ $((slots[0] + slots[1] + slots[2] + slots[3])) = $((8 * 2 * 2)) ] ||
    fail "the one process routed ${slots[*]} slots per expert, not 8 steps x 2 layers x top 2 in all"
  stop_server || fail "$name: the one-process server's exit status after SIGTERM was not 0"
  local l np flags
  for l in "$@"; do
    np=${l%%:*}
    flags=${l#*:}
    SERVE_LAUNCH="dev/test/mpi.sh $np" start_server $flags
    grep -q "serve_gpt2: $np ranks" "$W/server.out" || fail "$name $flags: not $np ranks: $(head -3 "$W/server.out")"
    workload "${name}_$np"
    cmp -s "$W/${name}_1.out" "$W/${name}_$np.out" ||
      fail "$name $flags on $np ranks: answers differ from one process's: $(diff "$W/${name}_1.out" "$W/${name}_$np.out" | head -4)"
    read -r tp other ep <<<"$(bytes_per_token)"
    local K=1 Q=1
    [[ $flags =~ --tp\ ([0-9]+) ]] && K=${BASH_REMATCH[1]}
    [[ $flags =~ --ep\ ([0-9]+) ]] && Q=${BASH_REMATCH[1]}
    local want_tp want_other
    want_tp=$(tp_formula $K 2 32)
    [ "$K" = 1 ] && want_tp=0
    want_other=$(other_formula $K $Q)
    local want_ep=0
    if [ "$name" = moe ]; then
      # each step's one row is rank 0's share (the others' are empty); of its slots (the one
      # process's routing), those to rank 0's experts [0, E/Q) stay, the others go out (and
      # come back: the ep bytes are the sender's). Per step and expert layer rank 0 sends its
      # E/Q counts to each other ep rank, a position and a row of C floats per slot going out,
      # its share's output row of C to each other ep rank (the all-gather); over its tp group
      # the expert layer's all-reduce is over the rows rank 0's experts got, a row per slot
      # that stayed (C/K divides: 2(K-1)C/K*4 bytes a row), in place of the dense MLP's
      read -r want_tp want_ep <<<"$(awk -v K=$K -v Q=$Q -v C=32 -v L=2 -v E=4 -v s="${slots[*]}" '
        function ar(n) { return 2 * (K - 1) * int((n + K - 1) / K) * 4 }
        BEGIN { split(s, slot); stay = out = 0
                for (e = 0; e < E; e++) { if (e < E / Q) stay += slot[e + 1]; else out += slot[e + 1] }
                print ((L + 1) * ar(C) + ar(1) + ar(2)) + stay * 2 * (K - 1) * C / K * 4 / 8,
                      L * (Q - 1) * (E / Q + C) * 4 + out * (C + 1) * 4 / 8 }')"
    fi
    [ "$tp" = "$want_tp" ] || fail "$name $flags: tp bytes per token $tp, the formula says $want_tp"
    [ "$other" = "$want_other" ] || fail "$name $flags: other bytes per token $other, the formula says $want_other"
    [ "$ep" = "$want_ep" ] || fail "$name $flags: ep bytes per token $ep, the formula says $want_ep (routing: ${slots[*]:-none} slots per expert)"
    # SIGTERM to rank 0 (the HTTP server): it finishes, ends the followers, and mpirun exits 0
    kill -TERM "$(awk '/rank pids/ { print $(NF - '$((np - 1))'); exit }' "$W/server.out")"
    wait "$SERVER_PID" || fail "$name $flags: exit status $? after SIGTERM to rank 0: $(tail -3 "$W/server.out")"
    SERVER_PID=
    grep -q '^serve_gpt2: stopped' "$W/server.out" || fail "$name $flags: rank 0 did not stop cleanly: $(tail -3 "$W/server.out")"
    pass "$name: $flags on $np ranks = one process (greedy, top-k, 6 concurrent mixed, stream; probabilities' bits); per token tp $tp B, other $other B, ep $ep B"
  done
}

layouts "$W/dense/model_00000003.bin" dense "2:--tp 2" "4:--tp 4"
layouts "$W/moe/model_00000003.bin" moe "2:--ep 2" "4:--tp 2 --ep 2"

# --- 4. refused layouts ------------------------------------------------------------------
DENSE=$W/dense/model_00000003.bin MOE=$W/moe/model_00000003.bin
refuse "$DENSE" "^error: --tp 3: the tensor-parallel degree must be" --tp 3
refuse "$DENSE" "^error: --tp 8: the number of heads NH must be a multiple" --tp 8
refuse "$DENSE" "^error: --ep 2: the model has no experts" --ep 2
refuse "$MOE" "^error: --ep 3: must divide the model's 4 experts" --ep 3
refuse "$DENSE" "^error: --tp 2 x --ep 1 needs 2 ranks (mpirun -np 2), got 1" --tp 2
pass "refused in one line: --tp 3, --tp 8 (4 heads), --ep on a dense model, --ep 3 (4 experts), too few ranks (--kvp: test_serve_kvp.sh, --pp: test_serve_pp.sh)"

# --- 5. a rank that dies -----------------------------------------------------------------
CK=$DENSE
SERVE_LAUNCH="dev/test/mpi.sh 2" start_server --tp 2 --step-delay-ms 50
follower=$(awk '/rank pids/ { print $NF; exit }' "$W/server.out")
[ -n "$follower" ] || fail "no rank pids printed: $(head -3 "$W/server.out")"
(post inflight "{\"prompt\":[$PROMPT],\"max_tokens\":58,\"temperature\":0,\"ignore_eos\":true}" >"$W/inflight.code") &
client=$!
curl -sN "$URL/v1/completions" -d "{\"prompt\":[$PROMPT],\"max_tokens\":58,\"ignore_eos\":true,\"stream\":true}" >"$W/dying.sse" &
streamer=$!
sleep 1
kill -9 "$follower"
wait "$client" "$streamer"
t0=$SECONDS
wait "$SERVER_PID"
rc=$?
SERVER_PID=
[ "$rc" != 0 ] || fail "the server exited 0 after a rank died"
[ "$(cat "$W/inflight.code")" = 503 ] || fail "the request in flight got HTTP $(cat "$W/inflight.code"), not 503: $(cat "$W/inflight.json")"
$J "$W/inflight.json" error.message >/dev/null || fail "the 503 is not an OpenAI-style JSON error: $(cat "$W/inflight.json")"
grep -q '"error"' "$W/dying.sse" && tail -1 "$W/dying.sse" | grep -q '^$' && grep -q 'data: \[DONE\]' "$W/dying.sse" ||
  fail "the stream in flight did not end with an error event: $(tail -3 "$W/dying.sse")"
[ "$(grep -c "^serve_gpt2: rank 1 (pid $follower) died" "$W/server.out")" = 1 ] ||
  fail "not one line naming the dead rank: $(cat "$W/server.out")"
pass "a killed rank: 503 JSON error and an error event in flight, one line naming rank 1, the server gone $((SECONDS - t0))s later"
