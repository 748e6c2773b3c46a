#!/usr/bin/env bash
# Prints llama.cpp's greedy tokens (JSON lines) for the given model and prompts: the golden
# data stored in crates/shoal/tests/golden.rs. Builds llama.cpp once (bench/llamacpp-build.sh).
#
#   bench/golden.sh MODEL.gguf N "prompt" ["prompt"...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$("$here/llamacpp-build.sh")
src=${SHOAL_HOME:-$HOME/.cache/shoal}/llama.cpp-src
exe=$bin/llamacpp-golden
if [ ! -x "$exe" ] || [ "$here/llamacpp-golden.c" -nt "$exe" ]; then
  cc -O2 -o "$exe" "$here/llamacpp-golden.c" -I "$src/include" -I "$src/ggml/include" \
    -L "$bin" -lllama -lggml -lggml-base -Wl,-rpath,"$bin"
fi
"$exe" "$@" 2>/dev/null
