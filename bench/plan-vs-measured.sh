#!/usr/bin/env bash
# The planner's predictions against measurements, on this machine, in one run: for one
# rank and for 2-rank tensor- and pipeline-parallel splits (loopback TCP, and emulated links),
# `shoal bench MODEL -t 1` measures decode and prefill tokens/s, and `shoal plan` predicts
# them for a two-node cluster file built from the bandwidth that bench measured and the
# emulated link (one-way latency L gives a round trip of 2L plus the loopback's own). Each
# figure is predicted twice: from bytes over bandwidth and FLOPs over compute, and from this
# node's measured costs of the model's shape (`shoal bench --calibrate`, run first, named in
# the cluster file). Prints measured, predicted and the error of each.
#
#   bench/plan-vs-measured.sh [-p 128] [-n 64] [-r 2] [-s dense|moe] [-l "50 300 1000 5000"]
#                             [MODEL]               (default MODEL: qwen05)
#
# Configurations: one rank, then 2 tensor-parallel ranks and 2 pipeline stages over loopback
# and over each emulated one-way latency of -l (microseconds). -s moe runs the splits of a
# mixture of experts: the experts split over 2 ranks (whole or sliced, as both the planner and
# the executor choose by default) instead of the tensor split. The summary counts the
# predictions within 20% of the measurement and, per link, whether the configuration the
# planner predicts fastest is the one measured fastest (or within 5% of it).
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
p=128 n=64 r=2 set=dense lats="50 300 1000 5000"
while getopts "p:n:r:s:l:" o; do
  case $o in
    p) p=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; s) set=$OPTARG ;; l) lats=$OPTARG ;;
    *) exit 2 ;;
  esac
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
  dense) two=tp2 ;;
  moe) two=experts2 ;;
  *) echo "-s $set: use dense or moe" >&2; exit 2 ;;
esac
# one rank, then both two-rank splits over loopback and over each emulated link
configs=("single|--tp 1|0|0" "$two|--tp 2|0|0" "pp2|--pp 2|0|0")
for lat in $lats; do
  configs+=("$two-${lat}us|--tp 2|$lat|0" "pp2-${lat}us|--pp 2|$lat|0")
done
loopback_rtt_us=30 loopback_gbps=20
# this node's measured costs of the model's shape (one rank, one thread), for the
# calibrated predictions
"$shoal" bench "$model" -p 0 -n "$n" -r 3 -t 1 --calibrate --json 2>/dev/null | tail -n1 >"$out/calibration.json"
cal=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["calibration_file"])' "$out/calibration.json")
echo "calibration: $cal"
printf "%-16s %8s | %9s %7s | %9s %7s | %8s | %9s %7s | %9s %7s\n" config decode "bytes" error "measured" error prefill "FLOPs" error "measured" error
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
  for kind in bytes measured; do
    calibrations=
    [ $kind = measured ] && calibrations="calibrations = [\"$cal\"]"
    cat >"$out/cluster.toml" <<EOF
[[node]]
name = "a"
memory_gb = 64
mem_bandwidth_gbs = $bw
compute_gflops = 150
threads = 1
$calibrations

[[node]]
name = "b"
memory_gb = 64
mem_bandwidth_gbs = $bw
compute_gflops = 150
threads = 1
$calibrations

[default_link]
rtt_us = $rtt
bandwidth_gbps = $lg
EOF
    "$shoal" plan "$model" --cluster "$out/cluster.toml" --ctx $((p + n)) --prompt-tokens "$p" --top 0 --json >"$out/$name.$kind.json"
  done
  python3 - "$name" "$lat" "$flags" "$out/$name.json" "$out/$name.bytes.json" "$out/$name.measured.json" "$out/rows.tsv" <<'EOF'
import json, sys
name, lat, flags, bench, bytes_plan, measured_plan, rows = sys.argv[1:]
m = json.load(open(bench))
tp = int(flags.split("--tp ")[1].split()[0]) if "--tp" in flags else 1
pp = int(flags.split("--pp ")[1].split()[0]) if "--pp" in flags else 1
def candidate(path):
    rows = [c for c in json.load(open(path)) if c["tp"] == tp and c["pp"] == pp]
    if not rows:
        sys.exit(f"{name}: the planner has no {tp}x{pp} candidate")
    return rows[0]
b, c = candidate(bytes_plan), candidate(measured_plan)
if not c["calibrated"]:
    sys.exit(f"{name}: the planner did not use the calibration")
d, f = m["decode_tok_s"], m["prefill_tok_s"]
err = lambda x, y: f"{100 * (x / y - 1):>+6.1f}%"
print(f"{name:<16} {d:>8.2f} | {b['decode_tok_s']:>9.2f} {err(b['decode_tok_s'], d)} | "
      f"{c['decode_tok_s']:>9.2f} {err(c['decode_tok_s'], d)} | {f:>8.1f} | "
      f"{b['prefill_tok_s']:>9.1f} {err(b['prefill_tok_s'], f)} | "
      f"{c['prefill_tok_s']:>9.1f} {err(c['prefill_tok_s'], f)}")
with open(rows, "a") as out:
    print(name, lat, d, b["decode_tok_s"], c["decode_tok_s"], sep="\t", file=out)
EOF
done
# Per prediction (from bytes, from measured costs): how many decode figures are within 20% of
# the measurement, and for each link whether the configuration the planner predicts fastest
# is the one measured fastest (one rank needs no link, so it competes on every link). A
# choice passes when its measured decode is within 5% of the fastest.
python3 - "$out/rows.tsv" <<'EOF'
import sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
rows = [(n, int(l), float(d), float(b), float(c)) for n, l, d, b, c in rows]
links = sorted({r[1] for r in rows if r[0] != "single"})
single = [r for r in rows if r[0] == "single"]
for col, kind in [(3, "from bytes"), (4, "from measured costs")]:
    within = sum(abs(r[col] / r[2] - 1) <= 0.2 for r in rows)
    passed, notes = 0, []
    for l in links:
        group = single + [r for r in rows if r[1] == l and r[0] != "single"]
        chosen = max(group, key=lambda r: r[col])
        fastest = max(group, key=lambda r: r[2])
        ok = chosen[2] >= 0.95 * fastest[2]
        passed += ok
        notes.append(f"{l} us: {chosen[0]}{'' if ok else ' (measured fastest: ' + fastest[0] + ')'}")
    print(f"predicted {kind}: {within} of {len(rows)} decode figures within 20%; first "
          f"choice measured fastest (within 5%) on {passed} of {len(links)} links "
          f"[{'; '.join(notes)}]")
EOF
echo "read bandwidth per node: $bw1 GB/s alone, ${bw2:-?} GB/s with both ranks reading (last probe); compute assumed 150 GFLOP/s per node (the self-test of shoal serve measures it)"
