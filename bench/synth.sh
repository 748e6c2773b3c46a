#!/usr/bin/env bash
# Writes a synthetic GGUF into the model cache once and prints its path (the last line of
# stdout). The file has a real model's shapes, tensor names and quantization mix (Q4_K_M-like
# for the mixtures of experts, MXFP4 experts for gpt-oss, one i-quant throughout for the
# dense Mistral 7B files) with random weights (shoal_testkit::synth): engines read the same
# bytes per token as from the real model, so speed figures are real, but the text it
# generates is meaningless. 0.5-11 GB each; written as NAME.gguf.tmp and renamed when
# complete.
#
#   bench/synth.sh SHAPE      # e.g. qwen3-30b-a3b(-24l), deepseek-v2-lite, mixtral-8x7b(-8l),
#                             # gpt-oss-120b(-4l), mistral-7b-8l-iq1_s (-iq2_xxs, -iq3_s, -iq4_xs)
#   bench/synth.sh --list     # the shapes, their sizes and weight bytes per token
#
# The file: ${SHOAL_MODELS_DIR:-$SHOAL_HOME/models (default ~/.cache/shoal/models)}/synth/
# SHAPE.gguf (SHAPE as --list names it). Builds target/release/synth-gguf if it is missing.
# Not run in CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
[ $# -eq 1 ] || { echo "usage: $0 SHAPE | --list" >&2; exit 2; }
synth=$root/target/release/synth-gguf
[ -x "$synth" ] || (cd "$root" && cargo build --release -p shoal-testkit --bin synth-gguf >&2)
if [ "$1" = --list ]; then
  exec "$synth" --list
fi
shape=$("$synth" --canonical "$1")
home=${SHOAL_HOME:-$HOME/.cache/shoal}
dir=${SHOAL_MODELS_DIR:-$home/models}/synth
out=$dir/$shape.gguf
if [ ! -f "$out" ]; then
  mkdir -p "$dir"
  "$synth" "$shape" "$out" >&2
fi
echo "$out"
