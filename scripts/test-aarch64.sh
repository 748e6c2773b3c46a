#!/usr/bin/env bash
# The engine's kernel tests built for arm64 and run under qemu user-mode emulation, once per
# CPU model: `max` (NEON with the 8-bit dot product: the `neondot` kernels, and `neon` and
# `portable` below them) and `cortex-a72` (the Raspberry Pi 4: NEON without `dotprod`, so
# feature detection must pick `neon`). Emulation checks results, not speed.
#
# Installs what it needs: the Rust target (rustup), the arm64 C cross compiler and qemu-user
# (Debian's packages, as root). `--setup` only installs, and exits non-zero when it cannot
# (`scripts/test.sh` then says the arm64 kernels went untested); without it, the tests run
# and any failure exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
setup() {
  rustup target list --installed | grep -qx "$target" || timeout 300 rustup target add "$target" || return 1
  if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
    timeout 300 apt-get update -qq || return 1
    apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
      qemu-user >/dev/null || return 1
  fi
}
if [ "${1:-}" = --setup ]; then
  setup
  exit
fi
setup || { echo "cannot install the arm64 target, cross compiler or qemu-user" >&2; exit 1; }

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
# the engine's unit tests (every kernel at every level against the reference) and the tiny
# models (whole forward passes against the f64 oracle, on the NEON kernels); not the GPU
# backend's, which need a Vulkan driver qemu-user has none of (they run on the host)
for cpu_isa in max:neondot cortex-a72:neon; do
  cpu=${cpu_isa%%:*}
  echo "== arm64 kernels under qemu -cpu $cpu (expects ${cpu_isa#*:})"
  SHOAL_EXPECT_ISA=${cpu_isa#*:} CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L /usr/aarch64-linux-gnu" \
    cargo test --release --target "$target" -p shoal-engine --lib --test tiny_models -- \
    --skip backend::gpu::
done
