#!/usr/bin/env bash
# The planner's predictions against measurements, on this machine, in one run: for one
# rank and for 2-rank tensor- and pipeline-parallel splits (loopback TCP, and emulated links),
# `shoal bench MODEL -t 1` measures decode and prefill tokens/s, and `shoal plan` predicts
# them for a two-node cluster file built from the bandwidth that bench measured and the
# emulated link (one-way latency L gives a round trip of 2L plus the loopback's own). Prints
# predicted, measured and the error of each.
#
#   bench/plan-vs-measured.sh [-p 128] [-n 64] [-r 2] [-s dense|moe] [MODEL]
#                                                   (default MODEL: qwen05)
#
# -s moe runs the splits of a mixture of experts: one rank, the experts split over 2 ranks
# (whole or sliced, as both the planner and the executor choose by default) and 2 pipeline
# stages, each over loopback and with 300 us of emulated one-way latency.
#
# The two emulated nodes share this machine's memory bus. The cluster file gives each node
# the bandwidth it has in the run: one thread's probe where one rank runs at a time (one
# rank, pipeline stages with one sequence), half of the two-thread probe where both ranks
# read weights at once (tensor and expert splits). A shared host's bus varies from minute to
# minute, so that probe runs beside each split it describes.
#
# Not in CI (it takes a few minutes). Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
p=128 n=64 r=2 set=dense
while getopts "p:n:r:s:" o; do
  case $o in p) p=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; s) set=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
model=${1:-qwen05}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine)"
# name  split-flags  one-way latency (us)  link Gbit/s (0 = loopback)
case $set in
  dense) configs=(
    "single|--tp 1|0|0"
    "tp2|--tp 2|0|0"
    "pp2|--pp 2|0|0"
    "tp2-250us-1g|--tp 2|250|1"
    "pp2-250us-1g|--pp 2|250|1"
    "tp2-50us-10g|--tp 2|50|10"
  ) ;;
  moe) configs=(
    "single|--tp 1|0|0"
    "experts2|--tp 2|0|0"
    "pp2|--pp 2|0|0"
    "experts2-300us|--tp 2|300|0"
    "pp2-300us|--pp 2|300|0"
  ) ;;
  *) echo "-s $set: use dense or moe" >&2; exit 2 ;;
esac
loopback_rtt_us=30 loopback_gbps=20
printf "%-14s %10s %10s %7s %11s %11s %7s\n" config "decode" "predicted" "error" "prefill" "predicted" "error"
for c in "${configs[@]}"; do
  IFS='|' read -r name flags lat gbps <<<"$c"
  link=()
  [ "$lat" = 0 ] || link+=(--link-latency-us "$lat")
  [ "$gbps" = 0 ] || link+=(--link-gbps "$gbps")
  # shellcheck disable=SC2086
  "$shoal" bench "$model" -p "$p" -n "$n" -r "$r" -t 1 $flags "${link[@]}" --json 2>/dev/null | tail -n1 >"$out/$name.json"
  if [ "$name" = single ]; then
    bw1=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mem_read_gb_s"])' "$out/single.json")
  fi
  bw=$bw1
  case $flags in *--tp\ [2-9]*)
    # the bus's share when both ranks read, probed (median of 3) right after the run
    "$shoal" bench "$model" -p 8 -n 8 -r 3 -t 2 --json 2>/dev/null | tail -n1 >"$out/probe2.json"
    bw=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mem_read_gb_s"] / 2)' "$out/probe2.json")
    bw2=$bw ;;
  esac
  rtt=$((2 * lat + loopback_rtt_us))
  lg=$gbps
  [ "$lg" = 0 ] && lg=$loopback_gbps
  cat >"$out/cluster.toml" <<EOF
[[node]]
name = "a"
memory_gb = 64
mem_bandwidth_gbs = $bw
compute_gflops = 150
threads = 1

[[node]]
name = "b"
memory_gb = 64
mem_bandwidth_gbs = $bw
compute_gflops = 150
threads = 1

[default_link]
rtt_us = $rtt
bandwidth_gbps = $lg
EOF
  "$shoal" plan "$model" --cluster "$out/cluster.toml" --ctx $((p + n)) --prompt-tokens "$p" --top 0 --json >"$out/$name.plan.json"
  python3 - "$name" "$flags" "$out/$name.json" "$out/$name.plan.json" <<'EOF'
import json, sys
name, flags, bench, plan = sys.argv[1:]
m = json.load(open(bench))
tp = int(flags.split("--tp ")[1].split()[0]) if "--tp" in flags else 1
pp = int(flags.split("--pp ")[1].split()[0]) if "--pp" in flags else 1
rows = [c for c in json.load(open(plan)) if c["tp"] == tp and c["pp"] == pp]
if not rows:
    sys.exit(f"{name}: the planner has no {tp}x{pp} candidate")
c = rows[0]
d, pd = m["decode_tok_s"], c["decode_tok_s"]
f, pf = m["prefill_tok_s"], c["prefill_tok_s"]
print(f"{name:<14} {d:>10.2f} {pd:>10.2f} {100*(pd/d-1):>+6.1f}% {f:>11.1f} {pf:>11.1f} {100*(pf/f-1):>+6.1f}%")
EOF
done
echo "read bandwidth per node: $bw1 GB/s alone, ${bw2:-?} GB/s with both ranks reading (last probe); compute assumed 150 GFLOP/s per node (the self-test of shoal serve measures it)"
