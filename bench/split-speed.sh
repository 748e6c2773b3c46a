#!/usr/bin/env bash
# Decode speed across a split with and without prompt-lookup speculation: the code edit of
# bench/lookup.sh (bench/data/edit-function.py, or -e another) continued greedily as raw text
# by one rank, by two ranks tensor-parallel (tp2) and by two pipeline stages (pp2), each
# plain and with --lookup, over an emulated link of each one-way latency given (the
# transport holds every message for it; every rank on this host, 1 thread each unless -t).
# Prints decode tokens/s, lookup's ratio to plain in the same layout, and whether the two
# texts are the same (tensor splits round differently from one rank, so texts are compared
# within a layout). A draft model runs on one rank only, so it is not in this table.
#
#   bench/split-speed.sh [-t THREADS] [-n TOKENS] [-e EDIT] [-x FLAG] [MODEL] [LATENCY_US...]
#   (default: -t 1 -n 300 qwen15 50 300 1000 5000; -x adds FLAG to the --lookup runs;
#   SHOAL=BINARY runs another build)
#
# Not in CI. Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
t=1 n=300 edit=$here/data/edit-function.py extra=()
while getopts "t:n:e:x:" o; do
  case $o in
    t) t=$OPTARG ;; n) n=$OPTARG ;; e) edit=$OPTARG ;; x) extra+=("$OPTARG") ;; *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
model=${1:-qwen15}
[ $# -gt 0 ] && shift
lats=("$@")
[ ${#lats[@]} -eq 0 ] && lats=(50 300 1000 5000)
shoal=${SHOAL:-$root/target/release/shoal}
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
path=$model
[ -f "$path" ] || path=$("$shoal" models fetch "$model" 2>/dev/null | tail -n1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$here/edit-prompt.sh"
prompt=$(edit_prompt "$edit")
prompt+=$'\n'
rate() { sed -n 's/.*generation: \([0-9]*\) tokens, \([0-9.]*\) tok\/s.*/\2/p' "$1"; }
accepted() { grep '^speculation:' "$1" | sed 's/^speculation: \([0-9]* of [0-9]*\).*/\1/' || true; }
# one layout, plain then with lookup: "plain lookup ratio same accepted"
pair() {
  local name=$1
  shift
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" "$@" \
    >"$work/$name.plain.txt" 2>"$work/$name.plain.err" ||
    { cat "$work/$name.plain.err" >&2; exit 1; }
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" "$@" --lookup \
    ${extra[@]+"${extra[@]}"} >"$work/$name.lookup.txt" 2>"$work/$name.lookup.err" ||
    { cat "$work/$name.lookup.err" >&2; exit 1; }
  local p l
  p=$(rate "$work/$name.plain.err")
  l=$(rate "$work/$name.lookup.err")
  printf "%8s %8s %7.2f %6s %s" "$p" "$l" "$(python3 -c "print($l / $p)")" \
    "$(cmp -s "$work/$name.plain.txt" "$work/$name.lookup.txt" && echo same || echo DIFF)" \
    "$(accepted "$work/$name.lookup.err")"
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine); $(basename "$path"), $t thread(s) per rank, $n tokens, $(basename "$edit")${extra[*]:+, ${extra[*]}}"
printf "%-16s %8s %8s %7s %6s %s\n" "layout" "plain" "lookup" "ratio" "text" "drafts taken"
printf "%-16s %s\n" "one rank" "$(pair one)"
for l in "${lats[@]}"; do
  printf "%-16s %s\n" "tp2 ${l}us" "$(pair "tp$l" --tp 2 --link-latency-us "$l")"
  printf "%-16s %s\n" "pp2 ${l}us" "$(pair "pp$l" --pp 2 --link-latency-us "$l")"
done
