#!/usr/bin/env bash
# serve_gpt2 --pp S (llmc/serve_pipeline.h) under real mpirun (dev/test/mpi.sh) and curl, every
# layout against the one-process server on the same requests, byte for byte:
#   1. a dense d4 checkpoint (4 layers, 4 heads): --pp 2 (2 ranks) in a small cache (16 blocks
#      of 4 positions: one request of maxT, so the concurrent ones are preempted) with prompts
#      in chunks (--max-batch-tokens 8: iterations in flight hold prefill chunks that draw
#      nothing), --pp 2 --kvp 2 (4 ranks: each stage's 2 ranks a KVP pool, in the same small
#      cache, 1/2 of its blocks each), --pp 4 --tp 2 (8 ranks), each against the one process
#      with its default cache and chunks; an expert d2 checkpoint (4 experts, top 2): --pp 2
#      --ep 2 --tp 2 (8 ranks): greedy, seeded top-k, 8 concurrent requests of mixed lengths and
#      sampling (the batch-invariance test across stages, several iterations in flight: the
#      test asserts the pipeline held more than one), a stream; compared are the token ids, the
#      text and the FNV-1a of every distribution drawn from (probs_fnv1a);
#   2. the bytes per generated token of a lone one-token request (every step one row) that rank
#      0 sends and gets back (/metrics), and every other rank's totals at exit, against
#      llmc/serve_pipeline.h's formulas computed here from the model's shape (and the experts'
#      from the one process's routing of the same request);
#   3. refused layouts: one line naming the flag, non-zero exit;
#   4. a stage rank killed mid-request: a 503 JSON error for the request in flight, an error
#      event ending the stream, one line naming the rank, the server gone (no hang).
set -u
cd "$(dirname "$0")/../.."
. dev/test/serve_lib.sh            # D, J, W, fail, pass; start_server, stop_server
. dev/test/serve_parallel_lib.sh   # train, post, metric, lone_request, toks, PROMPT, refuse (its own workload below)
export MPI_TIMEOUT=120    # dev/test/mpi.sh: a hung layout fails instead of blocking

train d4c32h4t64 dense
train d2c32h2t64e4k2 moe
CK=$W/dense/model_00000003.bin
L=4 C=32 NH=4 VP=50304 MAXT=64   # the model's shape
SMALL="--block-size 4 --max-batch-tokens 8 --kv-blocks 16"


workload() {   # TAG: what the answers say into $W/TAG.out (no ids or times)
  local tag=$1 i clients=() temps=(0 1 0.7 1.3)
  post "${tag}_greedy" "{\"prompt\":[$PROMPT],\"max_tokens\":40,\"temperature\":0,\"ignore_eos\":true}" >/dev/null
  post "${tag}_topk" "{\"prompt\":\"First Citizen:\",\"max_tokens\":40,\"temperature\":1,\"top_k\":40,\"seed\":1337,\"ignore_eos\":true}" >/dev/null
  for i in 0 1 2 3 4 5 6 7; do
    local n=$((1 + (i * 7) % 23)) off=$((i * 13)) ids
    ids=$(IFS=,; echo "${toks[*]:$off:$n}")
    (sleep "0.$((i * 3 % 5))"; post "${tag}_mixed_$i" "{\"prompt\":[$ids],\"max_tokens\":$((6 + (i * 11) % 25)),\"temperature\":${temps[$((i % 4))]},\"top_k\":$(((i % 3) * 5)),\"top_p\":0.9,\"seed\":$((100 + i)),\"ignore_eos\":true}" >"$W/${tag}_mixed_$i.code") &
    clients+=($!)
  done
  curl -sN "$URL/v1/completions" -d "{\"prompt\":[$PROMPT],\"max_tokens\":30,\"temperature\":0.8,\"seed\":5,\"ignore_eos\":true,\"stream\":true}" >"$W/${tag}_stream.sse"
  wait "${clients[@]}"
  {
    for r in greedy topk mixed_0 mixed_1 mixed_2 mixed_3 mixed_4 mixed_5 mixed_6 mixed_7; do
      $J "$W/${tag}_$r.json" choices.0.token_ids choices.0.text choices.0.probs_fnv1a choices.0.finish_reason ||
        echo "no answer for $r: $(cat "$W/${tag}_$r.json")"
    done
    $J --sse "$W/${tag}_stream.sse" || echo "the stream is not complete SSE of JSON events"
  } >"$W/$tag.out"
}

