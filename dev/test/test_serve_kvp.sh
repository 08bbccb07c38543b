#!/usr/bin/env bash
# serve_gpt2 with Helix's KV parallelism (llmc/serve_kvp.h) under real mpirun (dev/test/mpi.sh)
# and curl, on a dense d2 checkpoint with 4 heads, maxT 64:
#   1. --kvp 2 (2 ranks), --kvp 4 --block-size 8 (4 ranks), --kvp 2 --tp 2 (4 ranks): greedy,
#      seeded top-k, 6 concurrent mixed requests (prompts of 1 to 22 tokens: some shorter than a
#      block) with a 50-token prompt among them (longer than P blocks: every rank holds some of
#      it), a stream: tokens, text and the FNV-1a of every distribution drawn from = the
#      one-process server's, byte for byte;
#   2. the KVP, tp and other bytes per generated token of a lone one-token request against
#      kv_parallel.h's, serve_kvp.h's and serve_parallel.h's formulas, computed here from the
#      model's shape, and the startup line's KV cache per rank (1/P of the one-process server's
#      per tp slice), KVP bytes per token and weights per rank against the same formulas;
#   3. the capacity per rank: --kvp 2 runs with --kv-blocks 4, 2 blocks of 16 positions per rank
#      (one request of maxT: the workload queues and preempts), and two concurrent 60-position
#      requests there = the one-process answers;
#   4. a model of 4 experts (top 2): --kvp 2 (each expert's MLP cut over the pool), --kvp 2
#      --ep 2 and --kvp 2 --tp 2 --ep 2 (Helix's FFN as TP x EP on the same ranks): greedy and
#      top-k at once = one process's; the kvp, tp, ep and other bytes per token against the
#      formulas (the experts' from the one process's routing), the weights and the KV cache per
#      rank;
#   5. the refused layouts, one line each.
# Every layout is Helix's: attention's partials reduce-scattered by heads over the KVP group,
# the output projection and the MLP tensor-parallel over all P x K ranks (with --ep Q the
# experts dealt over Q of them, each cut over the other P K / Q).
set -u
cd "$(dirname "$0")/../.."
. dev/test/serve_lib.sh            # D, J, W, fail, pass; start_server, stop_server
. dev/test/serve_parallel_lib.sh   # train, post, metric, lone_request, routing, toks, PROMPT, workload
export MPI_TIMEOUT=120             # dev/test/mpi.sh: a hung layout fails instead of blocking
train d2c32h4t64 dense
CK=$W/dense/model_00000003.bin
L=2 C=32 NH=4 T=64 VP=50304        # the checkpoint's shape
LONG_PROMPT="50 12"                # workload: 50 prompt tokens, 12 drawn: positions 0 .. 61

# Per generated token of a lone request (lone_request), what rank 0 sent by kind: "TP OTHER CP
# EP" (cp: the KVP group's collectives)
bytes_per_token() {
  lone_request "serve_collective_bytes_total{kind=\"tp\"}" "serve_collective_bytes_total{kind=\"other\"}" \
    "serve_collective_bytes_total{kind=\"cp\"}" "serve_collective_bytes_total{kind=\"ep\"}" |
    awk '{ print $1 / 8, $2 / 8, $3 / 8, $4 / 8 }'
}
# The formulas for one row: an all-reduce of n floats over G ranks sends 2(G-1)ceil(n/G)*4 bytes,
# a reduce-scatter of G x n floats (G-1)*n*4.
#   kvp:   per layer the max and Z all-reduces of NH/K floats and the output's reduce-scatter of
#          P x C/(P K) floats, over P ranks
#   tp:    per layer 2 all-reduces of C floats over all P K ranks (the output projection's and
#          fcproj's g), the embedding's of C floats, the head's max (1) and sums (2) over K ranks
#   other: the step broadcast of 2 + (2 + maxT/bs) + 1 ints, the gather of (K-1) * Vp/K floats
# and the weights per rank (fp32): the heads' qkv and the vocabulary's wte cut K ways, the
# output projection's and the MLP's weights P K ways, the rest whole.
formulas() {   # P K BS: "KVP TP OTHER WEIGHTS"
  awk -v P=$1 -v K=$2 -v bs=$3 -v L=$L -v C=$C -v NH=$NH -v T=$T -v Vp=$VP '
    function ar(G, n) { return 2 * (G - 1) * int((n + G - 1) / G) * 4 }
    BEGIN { G = P * K
            layer = 2 * C + 3 * C * C / K + 3 * C / K + C * C / G + C + 2 * C + 4 * C * C / G + 4 * C / G + 4 * C * C / G + C
            print L * (2 * ar(P, NH / K) + (P - 1) * C / G * 4), 2 * L * ar(G, C) + ar(K, C) + ar(K, 1) + ar(K, 2),
                  (2 + (2 + T / bs) + 1) * 4 + (K - 1) * Vp / K * 4, (Vp * C / K + T * C + L * layer + 2 * C) * 4 }'
}

