#!/usr/bin/env bash
# Decode speed of a model split over 2 local ranks, tensor parallel (TP2) against pipeline
# parallel (PP2; and PP2 decoding two sequences at once, total tokens/s), with the emulated
# link at several one-way latencies, next to one rank; every rank 1 thread.
#   bench/split-latency.sh [MODEL] [N_GEN] [LATENCIES_US...]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-qwen05}
n=${2:-32}
shift $(( $# > 2 ? 2 : $# )) || true
lats=("$@")
[ ${#lats[@]} -eq 0 ] && lats=(0 50 300 1000)
bin=target/release/shoal
[ -x "$bin" ] || cargo build --release --quiet -p shoal
tg() { "$bin" bench "$model" -p 0 -n "$n" -r 3 -t 1 --json "$@" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["decode_tok_s"])'; }
one=$(tg)
echo "model $model, decode tg$n, tokens/s (1 thread per rank); one rank: $one"
printf '%-14s %8s %8s %10s %8s %8s %10s\n' "latency (us)" "TP2" "PP2" "PP2 2 seq" "TP2/1" "PP2/1" "PP2x2/1"
for l in "${lats[@]}"; do
  t=$(tg --tp 2 --link-latency-us "$l")
  p=$(tg --pp 2 --link-latency-us "$l")
  p2=$(tg --pp 2 --seqs 2 --link-latency-us "$l")
  r() { python3 -c "print('%.2f' % ($1 / $one))"; }
  printf '%-14s %8s %8s %10s %8s %8s %10s\n' "$l" "$t" "$p" "$p2" "$(r "$t")" "$(r "$p")" "$(r "$p2")"
done
