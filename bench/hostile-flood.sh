#!/usr/bin/env bash
# One API client against a two-node cluster (127.0.0.1 only, bounded): qwen05 is placed
# split over nodes a and b, then FLOODERS clients post /v1/responses requests of 3.9 MB of
# whitespace to a, ROUNDS times each (each must end in a 4xx, prompt too long). Meanwhile
# /health on a is timed every 100 ms and the cluster is watched from b. Prints a table: the
# flood's answers, /health's slowest and median answer during it, whether b ever saw a as
# dead, and the instance's generation before and after (a re-placement raises it).
#
#   [CTX=N] bench/hostile-flood.sh [FLOODERS] [ROUNDS]      (default 3 and 3, context 512)
# Needs a release build and the fetched qwen05.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOODERS=${1:-3}
ROUNDS=${2:-3}
CTX=${CTX:-512}
SHOAL=target/release/shoal
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
"$SHOAL" secret >"$work/secret" 2>/dev/null
chmod 600 "$work/secret"
start() {
  local name=$1
  shift
  "$SHOAL" serve --secret-file "$work/secret" --name "$name" --cluster "flood-$$" --no-mdns \
    --listen 127.0.0.1:0 --api 127.0.0.1:0 --data-dir "$work/$name" --max-memory 2G \
    --threads 1 "$@" >"$work/$name.ready" 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 150); do [ -s "$work/$name.ready" ] && return 0; sleep 0.2; done
  echo "node $name did not start" >&2
  cat "$work/$name.log" >&2
  exit 1
}
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
start a
start b --peer "$(field "$work/a.ready" listen)"
A=http://$(field "$work/a.ready" api)
B=http://$(field "$work/b.ready" api)
for _ in $(seq 1 100); do
  n=$("$SHOAL" links --json --url "$B" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
  [ "$n" -ge 2 ] && break
  sleep 0.2
done
"$SHOAL" load qwen05 --ctx "$CTX" --url "$B" >/dev/null
python3 - "$A" "$B" "$FLOODERS" "$ROUNDS" <<'PY'
import json, statistics, sys, threading, time, urllib.request, urllib.error
a, b, flooders, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())

def generation():
    return {i["id"]: i["generation"] for i in get(b + "/cluster/instances")["instances"]}

before = generation()
body = json.dumps({"model": "qwen05", "input": " " * 3_900_000}).encode()
statuses, done = [], threading.Event()

def flood():
    for _ in range(rounds):
        req = urllib.request.Request(a + "/v1/responses", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                statuses.append(r.status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
        except Exception as e:
            statuses.append(str(e)[:40])

health, dead_seen = [], False
def watch():
    global dead_seen
    while not done.is_set():
        t = time.monotonic()
        try:
            get(a + "/health", timeout=30)
            health.append((time.monotonic() - t) * 1000)
        except Exception:
            health.append(30000.0)
        nodes = get(b + "/cluster/nodes")["nodes"]
        if any(not n["alive"] for n in nodes):
            dead_seen = True
        time.sleep(0.1)

w = threading.Thread(target=watch)
w.start()
t0 = time.monotonic()
threads = [threading.Thread(target=flood) for _ in range(flooders)]
for t in threads: t.start()
for t in threads: t.join()
took = time.monotonic() - t0
time.sleep(3)  # a node wrongly declared dead shows within the failure detector's time
done.set()
w.join()
after = generation()
print(f"{'flood':28} {flooders} clients x {rounds} requests of 3.9 MB in {took:.1f} s: answers {sorted(set(map(str, statuses)))}")
print(f"{'/health on a (ms)':28} median {statistics.median(health):.0f}, slowest {max(health):.0f}, {len(health)} probes")
print(f"{'a seen dead from b':28} {'yes' if dead_seen else 'no'}")
print(f"{'instance generation':28} before {before}, after {after}")
PY