# Two concurrent requests of 40 prompt tokens and 20 drawn (60 positions: nearly a full
# context each); what they say into $W/TAG.out
capacity() {   # TAG
  local tag=$1 i ids clients=()
  for i in 0 1; do
    ids=$(IFS=,; echo "${toks[*]:$((120 + 110 * i)):40}")
    post "${tag}_$i" "{\"prompt\":[$ids],\"max_tokens\":20,\"temperature\":1,\"seed\":$((9 + i)),\"ignore_eos\":true}" >/dev/null &
    clients+=($!)
  done
  wait "${clients[@]}"
  for i in 0 1; do
    $J "$W/${tag}_$i.json" choices.0.token_ids choices.0.probs_fnv1a || echo "no answer for $i: $(cat "$W/${tag}_$i.json")"
  done >"$W/$tag.out"
}

stop_ranks() {   # NP WHAT: SIGTERM to rank 0 (the HTTP server); it ends the followers, mpirun exits 0
  kill -TERM "$(awk '/rank pids/ { print $(NF - '$(($1 - 1))'); exit }' "$W/server.out")"
  wait "$SERVER_PID" || fail "$2: exit status $? after SIGTERM to rank 0: $(tail -3 "$W/server.out")"
  SERVER_PID=
  grep -q '^serve_gpt2: stopped' "$W/server.out" || fail "$2: rank 0 did not stop cleanly: $(tail -3 "$W/server.out")"
}

# --- the one-process server: the answers every layout must give ----------------------------
start_server
workload one
capacity one_cap
grep -q "no answer" "$W/one.out" "$W/one_cap.out" && fail "one process: requests unanswered: $(grep -h "no answer" "$W/one.out" "$W/one_cap.out" | head -2)"
cache_one=$(metric serve_kv_cache_bytes_per_rank)
[ "$cache_one" = $((8 * T / 16 * L * 16 * 2 * C * 4)) ] || fail "one process: KV cache of $cache_one bytes, not 8 requests of maxT"
stop_server || fail "the one-process server's exit status after SIGTERM was not 0"
pass "the one-process server's answers (KV cache $cache_one bytes)"

