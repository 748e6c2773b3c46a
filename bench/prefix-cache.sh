#!/usr/bin/env bash
# The prefix cache, measured through the OpenAI API: a system prompt of about 2k tokens and
# three different questions after it, greedy, one at a time; the time to first token of
# each, with the cache on and off (`shoal serve --no-prefix-cache`), and whether the answers
# are the same. On one rank (`shoal serve --model MODEL`) and on a tensor-parallel instance
# over two loopback nodes (`shoal load MODEL --strategy tensor`). On one rank, 16 concurrent
# streams of 64 tokens that share the system prompt, at a fresh server and again after the
# questions: their aggregate tokens/s (prompts included) with the cache on and off. Exits
# non-zero when an answer differs between cache on and off.
#
#   bench/prefix-cache.sh [-n TOKENS] [MODEL]      (default MODEL: qwen05)
#
# Not in CI (a few minutes). Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
n=32
while getopts "n:" o; do
  case $o in n) n=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
model=${1:-qwen05}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
"$shoal" models fetch "$model" >/dev/null 2>&1 || true
work=$(mktemp -d)
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine)"

cat >"$work/client.py" <<'PY'
"""questions URL MODEL N OUT | streams URL MODEL N K: time to first token and answers."""
import json, sys, threading, time, urllib.request

SYSTEM = " ".join(
    f"Rule {i}: when a user asks about topic {i}, answer politely, cite section {i} of the "
    f"handbook, and keep the answer under {i % 7 + 2} sentences." for i in range(56))
QUESTIONS = ["What is the capital of France?", "Name three prime numbers.",
             "How many legs does a spider have?"]

def ask(url, model, question, n, ignore_eos=False):
    body = {"model": model, "temperature": 0, "max_tokens": n, "stream": True,
            "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0, first, text, usage = time.time(), None, "", {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            v = json.loads(line[6:])
            if v.get("choices") and v["choices"][0]["delta"].get("content"):
                first = first or time.time() - t0
                text += v["choices"][0]["delta"]["content"]
            if v.get("usage"):
                usage = v["usage"]
    return first or time.time() - t0, text, usage

mode, url, model, n = sys.argv[1:5]
if mode == "questions":
    out = []
    for q in QUESTIONS:
        ttft, text, u = ask(url, model, q, int(n))
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append({"ttft": ttft, "text": text, "prompt": u.get("prompt_tokens"), "cached": cached})
    json.dump(out, open(sys.argv[5], "w"))
    first = out[0]["ttft"]
    print("  ".join(f"ttft {o['ttft'] * 1e3:.0f} ms ({100 * o['ttft'] / first:.0f}% of the 1st; "
                    f"{o['cached']} of {o['prompt']} prompt tokens cached)" for o in out))
else:
    k = int(sys.argv[5])
    done = []
    def one(i):
        _, _, u = ask(url, model, f"Question {i}: what is {i} times {i + 3}?", int(n), True)
        done.append(u.get("completion_tokens", 0))
    t0 = time.time()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    print(f"{k} streams: {sum(done)} tokens in {wall:.1f} s = {sum(done) / wall:.1f} tok/s")
PY

serve_one() { # name, extra serve flags
  local name=$1; shift
  "$shoal" serve --model "$model" --api 127.0.0.1:0 --data-dir "$work/$name" "$@" \
    >"$work/$name.ready" 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 300); do [ -s "$work/$name.ready" ] && return 0; sleep 0.2; done
  echo "shoal serve did not start: $(cat "$work/$name.log")" >&2; exit 1
}
start_node() { # name, extra serve flags
  local name=$1; shift
  "$shoal" serve --secret-file "$work/secret" --name "$name" --no-mdns \
    --listen 127.0.0.1:0 --api 127.0.0.1:0 --data-dir "$work/$name" --threads 1 \
    ${SEED:+--peer "$SEED"} "$@" >"$work/$name.ready" 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/$name.ready" ] && return 0; sleep 0.2; done
  echo "node $name did not start: $(cat "$work/$name.log")" >&2; exit 1
}
tp2() { # tag, extra serve flags: a tp2 instance of MODEL on two nodes; sets tp_url, tp_id
  local tag=$1; shift
  SEED='' start_node "a$tag" "$@"
  SEED=$(field "$work/a$tag.ready" listen) SHOAL_HOME="$work/empty-home" start_node "b$tag" "$@"
  local url="http://$(field "$work/a$tag.ready" api)"
  for _ in $(seq 1 100); do
    k=$("$shoal" links --json --url "$url" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
    [ "$k" -ge 2 ] && break
    sleep 0.2
  done
  "$shoal" load "$model" --strategy tensor --json --url "$url" >"$work/placed$tag" \
    || { tail -n 20 "$work/a$tag.log" "$work/b$tag.log" >&2; exit 1; }
  tp_url="http://$(field "$work/placed$tag" api)"
  tp_id=$(field "$work/placed$tag" id)
}
same() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
bad = [i for i, (x, y) in enumerate(zip(a, b)) if x["text"] != y["text"]]
if bad:
    sys.exit(f"answers {bad} differ between cache on and off")
print(f"the {len(a)} answers are the same with the cache on and off")
PY
}

"$shoal" secret >"$work/secret" 2>/dev/null
chmod 600 "$work/secret"
mkdir -p "$work/empty-home"

echo "== one rank, -t 2"
for mode in on off; do
  flags=(-t 2)
  [ $mode = off ] && flags+=(--no-prefix-cache)
  serve_one "one-$mode" "${flags[@]}"
  url="http://$(field "$work/one-$mode.ready" api)"
  printf "cache %-3s " $mode
  python3 "$work/client.py" questions "$url" "$model" "$n" "$work/one-$mode.json"
  printf "cache %-3s after the questions, " $mode
  python3 "$work/client.py" streams "$url" "$model" 64 16
  curl -s "$url/metrics" | grep -E '^shoal_(prefix_cache|prompt_tokens_cached|sequences_started)' | sed 's/^/          /'
  stop_all
  serve_one "cold-$mode" "${flags[@]}"
  printf "cache %-3s at a fresh server, " $mode
  python3 "$work/client.py" streams "http://$(field "$work/cold-$mode.ready" api)" "$model" 64 16
  stop_all
done
same "$work/one-on.json" "$work/one-off.json"

echo "== tp2 over two loopback nodes, -t 1 each"
for mode in on off; do
  flags=()
  [ $mode = off ] && flags+=(--no-prefix-cache)
  tp2 "$mode" "${flags[@]}"
  printf "cache %-3s " $mode
  python3 "$work/client.py" questions "$tp_url" "$tp_id" "$n" "$work/tp2-$mode.json"
  stop_all
done
same "$work/tp2-on.json" "$work/tp2-off.json"
