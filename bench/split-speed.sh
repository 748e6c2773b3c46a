#!/usr/bin/env bash
# Decode speed across a split with and without speculation: the code edit of
# bench/lookup.sh (bench/data/edit-function.py, or -e another) continued greedily as raw text
# by one rank, by two ranks tensor-parallel (tp2) and by two pipeline stages (pp2), each
# plain, with --lookup and, with -D, with --draft DRAFT (the draft model runs beside rank 0),
# over an emulated link of each one-way latency given (the transport holds every message for
# it; every rank on this host, 1 thread each unless -t). Prints decode tokens/s, each
# speculation's ratio to plain in the same layout, and whether its text is plain's (tensor
# splits round differently from one rank, so texts are compared within a layout).
#
#   bench/split-speed.sh [-t THREADS] [-n TOKENS] [-e EDIT] [-x FLAG] [-D DRAFT] [MODEL]
#                        [LATENCY_US...]
#   (default: -t 1 -n 300 qwen15 50 300 1000 5000, no draft model; -x adds FLAG to the
#   speculative runs; SHOAL=BINARY runs another build)
#
# Not in CI. Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
t=1 n=300 edit=$here/data/edit-function.py extra=() draft=
while getopts "t:n:e:x:D:" o; do
  case $o in
    t) t=$OPTARG ;; n) n=$OPTARG ;; e) edit=$OPTARG ;; x) extra+=("$OPTARG") ;;
    D) draft=$OPTARG ;; *) exit 2 ;;
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
dpath=$draft
[ -z "$draft" ] || [ -f "$dpath" ] || dpath=$("$shoal" models fetch "$draft" 2>/dev/null | tail -n1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$here/edit-prompt.sh"
prompt=$(edit_prompt "$edit")
prompt+=$'\n'
rate() { sed -n 's/.*generation: \([0-9]*\) tokens, \([0-9.]*\) tok\/s.*/\2/p' "$1"; }
accepted() { grep '^speculation:' "$1" | sed 's/^speculation: \([0-9]* of [0-9]*\).*/\1/' || true; }
# one run of a layout: NAME KIND [FLAGS...]; its output in $work/NAME.KIND.{txt,err}
one() {
  local name=$1 kind=$2
  shift 2
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" "$@" \
    >"$work/$name.$kind.txt" 2>"$work/$name.$kind.err" ||
    { cat "$work/$name.$kind.err" >&2; exit 1; }
}
# a speculative run against plain: "tok/s ratio same accepted"
against_plain() {
  local name=$1 kind=$2 p s
  p=$(rate "$work/$name.plain.err")
  s=$(rate "$work/$name.$kind.err")
  printf "%8s %6.2f %4s %-12s" "$s" "$(python3 -c "print($s / $p)")" \
    "$(cmp -s "$work/$name.plain.txt" "$work/$name.$kind.txt" && echo same || echo DIFF)" \
    "$(accepted "$work/$name.$kind.err")"
}
# one layout: plain, with lookup, and with the draft model if there is one
pair() {
  local name=$1
  shift
  one "$name" plain "$@"
  one "$name" lookup "$@" --lookup ${extra[@]+"${extra[@]}"}
  printf "%8s %s" "$(rate "$work/$name.plain.err")" "$(against_plain "$name" lookup)"
  if [ -n "$draft" ]; then
    one "$name" draft "$@" --draft "$dpath" ${extra[@]+"${extra[@]}"}
    printf " %s" "$(against_plain "$name" draft)"
  fi
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine); $(basename "$path"), $t thread(s) per rank, $n tokens, $(basename "$edit")${extra[*]:+, ${extra[*]}}${draft:+, draft $(basename "$dpath")}"
printf "%-16s %8s %8s %6s %4s %-12s" "layout" "plain" "lookup" "ratio" "text" "drafts taken"
[ -z "$draft" ] || printf " %8s %6s %4s %-12s" "draft" "ratio" "text" "drafts taken"
echo
printf "%-16s %s\n" "one rank" "$(pair one)"
for l in "${lats[@]}"; do
  printf "%-16s %s\n" "tp2 ${l}us" "$(pair "tp$l" --tp 2 --link-latency-us "$l")"
  printf "%-16s %s\n" "pp2 ${l}us" "$(pair "pp$l" --pp 2 --link-latency-us "$l")"
done
