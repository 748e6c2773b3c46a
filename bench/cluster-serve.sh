#!/usr/bin/env bash
# Serving throughput of a model split over a local cluster, beside the same model on one
# node: starts NODES `shoal serve` processes on loopback (the first holds the model; each
# offers MAX_MEMORY), loads MODEL with STRATEGY, and runs `shoal bench serve` against the
# instance's lead at each of STREAMS concurrent streams; then serves MODEL on one node alone
# and runs the same. Threads per node: THREADS.
# Usage: bench/cluster-serve.sh [MODEL]   (env: NODES=2 STRATEGY=auto MAX_MEMORY=800M
#        CTX=512 STREAMS=1,4,8 N=64 R=2 THREADS=1 SHOAL=target/release/shoal)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-qwen05}
NODES=${NODES:-2}; STRATEGY=${STRATEGY:-auto}; MAX_MEMORY=${MAX_MEMORY:-800M}; CTX=${CTX:-512}
STREAMS=${STREAMS:-1,4,8}; N=${N:-64}; R=${R:-2}; THREADS=${THREADS:-1}
SHOAL=${SHOAL:-target/release/shoal}
[ -x "$SHOAL" ] || cargo build --release
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
"$SHOAL" secret > "$work/secret" 2>/dev/null; chmod 600 "$work/secret"
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
wait_ready() { for _ in $(seq 1 150); do [ -s "$1" ] && return 0; sleep 0.2; done; echo "not ready: $1" >&2; exit 1; }
seed=''
for i in $(seq 1 "$NODES"); do
  home=$work/home$i; mkdir -p "$home"
  if [ "$i" = 1 ]; then envs=(); else envs=(SHOAL_HOME="$home"); fi
  env "${envs[@]}" "$SHOAL" serve --secret-file "$work/secret" --name "n$i" --listen 127.0.0.1:0 \
    --api 127.0.0.1:0 --data-dir "$work/d$i" --max-memory "$MAX_MEMORY" --threads "$THREADS" \
    --no-mdns --parallel 16 ${seed:+--peer "$seed"} > "$work/n$i.ready" 2> "$work/n$i.log" &
  pids+=($!)
  wait_ready "$work/n$i.ready"
  [ -n "$seed" ] || seed=$(field "$work/n1.ready" listen)
done
url="http://$(field "$work/n1.ready" api)"
for _ in $(seq 1 100); do
  n=$("$SHOAL" nodes --json --url "$url" | python3 -c "import json,sys; print(sum(1 for n in json.load(sys.stdin) if n['alive']))")
  [ "$n" = "$NODES" ] && break; sleep 0.2
done
"$SHOAL" load "$MODEL" --strategy "$STRATEGY" --ctx "$CTX" --url "$url" >&2
lead=$("$SHOAL" ps --json --url "$url" | python3 -c "import json,sys; print([i for i in json.load(sys.stdin) if i['id']=='$MODEL'][0]['api'])")
placement=$("$SHOAL" ps --json --url "$url" | python3 -c "import json,sys; print([i for i in json.load(sys.stdin) if i['id']=='$MODEL'][0]['placement'])")
echo "== split: $placement ($NODES nodes, $THREADS thread(s) each)"
"$SHOAL" bench serve --url "http://$lead" --model "$MODEL" --streams "$STREAMS" -n "$N" -r "$R" 2>&1 | grep "median"
for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=()
"$SHOAL" serve --model "$MODEL" --api 127.0.0.1:0 --threads "$THREADS" --ctx "$CTX" --parallel 16 > "$work/one.ready" 2> "$work/one.log" &
pids+=($!)
wait_ready "$work/one.ready"
echo "== one node ($THREADS thread(s))"
"$SHOAL" bench serve --url "http://$(field "$work/one.ready" api)" --model "$MODEL" --streams "$STREAMS" -n "$N" -r "$R" 2>&1 | grep "median"
