#!/usr/bin/env bash
# Two shoal binaries side by side on `shoal bench`, in alternating rounds, as ratios: the
# check that a change lost no speed. Each round runs both binaries once per configuration,
# the order flipping every round; each run is `shoal bench MODEL -p P -n N -r 3 -t T --json`
# (with --seqs K: decode only, K sequences at once). Per configuration and binary it takes
# the median over rounds of each run's median, and prints after/before.
#
#   bench/ab.sh BEFORE AFTER [ROUNDS]          # default configurations, 5 rounds
#   CONFIGS="qwen05:1 smollm2:2:16" bench/ab.sh BEFORE AFTER 5
#
# A configuration is MODEL:THREADS[:SEQS]. The default is the pp128/tg64 set at 1 and 2
# threads of qwen05, smollm2, qwen15 and gemma3, and smollm2 with 16 sequences at 2 threads.
# Models must be fetched (shoal models fetch ...). Run it on an otherwise idle machine; the
# host's steal time is printed per run.
set -euo pipefail
before=$1
after=$2
rounds=${3:-5}
p=${P:-128}
n=${N:-64}
configs=${CONFIGS:-"qwen05:1 qwen05:2 smollm2:1 smollm2:2 qwen15:1 qwen15:2 gemma3:1 gemma3:2 smollm2:2:16"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # BIN LABEL MODEL THREADS SEQS ROUND
  local bin=$1 label=$2 model=$3 t=$4 seqs=$5 round=$6 args
  if [ -n "$seqs" ]; then
    args=(-p 0 -n "$n" --seqs "$seqs")
  else
    args=(-p "$p" -n "$n")
  fi
  "$bin" bench "$model" "${args[@]}" -r 3 -t "$t" --json 2>/dev/null >"$out/$label.$model.$t.$seqs.$round.json"
}

for round in $(seq 1 "$rounds"); do
  for c in $configs; do
    IFS=: read -r model t seqs <<<"$c"
    if [ $((round % 2)) = 1 ]; then
      run "$before" before "$model" "$t" "${seqs:-}" "$round"
      run "$after" after "$model" "$t" "${seqs:-}" "$round"
    else
      run "$after" after "$model" "$t" "${seqs:-}" "$round"
      run "$before" before "$model" "$t" "${seqs:-}" "$round"
    fi
  done
  echo "round $round of $rounds done" >&2
done

python3 - "$out" "$rounds" $configs <<'EOF'
import json, statistics, sys
out, rounds, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(label, model, t, seqs, r):
    return json.load(open(f"{out}/{label}.{model}.{t}.{seqs}.{r}.json"))
print(f"{'configuration':<22} {'what':<8} {'before (median of rounds)':>26} {'after':>10} {'after/before':>13}  steal max")
worst = None
for c in configs:
    model, t, *rest = c.split(":")
    seqs = rest[0] if rest else ""
    for what in (["decode"] if seqs else ["prefill", "decode"]):
        med = {}
        steal = 0.0
        for label in ("before", "after"):
            runs = [load(label, model, t, seqs, r) for r in range(1, rounds + 1)]
            med[label] = statistics.median(x[what]["median"] for x in runs)
            steal = max(steal, max(x.get("host_steal") or 0.0 for x in runs))
        ratio = med["after"] / med["before"]
        worst = ratio if worst is None else min(worst, ratio)
        name = f"{model} t{t}" + (f" seqs {seqs}" if seqs else "")
        extra = ""
        if what == "decode":
            # each run's decode against the read bandwidth probed right after it: the
            # machine's bandwidth drifts between minutes
            frac = {}
            for label in ("before", "after"):
                runs = [load(label, model, t, seqs, r) for r in range(1, rounds + 1)]
                frac[label] = statistics.median(x["decode_fraction_of_ceiling"]["median"] for x in runs)
            extra = f"  of ceiling {100*frac['before']:.0f}% -> {100*frac['after']:.0f}% ({frac['after']/frac['before']:.3f})"
        print(f"{name:<22} {what:<8} {med['before']:>26.1f} {med['after']:>10.1f} {ratio:>13.3f}  {100*steal:.1f}%{extra}")
print(f"worst ratio: {worst:.3f}")
EOF
