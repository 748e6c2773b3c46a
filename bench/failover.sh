#!/usr/bin/env bash
# Requests surviving a node's death, repeated: each round starts three loopback nodes,
# places qwen05 tensor-parallel on two of them, runs 4 concurrent greedy streams of 300
# tokens, kills the node of the non-lead rank when the first stream reaches token 50, and
# checks that every stream completes with the uninterrupted run's text and no gap over 5 s.
# It is the CI test `cluster_failover` run ROUNDS times (default 20); the last line gives
# the gap's median and maximum over every stream of every round.
#
#   bench/failover.sh [ROUNDS]
#
# Not in CI (about a minute a round). Run it on an idle machine: the gap includes loading
# the new rank, which competes with anything else running.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
rounds=${1:-20}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (run on an idle machine)"
cd "$root"
set +e
SHOAL_FAILOVER_ROUNDS=$rounds SHOAL_FAILOVER_MAX_GAP_MS=5000 SHOAL_REQUIRE_MODELS=1 \
  cargo test --release -p shoal --test cluster_failover -- --nocapture 2>&1 |
  grep --line-buffered -E "^(round|failover|killing|stream error|test result)|panicked|gap of"
# the test's exit status decides
exit "${PIPESTATUS[0]}"
