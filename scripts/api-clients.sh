#!/usr/bin/env bash
# The official Python clients (openai, anthropic, ollama from PyPI) against `shoal serve`:
# starts an open server with smollm2 and qwen05, a second one for API keys and rate
# limits and a third replaying a thinking model's output, runs
# crates/shoal-api/tests/clients/test_clients.py, and exits non-zero when any test fails.
# The clients live in a virtual environment in $SHOAL_HOME (outside the clone).
# Needs a release build and the fetched models (scripts/test.sh does both first).
set -euo pipefail
cd "$(dirname "$0")/.."
export SHOAL_HOME=${SHOAL_HOME:-$HOME/.cache/shoal}
VENV=$SHOAL_HOME/py-clients
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check openai anthropic ollama jsonschema httpx

BIN=target/release/shoal
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# start NAME ARGS...: runs `shoal serve ARGS` and waits for its ready line; sets URL.
start() {
  local name=$1; shift
  "$BIN" serve --api 127.0.0.1:0 --data-dir "$WORK/$name" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 600); do
    if [ -s "$WORK/$name.out" ]; then
      URL=http://$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["api"])' "$WORK/$name.out")
      return 0
    fi
    kill -0 "${PIDS[-1]}" 2>/dev/null || { cat "$WORK/$name.err" >&2; echo "shoal serve ($name) exited" >&2; exit 1; }
    sleep 0.2
  done
  echo "shoal serve ($name) did not become ready" >&2
  exit 1
}

start open --model smollm2 --model qwen05 --parallel 4 --ctx 2048
OPEN=$URL
start keyed --model smollm2 --parallel 2 --ctx 512
KEYED=$URL
# no model that thinks is on the registries: smollm2 with Qwen3's chat template replays
# output written in Qwen3's format, through the real tokenizer, scheduler and parsers
start thinking --model smollm2 --parallel 2 --ctx 2048 \
  --chat-template crates/shoal-model/tests/data/templates/Qwen-Qwen3-0.6B.jinja \
  --replay crates/shoal-api/tests/data/thinking-qwen3.json
THINKING=$URL
echo "servers: open $OPEN, keyed $KEYED, thinking $THINKING"
status=0
"$VENV/bin/python" crates/shoal-api/tests/clients/test_clients.py --open "$OPEN" --keyed "$KEYED" \
  --thinking "$THINKING" "$@" || status=$?
# the metrics the requests above produced must parse as Prometheus exposition
"$VENV/bin/python" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1] + "/metrics").read().decode())' "$OPEN" >"$WORK/metrics.txt"
if command -v promtool >/dev/null; then
  if promtool check metrics <"$WORK/metrics.txt"; then
    echo "ok    promtool check metrics ($(grep -c '^shoal_' "$WORK/metrics.txt") samples)"
  else
    echo "FAIL  promtool check metrics"; status=1
  fi
elif [ "${SHOAL_REQUIRE_PROMTOOL:-0}" = 1 ] || [ "${CI:-}" = true ]; then
  echo "FAIL  promtool is not installed, and CI (CI=true) does not skip (apt-get install prometheus)"; status=1
else
  echo "skip  promtool check metrics (promtool not installed)"
fi
if [ $status -ne 0 ]; then
  echo "--- open server log (tail)"; tail -20 "$WORK/open.err"
  echo "--- keyed server log (tail)"; tail -20 "$WORK/keyed.err"
fi
exit $status
