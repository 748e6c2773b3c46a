#!/usr/bin/env bash
# Speculative decoding on a code edit: a function (the 60-line one in
# bench/data/edit-function.py, or with -e another, such as bench/data/edit-numbered.py whose
# 40 lines differ by a counter, so that prompt lookup's drafts keep missing), then the
# instruction to write it again with its parameter tax_rate renamed, continued greedily as
# raw text (no chat template, so llama.cpp reads the same
# tokens). `shoal run --raw --temp 0` plain, with `--lookup` and with `--draft DRAFT`,
# alternating, R rounds: decode tokens/s, the acceptance rate, and whether the texts are
# the same. Speculation chooses each step's draft length from what it measured (pass
# -x --fixed-drafts to check every drafted token, as before). Beside it, llama.cpp built from the PyPI sdist on the same files:
# `llama-simple` (plain greedy), `llama-lookup` (its prompt lookup) and
# `llama-speculative` (its draft model), where bench/llamacpp-build.sh built them.
#
#   bench/lookup.sh [-t THREADS] [-n TOKENS] [-r ROUNDS] [-D DRAFT] [-e EDIT] [-x FLAG] [MODEL]
#   (default: -t 2 -n 600 -r 3 -D qwen05 -e bench/data/edit-function.py qwen15; -D none
#   skips the draft model; -x adds FLAG to the speculative runs)
#
# Not in CI. Run it on an idle machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
t=2 n=600 r=3 draft=qwen05 edit=$here/data/edit-function.py extra=()
while getopts "t:n:r:D:e:x:" o; do
  case $o in
    t) t=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; D) draft=$OPTARG ;; e) edit=$OPTARG ;;
    x) extra+=("$OPTARG") ;; *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
model=${1:-qwen15}
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
path=$model
[ -f "$path" ] || path=$("$shoal" models fetch "$model" 2>/dev/null | tail -n1)
dpath=
if [ "$draft" != none ]; then
  dpath=$draft
  [ -f "$dpath" ] || dpath=$("$shoal" models fetch "$draft" 2>/dev/null | tail -n1)
fi
bin=${SHOAL_HOME:-$HOME/.cache/shoal}/llama.cpp-build/bin
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$here/edit-prompt.sh"
prompt=$(edit_prompt "$edit")
prompt+=$'\n'
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) (benchmark an idle machine); $(basename "$path"), $t threads, $n tokens, $(basename "$edit")${extra[*]:+, ${extra[*]}}"
rate() { sed -n 's/.*generation: \([0-9]*\) tokens, \([0-9.]*\) tok\/s.*/\2/p' "$1"; }
same=same
for i in $(seq "$r"); do
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" >"$work/plain.txt" 2>"$work/plain.err"
  "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" --lookup ${extra[@]+"${extra[@]}"} >"$work/lookup.txt" 2>"$work/lookup.err"
  cmp -s "$work/plain.txt" "$work/lookup.txt" || same=different
  printf "round %d: shoal %6.1f tok/s plain, %6.1f with --lookup (%.2fx), text %s; %s\n" "$i" \
    "$(rate "$work/plain.err")" "$(rate "$work/lookup.err")" \
    "$(python3 -c "import sys; print(float(sys.argv[2]) / float(sys.argv[1]))" "$(rate "$work/plain.err")" "$(rate "$work/lookup.err")")" \
    "$(cmp -s "$work/plain.txt" "$work/lookup.txt" && echo same || echo different)" \
    "$(grep '^speculation:' "$work/lookup.err" | sed 's/^speculation: //')"
  if [ -n "$dpath" ]; then
    "$shoal" run "$path" "$prompt" --raw --temp 0 -n "$n" -t "$t" --draft "$dpath" ${extra[@]+"${extra[@]}"} >"$work/draft.txt" 2>"$work/draft.err"
    cmp -s "$work/plain.txt" "$work/draft.txt" || same=different
    printf "         shoal %6.1f tok/s with --draft %s (%.2fx), text %s; %s\n" \
      "$(rate "$work/draft.err")" "$draft" \
      "$(python3 -c "import sys; print(float(sys.argv[2]) / float(sys.argv[1]))" "$(rate "$work/plain.err")" "$(rate "$work/draft.err")")" \
      "$(cmp -s "$work/plain.txt" "$work/draft.txt" && echo same || echo different)" \
      "$(grep '^speculation:' "$work/draft.err" | sed 's/^speculation: //')"
  fi
  if [ -x "$bin/llama-simple" ]; then
    "$bin/llama-simple" -m "$path" -n "$n" "$prompt" >"$work/ls.out" 2>"$work/ls.err" || true
    printf "         llama.cpp llama-simple: %s\n" "$(grep -o 'speed: [0-9.]* t/s' "$work/ls.err" | tail -n1)"
  fi
  if [ -x "$bin/llama-lookup" ]; then
    "$bin/llama-lookup" -m "$path" -p "$prompt" -n "$n" -t "$t" --temp 0 --spec-draft-n-max 8 \
      >"$work/ll.out" 2>"$work/ll.err" || true
    printf "         llama.cpp llama-lookup: %s; %s\n" \
      "$(grep -o 'speed: *[0-9.]* t/s' "$work/ll.err" | tail -n1)" \
      "$(grep -oE '(n_drafted|n_accept|accept) *= *[0-9.]+%?' "$work/ll.err" | tr -s ' \n' ' ')"
  fi
  if [ -n "$dpath" ] && [ -x "$bin/llama-speculative" ]; then
    "$bin/llama-speculative" -m "$path" -md "$dpath" -p "$prompt" -n "$n" -t "$t" --temp 0 \
      --spec-draft-n-max 8 >"$work/lsp.out" 2>"$work/lsp.err" || true
    printf "         llama.cpp llama-speculative -md %s: %s; %s\n" "$draft" \
      "$(grep -o 'speed: *[0-9.]* t/s' "$work/lsp.err" | tail -n1)" \
      "$(grep -oE '(n_drafted|n_accept|accept) *= *[0-9.]+%?' "$work/lsp.err" | tr -s ' \n' ' ')"
  fi
done
if [ "$same" = different ]; then
  echo "a speculative run's text differs from the plain run's" >&2
  exit 1
fi
