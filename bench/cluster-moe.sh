#!/usr/bin/env bash
# A mixture of experts too big for either of two loopback nodes, placed by expert across
# both: each `shoal serve` offers MAX memory (less than the model), only node a holds the
# file; `shoal load PATH --strategy tensor --expert-split whole` on node a gives each node
# whole experts (with sliced experts every rank reads a slice of every expert, which touches
# every chunk of the file), node b fetches only the chunks its rank reads, and the cluster's
# greedy answer is compared with one process's (a lone `shoal serve` without a memory limit,
# asked first). The synthetic files' text is mostly filler tokens that print as nothing, so
# the answers are compared by token id (the OpenAI API's logprobs carry each token's id).
# One rank and two sum their partial products in different orders, so on a random model's
# flat logits they may part at a near-tie (one process's own top two within 0.05 nats, as
# the golden test excuses them): the comparison stops there and says so. Prints what b fetched, its sparse
# copy's size on disk against the file's, and both answers' agreement; exits non-zero when
# they differ.
#
#   bench/cluster-moe.sh [-m MAX] [-n TOKENS] [MODEL.gguf]
#   (default MODEL: the synthetic deepseek-v2-lite of bench/synth.sh; MAX 7G)
#
# Needs the whole model in memory for the one-process answer, then half of it on each node.
# Not in CI (it moves gigabytes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
max=7G n=16
while getopts "m:n:" o; do
  case $o in m) max=$OPTARG ;; n) n=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
model=${1:-${SHOAL_HOME:-$HOME/.cache/shoal}/models/synth/deepseek-v2-lite.gguf}
[ -f "$model" ] || { echo "$model: not found; write it with bench/synth.sh deepseek-v2-lite" >&2; exit 2; }
prompt="the cat sat on the mat"
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
ask() { # api-url model-id out-file: the greedy answer's tokens and log probabilities
  python3 - "$@" "$n" "$prompt" <<'PY'
import json, sys, urllib.request
url, model, out, n, prompt = sys.argv[1:]
body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": int(n), "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=600))
steps = [{"id": t["id"], "logprob": t["logprob"],
          "top": [(a["id"], a["logprob"]) for a in t["top_logprobs"]]}
         for t in r["choices"][0]["logprobs"]["content"]]
json.dump(steps, open(out, "w"))
print(f"{len(steps)} tokens: {' '.join(str(s['id']) for s in steps)}")
PY
}

"$shoal" secret >"$work/secret" 2>/dev/null
chmod 600 "$work/secret"
mkdir -p "$work/empty-home"
start() { # name max-memory-flags...
  local name=$1; shift
  "$shoal" serve --secret-file "$work/secret" --name "$name" --no-mdns \
    --listen 127.0.0.1:0 --api 127.0.0.1:0 --data-dir "$work/$name" \
    --threads 1 ${SEED:+--peer "$SEED"} "$@" \
    >"$work/$name.ready" 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/$name.ready" ] && return 0; sleep 0.2; done
  echo "node $name did not start; its log:" >&2; cat "$work/$name.log" >&2; exit 1
}

echo "== one process: a lone shoal serve, shoal load $(basename "$model")"
SEED='' start one
url_one="http://$(field "$work/one.ready" api)"
"$shoal" load "$model" --ctx 512 --json --url "$url_one" >"$work/one.placed" \
  || { tail -n 20 "$work"/one.log >&2; exit 1; }
ask "http://$(field "$work/one.placed" api)" "$(field "$work/one.placed" id)" "$work/want.json"
kill "${pids[0]}"
wait "${pids[0]}" 2>/dev/null || true
pids=()

SEED='' start a --max-memory "$max"
SEED=$(field "$work/a.ready" listen)
SEED=$SEED SHOAL_HOME="$work/empty-home" start b --max-memory "$max"
url_a="http://$(field "$work/a.ready" api)"
for _ in $(seq 1 100); do
  k=$("$shoal" links --json --url "$url_a" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
  [ "$k" -ge 2 ] && break
  sleep 0.2
done
"$shoal" nodes --url "$url_a"

echo "== shoal load $(basename "$model") --strategy tensor --expert-split whole (at a; b has no copy)"
t0=$(date +%s)
"$shoal" load "$model" --strategy tensor --expert-split whole --ctx 512 --json --url "$url_a" \
  >"$work/placed" || { tail -n 20 "$work"/a.log "$work"/b.log >&2; exit 1; }
echo "placed in $(($(date +%s) - t0)) s: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["placement"], "| experts:", d["experts"])' "$work/placed")"
chunks=$(find "$work/b" -name '*.chunks' | head -n1)
[ -n "$chunks" ] || { echo "node b fetched nothing" >&2; exit 1; }
python3 - "$chunks" "${chunks%.chunks}.gguf" "$model" <<'PY'
import json, os, sys
chunks, sparse, model = sys.argv[1:]
fetched = len(json.load(open(chunks)))
size = os.path.getsize(model)
total = -(-size // (4 << 20))
held = os.stat(sparse).st_blocks * 512
print(f"node b fetched {fetched} of {total} chunks of 4 MiB; its sparse copy holds "
      f"{held / 1e9:.2f} GB on disk of the file's {size / 1e9:.2f} GB ({100 * held / size:.0f}%)")
PY
lead="http://$(field "$work/placed" api)"
echo "== the cluster, asked at its lead $lead"
ask "$lead" "$(field "$work/placed" id)" "$work/got.json"
python3 - "$work/want.json" "$work/got.json" <<'PY'
import json, sys
want, got = (json.load(open(p)) for p in sys.argv[1:])
if len(want) != len(got):
    sys.exit(f"{len(got)} tokens where one process gave {len(want)}")
NEAR_TIE = 0.05  # nats between one process's own top two
worst, parted = 0.0, None
for i, (w, g) in enumerate(zip(want, got)):
    if w["id"] != g["id"]:
        gap = w["top"][0][1] - w["top"][1][1] if len(w["top"]) > 1 else float("inf")
        if gap >= NEAR_TIE:
            sys.exit(f"step {i}: token {g['id']} where one process chose {w['id']}, "
                     f"whose top two are {gap:.4f} apart: not a near-tie")
        parted = (i, gap)
        break
    worst = max(worst, abs(w["logprob"] - g["logprob"]))
same = parted[0] if parted else len(want)
print(f"same tokens as one process for {same} of {len(want)} steps; the chosen tokens' log "
      f"probabilities differ by at most {worst:.1e} there")
if parted:
    print(f"parted at step {parted[0]}, a near-tie: one process's top two are {parted[1]:.4f} "
          f"apart (under {NEAR_TIE}); later steps continue different texts and are not compared")
PY