# --- 1-3. each layout = the one process; its bytes and cache against the formulas -----------
# (--kvp 4's cache by --kv-memory, a budget per rank: 16.5 blocks of 2 x L x 8 x C x 4 = 4096
# bytes hold 16, x 4 ranks = the default 64 blocks of 8 that the checks below expect)
for l in "2:--kvp 2 --kv-blocks 4" "4:--kvp 4 --block-size 8 --kv-memory 67584" "4:--kvp 2 --tp 2"; do
  np=${l%%:*} flags=${l#*:} K=1 bs=16 kv_blocks=
  P=$(sed 's/.*--kvp \([0-9]*\).*/\1/' <<<"$flags")
  [[ $flags =~ --tp\ ([0-9]+) ]] && K=${BASH_REMATCH[1]}
  [[ $flags =~ --block-size\ ([0-9]+) ]] && bs=${BASH_REMATCH[1]}
  [[ $flags =~ --kv-blocks\ ([0-9]+) ]] && kv_blocks=${BASH_REMATCH[1]}
  : "${kv_blocks:=$((8 * T / bs))}"   # the default: 8 requests of maxT
  SERVE_LAUNCH="dev/test/mpi.sh $np" start_server $flags
  grep -q "serve_gpt2: $np ranks (tp $K x ep 1 x kvp $P x pp 1)" "$W/server.out" || fail "$flags: not $np ranks: $(head -3 "$W/server.out")"
  tag=kvp${P}_tp$K
  workload "$tag"
  cmp -s "$W/one.out" "$W/$tag.out" ||
    fail "$flags on $np ranks: answers differ from one process's: $(diff "$W/one.out" "$W/$tag.out" | head -4)"
  read -r want_cp want_tp want_other want_weights <<<"$(formulas "$P" "$K" "$bs")"
  read -r tp other cp ep <<<"$(bytes_per_token)"
  [ "$cp" = "$want_cp" ] || fail "$flags: KVP bytes per token $cp, the formula says $want_cp"
  [ "$tp" = "$want_tp" ] || fail "$flags: tp bytes per token $tp, the formula says $want_tp"
  [ "$other" = "$want_other" ] || fail "$flags: other bytes per token $other, the formula says $want_other"
  # the cache: --kv-blocks over P ranks, each of C/K channels: 1/(P K) of one process's of as
  # many blocks
  blocks=$((kv_blocks / P)) bytes=$((kv_blocks / P * L * bs * 2 * C / K * 4))
  [ $((bytes * P * K)) = $((cache_one * kv_blocks * bs / (8 * T))) ] || fail "$flags: the test's own arithmetic"
  grep -q "^serve_gpt2: kvp $P: KV cache per rank $blocks blocks of $((NH / K)) heads, $bytes bytes; KVP collectives $want_cp bytes per generated token" "$W/server.out" ||
    fail "$flags: the startup line does not say $blocks blocks, $bytes bytes per rank, $want_cp B per token: $(grep kvp "$W/server.out")"
  grep -q "^serve_gpt2: kvp $P: .*; weights per rank $want_weights bytes (the output projection and the MLP over all $np ranks)" "$W/server.out" ||
    fail "$flags: the startup line does not say $want_weights bytes of weights per rank: $(grep kvp "$W/server.out")"
  [ "$(metric serve_kv_cache_bytes_per_rank)" = "$bytes" ] || fail "$flags: /metrics' KV cache per rank is not $bytes bytes"
  [ "$(metric serve_kv_blocks_free)" = $((blocks * P)) ] || fail "$flags: not every block free after the answers"
  [ "$(metric 'serve_ranks{dim="kvp"}')" = "$P" ] || fail "$flags: /metrics' kvp ranks are not $P"
  capacity_note=
  if [ "$kv_blocks" = 4 ]; then   # 2 blocks per rank: two near-full requests at once queue or preempt
    capacity "${tag}_cap"
    cmp -s "$W/one_cap.out" "$W/${tag}_cap.out" ||
      fail "$flags: two 60-position requests differ from one process's: $(diff "$W/one_cap.out" "$W/${tag}_cap.out" | head -4)"
    [ "$(metric serve_kv_blocks_free)" = 4 ] || fail "$flags: not every block free after the answers"
    capacity_note="; $blocks blocks of $bs per rank (one request of maxT): two 60-position requests = one process's ($(metric serve_preemptions_total) preemptions)"
  fi
  stop_ranks "$np" "$flags"
  pass "$flags on $np ranks = one process (greedy, top-k, 7 concurrent mixed, stream; probabilities' bits); per token kvp $cp B, tp $tp B, other $other B = the formulas; KV cache per rank $bytes B = 1/$((P * K)) of one process's$capacity_note"
done

# --- 4. an expert model (4 experts, top 2, 4 heads): Helix's FFN as TP x EP on the pool ------
# --kvp 2 (each expert's MLP cut over the pool), --kvp 2 --ep 2 (the experts dealt over the
# 2 ranks, each whole), --kvp 2 --tp 2 --ep 2 (4 ranks: the experts over the KVP groups, each
# cut over a tp group): greedy and seeded top-k at once = one process's; per token of a lone
# request, each kind of rank 0's bytes against the formulas below, recomputed from the shape
# and the routing the one process reports for the same request; the weights and the KV cache
# per rank.
train d2c32h4t64e4k2 moe
CK=$W/moe/model_00000003.bin E=4 k=2
expert_answers() {   # TAG: both at once (each ep rank's share of a decode step one row)
  post "$1_greedy" "{\"prompt\":[$PROMPT],\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true}" >/dev/null &
  local greedy=$!
  post "$1_topk" "{\"prompt\":\"First Citizen:\",\"max_tokens\":24,\"temperature\":1,\"top_k\":40,\"seed\":1337,\"ignore_eos\":true}" >/dev/null
  wait "$greedy"
  for r in greedy topk; do $J "$W/$1_$r.json" choices.0.token_ids choices.0.probs_fnv1a || echo "no answer for $r"; done >"$W/$1.out"
}
start_server
expert_answers moe_one
read -r -a slots <<<"$(routing $E 0 $L)"   # the lone request's slots per expert (8 steps x L x k)
stop_server || fail "the one-process expert server's exit status after SIGTERM was not 0"
grep -q "no answer" "$W/moe_one.out" && fail "the one-process expert server: requests unanswered"
[ $((slots[0] + slots[1] + slots[2] + slots[3])) = $((8 * L * k)) ] || fail "the one process routed ${slots[*]} slots per expert"
# The formulas for a lone request's 8 tokens on rank 0 (pool slice 0: ep rank 0, holding experts
# [0, E/Q) cut into G/Q slices, its ep group's other ranks' shares of each one-row step empty),
# per token: cp as for the dense model; tp the embedding's and the head's over K, per layer the
# output projection's all-reduce of C over G = P K and the experts' of the rows rank 0's
# experts got (the slots that stay, a row each) over G/Q; ep per layer the E/Q counts and the
# output row of C to each other ep rank, a position and a row per slot going out; other the
# step, the vocabulary gather, (Q-1) ints per layer; the weights: qkv and wte cut K ways, the
# output projection G ways, E/Q experts each cut G/Q ways.
expert_formulas() {   # P K Q: "CP TP EP OTHER WEIGHTS"
  awk -v P=$1 -v K=$2 -v Q=$3 -v L=$L -v C=$C -v NH=$NH -v T=$T -v Vp=$VP -v E=$E -v s="${slots[*]}" '
    function ar(G, n) { return 2 * (G - 1) * int((n + G - 1) / G) * 4 }
    BEGIN { G = P * K; X = G / Q; El = E / Q; split(s, slot); stay = out = 0
            for (e = 0; e < E; e++) { if (e < El) stay += slot[e + 1]; else out += slot[e + 1] }
            layer = 2 * C + 3 * C * C / K + 3 * C / K + C * C / G + C + 2 * C + E * C + El * (8 * C * C / X + 4 * C / X + C)
            print L * (2 * ar(P, NH / K) + (P - 1) * C / G * 4),
                  ar(K, C) + ar(K, 1) + ar(K, 2) + L * ar(G, C) + stay * 2 * (X - 1) * C / X * 4 / 8,
                  L * (Q - 1) * (El + C) * 4 + out * (C + 1) * 4 / 8,
                  (2 + (2 + T / 16) + 1) * 4 + (K - 1) * Vp / K * 4 + L * (Q - 1) * 4,
                  (Vp * C / K + T * C + L * layer + 2 * C) * 4 }'
}
for l in "2:--kvp 2" "2:--kvp 2 --ep 2" "4:--kvp 2 --tp 2 --ep 2"; do
  np=${l%%:*} flags=${l#*:} K=1 Q=1 P=2
  [[ $flags =~ --tp\ ([0-9]+) ]] && K=${BASH_REMATCH[1]}
  [[ $flags =~ --ep\ ([0-9]+) ]] && Q=${BASH_REMATCH[1]}
  SERVE_LAUNCH="dev/test/mpi.sh $np" start_server $flags
  grep -q "serve_gpt2: $np ranks (tp $K x ep $Q x kvp $P x pp 1)" "$W/server.out" || fail "$flags: not $np ranks: $(head -3 "$W/server.out")"
  tag=moe_kvp${P}_tp${K}_ep$Q
  expert_answers "$tag"
  cmp -s "$W/moe_one.out" "$W/$tag.out" ||
    fail "$flags on the expert model: answers differ from one process's: $(diff "$W/moe_one.out" "$W/$tag.out" | head -4)"
  read -r tp other cp ep <<<"$(bytes_per_token)"
  read -r want_cp want_tp want_ep want_other want_weights <<<"$(expert_formulas $P $K $Q)"
  for kind in cp tp ep other; do
    want=want_$kind
    [ "${!kind}" = "${!want}" ] || fail "$flags on the expert model: $kind bytes per token ${!kind}, the formula says ${!want} (routing ${slots[*]})"
  done
  grep -q "^serve_gpt2: kvp $P: .*; weights per rank $want_weights bytes" "$W/server.out" ||
    fail "$flags on the expert model: the startup line does not say $want_weights bytes of weights per rank: $(grep kvp "$W/server.out")"
  cache=$((8 * T / 16 / P * L * 16 * 2 * C / K * 4))   # the default 8 requests of maxT, 1/P of the blocks, C/K channels
  [ "$(metric serve_kv_cache_bytes_per_rank)" = "$cache" ] || fail "$flags on the expert model: KV cache per rank is not $cache bytes"
  stop_ranks "$np" "$flags on the expert model"
  pass "$flags on a 4-expert top-2 model ($np ranks) = one process (greedy and top-k at once; probabilities' bits); per token kvp $cp B, tp $tp B, ep $ep B, other $other B = the formulas (routing ${slots[*]}); weights per rank $want_weights B, KV cache per rank $cache B"
done
refuse "$CK" "^error: --ep 4 with --kvp 2 x --tp 1: the experts are dealt over ep ranks of the pool of 2, expected a divisor of 2" --kvp 2 --ep 4
CK=$W/dense/model_00000003.bin

# --- 5. refused layouts -------------------------------------------------------------------
refuse "$CK" "^error: --kvp 3: expected 1, 2, 4 or 8" --kvp 3
refuse "$CK" "^error: --kvp 4 with --block-size 16: expected 2 x kvp x block size (128) to divide the context length 64" --kvp 4
refuse "$CK" "^error: --kv-blocks 5 with --kvp 2: expected a multiple of 2" --kvp 2 --kv-blocks 5
refuse "$CK" "^error: --kvp 2 x --tp 1 needs 2 ranks (mpirun -np 2), got 1" --kvp 2
refuse "$CK" "^error: --kvp 4: expected a divisor of the 2 heads per tensor-parallel rank" --kvp 4 --tp 2 --block-size 8
train d1c32h16t64 heads16   # 16 heads: KVP 8 x TP 2 can scatter them, but not cut the MLP over 16 ranks
refuse "$W/heads16/model_00000003.bin" "^error: --kvp 8 x --tp 2: the output projection and the MLP are cut over all 16 ranks, expected kvp x tp to divide 8" --kvp 8 --tp 2 --block-size 4
pass "refused in one line: --kvp 3, --kvp 4 with blocks of 16 at maxT 64, --ep not dividing the pool (above), --kv-blocks not a multiple, too few ranks, --kvp 4 x --tp 2 on 4 heads (not 4 heads per tp rank to scatter), --kvp 8 x --tp 2 (16 ranks do not divide the 8 chunks)"
