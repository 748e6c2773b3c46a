#!/usr/bin/env bash
# Drafting with a model's own multi-token-prediction layer (`shoal run --mtp`) against plain
# decoding, on one process or on the split -s gives (`-s "--tp 2"`: every run is that split,
# the lead holding the layer): `shoal run --raw --temp 0` plain, with `--mtp` (draft lengths
# chosen from the measured cost of a step's rows and the drafts taken so far), and with
# `--mtp --fixed-drafts --draft-max K` for each K of -k (every step checks K drafts),
# alternating, R rounds. Prints each run's decode tokens/s, its ratio to the plain run of
# the same round, the drafts taken, and whether the text is the plain run's; then the
# median ratio of each.
#
#   bench/mtp.sh [-t THREADS] [-n TOKENS] [-r ROUNDS] [-k "1 3"] [-s "SPLIT FLAGS"] [MODEL]
#   (default: -t 2 -n 64 -r 3 -k "1 3" glm-4.5-air-4l, one process; -t is per rank)
#
# MODEL is a GGUF with a prediction layer (GLM-4.5 and later), or a shape of bench/synth.sh
# that has one (glm-4.5-air-4l: GLM-4.5-Air's shapes at 4 of its 46 layers, and its
# prediction layer). A synthetic file's random weights make the layer's drafts miss, so
# there it measures what drafting costs when nothing is taken: the price of the layer and of
# the rows checked. A 4-layer cut makes the layer a fifth of the model's depth where the full
# model has one layer in 47, so the fixed-draft columns overstate its cost.
#
# Not in CI. Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
t=2 n=64 r=3 ks="1 3" split=""
while getopts "t:n:r:k:s:" o; do
  case $o in
    t) t=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; k) ks=$OPTARG ;; s) split=$OPTARG ;; *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
model=${1:-glm-4.5-air-4l}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
path=$model
[ -f "$path" ] || path=$("$here/synth.sh" "$model" | tail -n1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prompt="Write a short story about a lighthouse keeper who finds a message in a bottle."
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine); $(basename "$path"), $t threads, $n tokens${split:+, split $split}"
rate() { sed -n 's/.*generation: \([0-9]*\) tokens, \([0-9.]*\) tok\/s.*/\2/p' "$1"; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[2]) / float(sys.argv[1]):.2f}')" "$1" "$2"; }
runs=("mtp|--mtp")
for k in $ks; do runs+=("mtp-fixed-$k|--mtp --fixed-drafts --draft-max $k"); done
: >"$work/ratios"
same=same
for i in $(seq "$r"); do
  # shellcheck disable=SC2086
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" --ignore-eos $split >"$work/plain.txt" 2>"$work/plain.err"
  plain=$(rate "$work/plain.err")
  printf "round %d: plain %6.2f tok/s\n" "$i" "$plain"
  for run in "${runs[@]}"; do
    IFS='|' read -r name flags <<<"$run"
    # shellcheck disable=SC2086
    "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" --ignore-eos $split $flags >"$work/$name.txt" 2>"$work/$name.err"
    got=$(rate "$work/$name.err")
    text=same
    cmp -s "$work/plain.txt" "$work/$name.txt" || { text=different; same=different; }
    x=$(ratio "$plain" "$got")
    echo "$name $x" >>"$work/ratios"
    printf "         %-13s %6.2f tok/s (%sx), text %s; %s\n" "$name" "$got" "$x" "$text" \
      "$(grep '^speculation:' "$work/$name.err" | sed 's/^speculation: //')"
  done
done
echo "median ratio to plain:"
for run in "${runs[@]}"; do
  name=${run%%|*}
  printf "  %-13s %s\n" "$name" "$(awk -v n="$name" '$1 == n {print $2}' "$work/ratios" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')"
done
if [ "$same" = different ]; then
  echo "a run with drafts gave another text than the plain run (on a mixture of experts a step of several rows can route a near tie to other experts than a one-row step: compare the two runs' logits before calling it a fault)" >&2
  exit 1
fi
