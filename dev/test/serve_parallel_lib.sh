# The across-ranks servers' tests' shared part (test_serve_parallel.sh, test_serve_kvp.sh,
# test_serve_pp.sh), sourced after serve_lib.sh: a checkpoint to serve (train), a POST and a
# metric (post, metric), a lone request's growth of metrics and its routing (lone_request,
# routing), the workload each layout's answers are compared on (workload; the
# pipeline's test has its own), and a layout refused at startup (refuse).
train() {   # MODEL DIR: a 3-step checkpoint of MODEL (what is served matters, not how well)
  ./train_gpt2 -e "$1" -i $D/tiny_shakespeare_train.bin -b 4 -t 64 -x 3 -v 0 -s 0 -l 3e-3 -n 3 -o "$W/$2" \
    >"$W/train_$2.out" 2>&1 || fail "could not train $1: $(tail -3 "$W/train_$2.out")"
}

post() {   # NAME BODY: the answer in $W/NAME.json; prints the HTTP status
  curl -s -o "$W/$1.json" -w '%{http_code}' -H 'Content-Type: application/json' "$URL/v1/completions" --data-binary "$2"
}
metric() { curl -s "$URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }
# A lone greedy request with a one-token prompt (every step one row: N = M = 1), 8 tokens: what
# the metrics NAMES... grew by, in order
lone_request() {
  local before after m
  before=$(for m in "$@"; do metric "$m"; done | tr '\n' ' ')
  post lone "{\"prompt\":[198],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}" >/dev/null
  after=$(for m in "$@"; do metric "$m"; done | tr '\n' ' ')
  awk -v b="$before" -v a="$after" 'BEGIN { n = split(b, x); split(a, y); for (i = 1; i <= n; i++) printf "%d ", y[i] - x[i] }'
}
# ... and the slots it routed to each of an expert model's E experts over its steps and layers
# [L0, L1) (the one process's routing: what the experts' traffic is recomputed from)
routing() {   # E L0 L1
  local e l names=()
  for ((l = $2; l < $3; l++)); do
    for ((e = 0; e < $1; e++)); do names+=("serve_expert_slots_total{layer=\"$l\",expert=\"$e\"}"); done
  done
  lone_request "${names[@]}" | awk -v E=$1 '{ for (i = 1; i <= NF; i++) slots[(i - 1) % E] += $i
                                              for (e = 0; e < E; e++) printf "%d ", slots[e] }'
}
read -r -a toks <"$D/tinyshakespeare_first1000.tokens.txt"
PROMPT=5962,22307,25,198

# The workload on the server at $URL; what its answers say into $W/TAG.out (no ids or times)
workload() {   # TAG
  local tag=$1 i
  post "${tag}_greedy" "{\"prompt\":[$PROMPT],\"max_tokens\":40,\"temperature\":0,\"ignore_eos\":true}" >/dev/null
  post "${tag}_topk" "{\"prompt\":\"First Citizen:\",\"max_tokens\":40,\"temperature\":1,\"top_k\":40,\"seed\":1337,\"ignore_eos\":true}" >/dev/null
  local clients=() temps=(0 1 0.7 1.3)
  for i in 0 1 2 3 4 5; do
    local n=$((1 + (i * 7) % 23)) off=$((i * 13)) ids
    ids=$(IFS=,; echo "${toks[*]:$off:$n}")
    (sleep "0.$((i * 3 % 5))"; post "${tag}_mixed_$i" "{\"prompt\":[$ids],\"max_tokens\":$((3 + (i * 11) % 25)),\"temperature\":${temps[$((i % 4))]},\"top_k\":$(((i % 3) * 5)),\"top_p\":0.9,\"seed\":$((100 + i)),\"ignore_eos\":true}" >"$W/${tag}_mixed_$i.code") &
    clients+=($!)
  done
  if [ -n "${LONG_PROMPT:-}" ]; then   # words: a prompt of N tokens, max_tokens M, joining the mixed ones
    local lp=(${LONG_PROMPT})
    ids=$(IFS=,; echo "${toks[*]:200:${lp[0]}}")
    (post "${tag}_long" "{\"prompt\":[$ids],\"max_tokens\":${lp[1]},\"temperature\":0.9,\"seed\":77,\"ignore_eos\":true}" >"$W/${tag}_long.code") &
    clients+=($!)
  fi
  curl -sN "$URL/v1/completions" -d "{\"prompt\":[$PROMPT],\"max_tokens\":30,\"temperature\":0.8,\"seed\":5,\"ignore_eos\":true,\"stream\":true}" >"$W/${tag}_stream.sse"
  wait "${clients[@]}"
  {
    for r in greedy topk mixed_0 mixed_1 mixed_2 mixed_3 mixed_4 mixed_5 ${LONG_PROMPT:+long}; do
      $J "$W/${tag}_$r.json" choices.0.token_ids choices.0.text choices.0.probs_fnv1a choices.0.finish_reason ||
        echo "no answer for $r: $(cat "$W/${tag}_$r.json")"
    done
    $J --sse "$W/${tag}_stream.sse" || echo "the stream is not complete SSE of JSON events"
  } >"$W/$tag.out"
}

refuse() {   # CK EXPECTED FLAGS...: the one process refuses the layout FLAGS in one line saying EXPECTED
  local ck=$1 want=$2
  shift 2
  ./serve_gpt2 -e "$ck" --port 0 --encoder $D/encoder.json --bpe $D/vocab.bpe "$@" >"$W/refused.out" 2>&1 &&
    fail "$*: accepted"
  [ "$(wc -l <"$W/refused.out")" = 1 ] && grep -q -- "$want" "$W/refused.out" ||
    fail "$*: expected one line saying '$want', got: $(cat "$W/refused.out")"
}