layouts() {   # TAG NP:FLAGS...: each layout on $CK = the one-process server on the same requests
  local tag=$1 l np flags
  shift
  start_server
  workload one
  # an expert model (E experts, top k): the one process's routing of the lone request below, the
  # slots per expert of each layer, (L, E) over its 8 steps: what the experts' traffic is
  # recomputed from
  local layer_slots=
  if [ "${E:-0}" -gt 0 ]; then
    for ((l = 0; l < L; l++)); do layer_slots+="$(routing $E $l $((l + 1)))"; done
  fi
  stop_server || fail "the one-process server's exit status after SIGTERM was not 0"
  ! grep -q "no answer\|not complete" "$W/one.out" || fail "the one-process server's answers are incomplete: $(head -3 "$W/one.out")"
  for l in "$@"; do
    np=${l%%:*}
    flags=${l#*:}
    SERVE_LAUNCH="dev/test/mpi.sh $np" start_server $flags
    grep -q "serve_gpt2: $np ranks" "$W/server.out" || fail "$flags: not $np ranks: $(head -3 "$W/server.out")"
    workload "pp$np"
    cmp -s "$W/one.out" "$W/pp$np.out" ||
      fail "$flags on $np ranks: answers differ from one process's: $(diff "$W/one.out" "$W/pp$np.out" | head -4)"
    in_flight=$(metric serve_pipeline_in_flight_max)
    [ "${in_flight:-0}" -ge 2 ] || fail "$flags: never more than ${in_flight:-0} iteration in flight"
    preempted=$(metric serve_preemptions_total)
    [[ $flags != *--kv-blocks* ]] || [ "${preempted:-0}" -gt 0 ] || fail "$flags: the small cache preempted nobody"
    S=2 K=1 Q=1 P=1 BS=16
    [[ $flags =~ --pp\ ([0-9]+) ]] && S=${BASH_REMATCH[1]}
    [[ $flags =~ --kvp\ ([0-9]+) ]] && P=${BASH_REMATCH[1]}
    [[ $flags =~ --tp\ ([0-9]+) ]] && K=${BASH_REMATCH[1]}
    [[ $flags =~ --ep\ ([0-9]+) ]] && Q=${BASH_REMATCH[1]}
    [[ $flags =~ --block-size\ ([0-9]+) ]] && BS=${BASH_REMATCH[1]}
    MAX_BLOCKS=$((MAXT / BS))

    # per generated token of a lone one-token request (N = M = 1 every step), what rank 0 sent
    # (pp: its C rows to stage 1; other: the step down, 2 + (2 + max_blocks) + 1 floats, and with
    # K > 1 the same ints broadcast over stage 0's tp group, with Q > 1 over rank 0's ep group,
    # with P > 1 over its KVP group; tp: stage 0's all-reduces of C floats, the embedding's over
    # the tp group and 2 per layer of its L/S over the G = P K ranks the output projection and
    # the MLP are cut over, 2(G-1)ceil(C/G)*4 bytes each; cp (--kvp): per layer the max and Z
    # all-reduces of NH/K floats and the output's reduce-scatter of P x C/G over the KVP group)
    # and what came back (Vp floats)
    # (with experts, per layer the MLP's tp all-reduce is over the rows rank 0's experts [0, E/Q)
    # got, a row per slot of the one-row steps that stays, and ep: its E/Q counts and its share's
    # output row to each other ep rank, a position and a row per slot going out: as
    # test_serve_parallel.sh, over stage 0's layers)
    names=("serve_collective_bytes_total{kind=\"pp\"}" "serve_collective_bytes_total{kind=\"other\"}"
           serve_pipeline_returned_bytes_total "serve_collective_bytes_total{kind=\"tp\"}"
           "serve_collective_bytes_total{kind=\"cp\"}" "serve_collective_bytes_total{kind=\"ep\"}")
    read -r pp other back tp cp ep <<<"$(lone_request "${names[@]}" | awk '{ for (i = 1; i <= NF; i++) printf "%s ", $i / 8 }')"
    step=$(( (2 + (2 + MAX_BLOCKS) + 1) * 4 ))
    # (with Q > 1 also each of stage 0's L/S expert layers' row count to the other ep ranks,
    # (Q-1)*4: every layer of the expert checkpoint is one, expert_parallel.h)
    want_other=$(( step * (1 + (K > 1) + (Q > 1) + (P > 1)) + (Q - 1) * 4 * L / S ))
    [ "$pp" = $((C * 4)) ] || fail "$flags: rank 0's pp bytes per token $pp, the formula says C*4 = $((C * 4))"
    [ "$other" = "$want_other" ] || fail "$flags: rank 0's other bytes per token $other, the formula says $want_other"
    [ "$back" = $((VP * 4)) ] || fail "$flags: bytes back per token $back, the formula says Vp*4 = $((VP * 4))"
    read -r want_tp want_cp want_ep <<<"$(awk -v P=$P -v K=$K -v Q=$Q -v C=$C -v NH=$NH -v Ls=$((L / S)) -v E=${E:-0} \
                                              -v s="$layer_slots" '
      function ar(G, n) { return 2 * (G - 1) * int((n + G - 1) / G) * 4 }
      BEGIN { G = P * K; split(s, slot); stay = out = 0
              for (i = 0; i < Ls * E; i++) { if (i % E < E / Q) stay += slot[i + 1]; else out += slot[i + 1] }
              X = P > 1 ? G / Q : K   # the ranks each expert is cut over
              mlp = E ? stay * 2 * (X - 1) * C / X * 4 / 8 : Ls * ar(G, C)
              print ar(K, C) + Ls * ar(G, C) + mlp,
                    Ls * (2 * ar(P, NH / K) + (P - 1) * C / G * 4),
                    E ? Ls * (Q - 1) * (E / Q + C) * 4 + out * (C + 1) * 4 / 8 : 0 }')"
    [ "$tp" = "$want_tp" ] || fail "$flags: rank 0's tp bytes per token $tp, the formula says $want_tp"
    [ "$cp" = "$want_cp" ] || fail "$flags: rank 0's KVP bytes per token $cp, the formula says $want_cp"
    [ "$ep" = "$want_ep" ] || fail "$flags: rank 0's ep bytes per token $ep, the formula says $want_ep (routing $layer_slots)"
    kvp_note=
    if [ "$P" -gt 1 ]; then   # each rank's cache: 1/P of the blocks, its stage's L/S layers, C/K channels
      blocks=$((8 * MAXT / BS))   # the default: 8 requests of maxT
      [[ $flags =~ --kv-blocks\ ([0-9]+) ]] && blocks=${BASH_REMATCH[1]}
      cache=$(( blocks / P * L / S * BS * 2 * C / K * 4 ))
      [ "$(metric serve_kv_cache_bytes_per_rank)" = "$cache" ] || fail "$flags: KV cache per rank $(metric serve_kv_cache_bytes_per_rank) bytes, not $cache"
      kvp_note=", kvp $cp B; KV cache per rank $cache B (1/$P of the blocks, $((L / S)) layers)"
    fi
    tokens=$(metric serve_generation_tokens_total)

    # SIGTERM to rank 0: it finishes, ends the stages, each prints its totals, and mpirun exits 0
    kill -TERM "$(awk '/rank pids/ { print $(NF - '$((np - 1))'); exit }' "$W/server.out")"
    wait "$SERVER_PID" || fail "$flags: exit status $? after SIGTERM to rank 0: $(tail -3 "$W/server.out")"
    SERVER_PID=
    grep -q '^serve_gpt2: stopped' "$W/server.out" || fail "$flags: rank 0 did not stop cleanly: $(tail -3 "$W/server.out")"
    # every other rank's totals: a stage before the last sent C*4 pp bytes per row, the last
    # stage's ep rank 0's tp rank 0 Vp*4 per head row (one per generated token), its other ranks
    # nothing (only ep rank 0 runs the head)
    for r in $(seq 1 $((np - 1))); do
      line=$(grep "^serve_gpt2: rank $r (pp stage" "$W/server.out") || fail "$flags: rank $r printed no totals"
      # (its other bytes are not checked: a follower prints no head-row count for the steps it forwards)
      read -r stage epr kvpr tpr rows heads ppb <<<"$(sed -E 's/.*pp stage ([0-9]+), ep rank ([0-9]+), kvp rank ([0-9]+), tp rank ([0-9]+)\): [0-9]+ iterations, ([0-9]+) rows, ([0-9]+) head rows; sent pp ([0-9]+) other [0-9]+.*/\1 \2 \3 \4 \5 \6 \7/' <<<"$line")"
      replica=$epr   # which copy of the tp group: only the first runs the head (its ep, or KVP, rank)
      [ "$P" -gt 1 ] && replica=$kvpr
      if [ "$stage" -lt $((S - 1)) ]; then
        [ "$ppb" = $((rows * C * 4)) ] || fail "$flags: rank $r (stage $stage) sent $ppb pp bytes for $rows rows, not rows*C*4"
      elif [ "$replica" != 0 ]; then
        [ "$heads" = 0 ] && [ "$ppb" = 0 ] || fail "$flags: rank $r (last stage, ep rank $epr, kvp rank $kvpr) ran $heads head rows, sent $ppb pp bytes, not 0"
      elif [ "$tpr" = 0 ]; then
        [ "$heads" = "$tokens" ] || fail "$flags: rank $r ran the head on $heads rows for $tokens generated tokens"
        [ "$ppb" = $((heads * VP * 4)) ] || fail "$flags: rank $r (last stage) sent $ppb pp bytes for $heads head rows, not M*Vp*4"
      else
        [ "$ppb" = 0 ] || fail "$flags: rank $r (last stage, tp rank $tpr) sent $ppb pp bytes, not 0"
      fi
    done
    pass "$flags on $np ranks ($tag) = one process (greedy, top-k, 8 concurrent mixed, stream; probabilities' bits), up to $in_flight iterations in flight, ${preempted:-0} preemptions; per token rank 0 sent pp $pp B, other $other B, tp $tp B, ep $ep B, got $back B back; every stage's totals = the formulas$kvp_note"
  done
}

# (--pp 4 alone, and --pp 2 --tp 2: covered by --pp 4 --tp 2, whose every stage's totals are
# checked the same way)
layouts dense "2:--pp 2 $SMALL" "4:--pp 2 --kvp 2 $SMALL" "8:--pp 4 --tp 2"
# experts: each stage's routed rows by all-to-all over its own ep groups, each expert cut over a
# tp group; only ep rank 0's tp group of the last stage runs the head (the other ep rank's
# totals: no head rows, no pp bytes)
CK=$W/moe/model_00000003.bin L=2 E=4
layouts moe "8:--pp 2 --ep 2 --tp 2"
CK=$W/dense/model_00000003.bin L=4 E=0

# --- 3. refused layouts ------------------------------------------------------------------
refuse "$CK" "^error: --pp 3: must divide the model's 4 layers" --pp 3
refuse "$W/moe/model_00000003.bin" "^error: --ep 3: must divide the model's 4 experts" --pp 2 --ep 3
refuse "$CK" "^error: --pp 2 x --tp 2 x --ep 1 needs 4 ranks (mpirun -np 4), got 1" --pp 2 --tp 2
pass "refused in one line: --pp 3 (4 layers), --pp 2 --ep 3 (4 experts), too few ranks"

# --- 4. a stage rank that dies -------------------------------------------------------------
SERVE_LAUNCH="dev/test/mpi.sh 2" start_server --pp 2 --step-delay-ms 50
stage1=$(awk '/rank pids/ { print $NF; exit }' "$W/server.out")
[ -n "$stage1" ] || fail "no rank pids printed: $(head -3 "$W/server.out")"
(post inflight "{\"prompt\":[$PROMPT],\"max_tokens\":58,\"temperature\":0,\"ignore_eos\":true}" >"$W/inflight.code") &
client=$!
curl -sN "$URL/v1/completions" -d "{\"prompt\":[$PROMPT],\"max_tokens\":58,\"ignore_eos\":true,\"stream\":true}" >"$W/dying.sse" &
streamer=$!
sleep 1
kill -9 "$stage1"
wait "$client" "$streamer"
t0=$SECONDS
wait "$SERVER_PID"
rc=$?
SERVER_PID=
[ "$rc" != 0 ] || fail "the server exited 0 after a stage died"
[ "$(cat "$W/inflight.code")" = 503 ] || fail "the request in flight got HTTP $(cat "$W/inflight.code"), not 503: $(cat "$W/inflight.json")"
$J "$W/inflight.json" error.message >/dev/null || fail "the 503 is not an OpenAI-style JSON error: $(cat "$W/inflight.json")"
grep -q '"error"' "$W/dying.sse" && grep -q 'data: \[DONE\]' "$W/dying.sse" ||
  fail "the stream in flight did not end with an error event: $(tail -3 "$W/dying.sse")"
[ "$(grep -c "^serve_gpt2: rank 1 (pid $stage1) died" "$W/server.out")" = 1 ] ||
  fail "not one line naming the dead stage: $(cat "$W/server.out")"
pass "a killed stage: 503 JSON error and an error event in flight, one line naming rank 1, the server gone $((SECONDS - t0))s later"
