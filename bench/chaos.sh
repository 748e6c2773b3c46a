#!/usr/bin/env bash
# Chaos on a loopback cluster: four nodes serve qwen05 (tensor-parallel) and smollm2
# (pipeline); eight clients stream greedy answers through random nodes while a random node
# is killed every 45-90 s and started again 20 s later. Prints each kill and restart, then
# streams started, finished with the uninterrupted text or another, refused before they
# started, lost (with their entry node, or otherwise: must be 0), the longest gap, and every
# node's resident memory every 5 s. It is the CI test `cluster_chaos` (2 minutes there) run
# for MINUTES (default 30).
#
#   bench/chaos.sh [MINUTES]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
minutes=${1:-30}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (run on an idle machine)"
cd "$root"
set +e
SHOAL_CHAOS_SECONDS=$((minutes * 60)) SHOAL_REQUIRE_MODELS=1 \
  cargo test --release -p shoal --test cluster_chaos -- --nocapture 2>&1 |
  grep --line-buffered -E "^ *[0-9]+ s: |^chaos|^memory|panicked|lost|via |test result"
exit "${PIPESTATUS[0]}"
