#!/usr/bin/env bash
# The planner's predictions against measurements, on this machine, in one run: for one
# rank and for 2-rank tensor- and pipeline-parallel splits (loopback TCP, and emulated links),
# `shoal bench MODEL -t 1` measures decode and prefill tokens/s, and `shoal plan` predicts
# them for a two-node cluster file built from the bandwidth that bench measured and the
# emulated link (one-way latency L gives a round trip of 2L plus the loopback's own). Prints
# predicted, measured and the error of each.
#
#   bench/plan-vs-measured.sh [-p 128] [-n 64] [-r 2] [MODEL]     (default MODEL: qwen05)
#
# Not in CI (it takes a few minutes). Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
p=128 n=64 r=2
while getopts "p:n:r:" o; do
  case $o in p) p=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
model=${1:-qwen05}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine)"
# name  split-flags  one-way latency (us)  link Gbit/s (0 = loopback)
configs=(
  "single|--tp 1|0|0"
  "tp2|--tp 2|0|0"
  "pp2|--pp 2|0|0"
  "tp2-250us-1g|--tp 2|250|1"
  "pp2-250us-1g|--pp 2|250|1"
  "tp2-50us-10g|--tp 2|50|10"
)
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
    bw=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mem_read_gb_s"])' "$out/single.json")
  fi
  rtt=$((2 * lat + loopback_rtt_us))
  lg=$gbps
  [ "$lg" = 0 ] && lg=$loopback_gbps
  cat >"$out/cluster.toml" <<EOF
[[node]]
name = "a"
memory_gb = 8
mem_bandwidth_gbs = $bw
compute_gflops = 150
threads = 1

[[node]]
name = "b"
memory_gb = 8
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
echo "read bandwidth from the one-rank bench: $bw GB/s; compute assumed 150 GFLOP/s per node (the self-test of shoal serve measures it)"
