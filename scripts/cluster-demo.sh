#!/usr/bin/env bash
# The main job on one machine: two `shoal serve` nodes form a cluster on loopback (shared
# secret, mDNS and a --peer seed), only the first has the model file, each offers at most
# 800 MB so the model cannot stay on one node; `shoal load` splits qwen05 across both (the
# second fetches its slice from the first), and `shoal run` asks it a question through the
# lead node's API. Everything runs under a temporary directory and stops at the end.
# Usage: scripts/cluster-demo.sh [PROMPT]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"What is the capital of France? Answer in one sentence."}
SHOAL=target/release/shoal
[ -x "$SHOAL" ] || cargo build --release
"$SHOAL" models fetch qwen05 >&2
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
"$SHOAL" secret > "$work/secret" 2>/dev/null
chmod 600 "$work/secret"
mkdir -p "$work/empty-home"

start() { # name, extra env; prints the node's ready line to $work/NAME.ready
  local name=$1; shift
  env "$@" "$SHOAL" serve --secret-file "$work/secret" --name "$name" \
    --listen 127.0.0.1:0 --api 127.0.0.1:0 --data-dir "$work/$name" \
    --max-memory 800M --threads 1 ${SEED:+--peer "$SEED"} \
    > "$work/$name.ready" 2> "$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/$name.ready" ] && return 0; sleep 0.2; done
  echo "node $name did not start; its log:" >&2; cat "$work/$name.log" >&2; exit 1
}
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

SEED='' start a
SEED=$(field "$work/a.ready" listen)
SEED=$SEED start b SHOAL_HOME="$work/empty-home"
URL_B="http://$(field "$work/b.ready" api)"

echo "== two nodes (a has qwen05, b has nothing)" >&2
for _ in $(seq 1 50); do
  n=$("$SHOAL" nodes --json --url "$URL_B" | python3 -c "import json,sys; print(sum(1 for n in json.load(sys.stdin) if n['alive']))")
  [ "$n" = 2 ] && break; sleep 0.2
done
# the planner needs the measured link between them (measured within seconds of joining)
for _ in $(seq 1 100); do
  n=$("$SHOAL" links --json --url "$URL_B" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
  [ "$n" -ge 2 ] && break; sleep 0.2
done
"$SHOAL" nodes --url "$URL_B" >&2
"$SHOAL" links --url "$URL_B" >&2
echo "== shoal load qwen05 (asked at b)" >&2
"$SHOAL" load qwen05 --ctx 512 --url "$URL_B" > "$work/placed" || { cat "$work"/*.log >&2; exit 1; }
cat "$work/placed" >&2
"$SHOAL" ps --url "$URL_B" >&2
LEAD=$("$SHOAL" ps --json --url "$URL_B" | python3 -c "import json,sys; print([i for i in json.load(sys.stdin) if i['id']=='qwen05'][0]['api'])")
echo "== shoal run qwen05 --url http://$LEAD" >&2
"$SHOAL" run qwen05 "$PROMPT" --temp 0 --url "http://$LEAD"
