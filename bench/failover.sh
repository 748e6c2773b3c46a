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
SHOAL_FAILOVER_ROUNDS=$rounds SHOAL_FAILOVER_MAX_GAP_MS=5000 SHOAL_FAILOVER_LEAD_MAX_GAP_MS=10000 \
  SHOAL_REQUIRE_MODELS=1 \
  cargo test --release -p shoal --test cluster_failover -- --nocapture --test-threads 1 2>&1 |
  grep --line-buffered -E "^(round|failover|killing|stream error|test result|/v1|/api)|panicked|gap of"
# the test's exit status decides
exit "${PIPESTATUS[0]}"
