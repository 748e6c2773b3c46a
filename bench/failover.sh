#!/usr/bin/env bash
# Requests surviving a node's death, repeated: each round starts three loopback nodes,
# places qwen05 tensor-parallel on two of them, runs 4 concurrent greedy streams of 300
# tokens, kills the node of the non-lead rank when the first stream reaches token 50, and
# checks that every stream completes with the uninterrupted run's text and no gap over 5 s.
# Then, on a fresh cluster with a fourth, entry-only node (serve --no-compute), three streams
# (OpenAI, Anthropic, Ollama) enter at the entry node and one at the lead, and the lead is
# killed: the three must complete with the uninterrupted text and no gap over 10 s (the lead
# is found dead by the failure detector), the one at the lead must end with an error.
# It is the CI test `cluster_failover` run ROUNDS times (default 20); the last lines give
# the gap's median and maximum over every stream of every round, for each kind of kill.
#
#   bench/failover.sh [ROUNDS]
#   bench/failover.sh ROUNDS BEFORE_BIN
#
# With BEFORE_BIN (another build of shoal), each round runs once with this build and once
# with BEFORE_BIN, the order flipping every round, and the last lines give, per build and
# kind of kill, the median and maximum of every stream's longest gap and this build's median
# over BEFORE_BIN's. The rule, set before any run: the figure is that ratio of medians; the
# streams must all survive with either build.
#
# Not in CI (about a minute a round). Run it on an idle machine: the gap includes loading
# the new rank, which competes with anything else running.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
rounds=${1:-20}
before=${2:-}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (run on an idle machine)"
cd "$root"
filter='^(round|failover|killing|stream error|test result|/v1|/api)|panicked|gap of|shards loaded'
if [ -z "$before" ]; then
  set +e
  SHOAL_FAILOVER_ROUNDS=$rounds SHOAL_FAILOVER_MAX_GAP_MS=5000 SHOAL_FAILOVER_LEAD_MAX_GAP_MS=10000 \
    SHOAL_REQUIRE_MODELS=1 \
    cargo test --release -p shoal --test cluster_failover -- --nocapture --test-threads 1 2>&1 |
    grep --line-buffered -E "$filter"
  # the test's exit status decides
  exit "${PIPESTATUS[0]}"
fi
before=$(readlink -f "$before")
# this build's binary and test, copied once: the tree may change while the rounds run
cargo build --release -p shoal -q
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp target/release/shoal "$work/shoal-after"
test_exe=$(cargo test --release -p shoal --test cluster_failover --no-run 2>&1 |
  sed -n 's/.*Executable .*(\(.*\))$/\1/p' | tail -1)
cp "$test_exe" "$work/cluster_failover"
log=$work/log
run() { # LABEL BIN
  SHOAL_FAILOVER_ROUNDS=1 SHOAL_FAILOVER_MAX_GAP_MS=10000 SHOAL_FAILOVER_LEAD_MAX_GAP_MS=15000 \
    SHOAL_REQUIRE_MODELS=1 SHOAL_TEST_BIN=$2 \
    "$work/cluster_failover" --nocapture --test-threads 1 2>&1 |
    grep --line-buffered -E "$filter" | sed -u "s/^/$1: /" | tee -a "$log"
  return "${PIPESTATUS[0]}"
}
status=0
for round in $(seq 1 "$rounds"); do
  if [ $((round % 2)) = 1 ]; then
    run after "$work/shoal-after" || status=1
    run before "$before" || status=1
  else
    run before "$before" || status=1
    run after "$work/shoal-after" || status=1
  fi
done
python3 - "$log" <<'PY'
import re, statistics, sys
gaps = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\w+): failover round \d+( \(lead killed\))?: gaps_ms \[([0-9, ]*)\]", line)
    if not m:
        continue
    kind = "lead killed" if m.group(2) else "non-lead killed"
    vals = [int(v) for v in m.group(3).split(",") if v.strip()]
    if kind == "lead killed":
        vals = vals[:-1]  # the last stream entered at the killed lead: it ends with an error
    gaps.setdefault((m.group(1), kind), []).extend(vals)
for kind in ["non-lead killed", "lead killed"]:
    med = {}
    for build in ["before", "after"]:
        g = sorted(gaps.get((build, kind), []))
        if not g:
            continue
        med[build] = statistics.median(g)
        print(f"{kind:16} {build:6}: {len(g)} streams, gap median {med[build]:.0f} ms, max {g[-1]} ms")
    if len(med) == 2:
        print(f"{kind:16} after/before median gap: {med['after'] / med['before']:.2f}")
PY
exit "$status"
