#!/usr/bin/env bash
# Builds the correctness oracle: a minimal CPU-only llama.cpp (the `llama` library and ggml,
# nothing else) and, against it, crates/shoal-testkit/scripts/llama_logits.cpp, once, cached
# outside the clone in $SHOAL_HOME/llama-oracle (default ~/.cache/shoal). Prints the path of
# the oracle binary; the test kit runs it when SHOAL_LLAMA_LOGITS_BIN names it.
#
#   SHOAL_LLAMA_LOGITS_BIN=$(scripts/build-llama-oracle.sh) cargo test -p shoal-testkit
#
# The library is rebuilt only when it is missing or the stamp of its configuration (cmake
# flags, llama.cpp source version, CPU feature list) differs; the oracle program is
# recompiled when the sha256 of its source, compile command or library stamp differs. A cold
# build takes about a minute and a half on 2 cores; a cached run well under a second. The
# compiler's output goes to $SHOAL_HOME/llama-oracle/build.log (its tail is shown on failure).
#
# Needs a C/C++ compiler and cmake; as root with apt-get, installs cmake when it is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
home=${SHOAL_HOME:-$HOME/.cache/shoal}
out=$home/llama-oracle
build=$out/build
src=$("$root/scripts/fetch-llamacpp-src.sh")
oracle_src=$root/crates/shoal-testkit/scripts/llama_logits.cpp

if ! command -v cmake >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing cmake (apt-get)" >&2
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends cmake >/dev/null; } >&2
  fi
  command -v cmake >/dev/null || { echo "cmake is missing: apt-get install cmake" >&2; exit 1; }
fi
cxx=${CXX:-$(command -v c++ || command -v g++ || true)}
[ -n "$cxx" ] || { echo "no C++ compiler: apt-get install g++" >&2; exit 1; }

# -march=native (GGML_NATIVE) turns on ggml's AMX matmul where the CPU lists AMX. On the
# Xeon VMs here that path dies of SIGILL at its first `tilezero`: ggml loads the tile
# config once per thread and the VM does not keep it. So AMX stays off, as in
# bench/llamacpp-build.sh; everything else stays native.
cflags=
[ "$(uname -m)" = x86_64 ] && cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# Only the library: no common/, tools, examples, tests, server or app (LLAMA_CURL is gone
# from this llama.cpp; passing it only prints a deprecation warning).
cmake_args=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags"
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF
)
# A native build only runs on the CPU it was built for, so the CPU's feature list is part
# of the stamp: a cache carried to another machine is rebuilt rather than dying of SIGILL.
cpu=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-16)
src_version=$(grep -m1 '^version=' "$root/scripts/fetch-llamacpp-src.sh")
lib_stamp="${cmake_args[*]} $src_version cpu=$cpu"

if [ ! -f "$build/bin/libllama.so" ] || [ "$(cat "$out/lib-stamp" 2>/dev/null)" != "$lib_stamp" ]; then
  rm -f "$out/lib-stamp"
  start=$(date +%s)
  echo "building llama.cpp's library for the oracle in $build (minutes, once)" >&2
  mkdir -p "$out"
  if ! { cmake -S "$src" -B "$build" "${cmake_args[@]}" &&
    nice -n 10 cmake --build "$build" --config Release -j "$(nproc)" --target llama; } \
    >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log" >&2
    echo "building llama.cpp's library failed (log: $out/build.log)" >&2
    exit 1
  fi
  echo "$lib_stamp" >"$out/lib-stamp"
  echo "llama.cpp library built in $(($(date +%s) - start)) s" >&2
fi

bin=$out/llama_logits
compile=("$cxx" -O2 -std=c++17 "$oracle_src" -I"$src/include" -I"$src/ggml/include"
  -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$bin")
want=$({ sha256sum <"$oracle_src"; echo "${compile[*]}"; cat "$out/lib-stamp"; } | sha256sum | cut -d' ' -f1)
if [ ! -x "$bin" ] || [ "$(cat "$out/oracle-stamp" 2>/dev/null)" != "$want" ]; then
  rm -f "$out/oracle-stamp"
  nice -n 10 "${compile[@]}" >&2
  echo "$want" >"$out/oracle-stamp"
fi
echo "$bin"
