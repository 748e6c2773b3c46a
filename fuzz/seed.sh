#!/bin/sh
# Writes the seed corpus for the gguf_header target: a few small valid GGUF files made by
# shoal-testkit (a few hundred bytes each), into fuzz/corpus/gguf_header (git-ignored).
# Then, from the repository root (nightly toolchain; or RUSTC_BOOTSTRAP=1 with stable):
#   cargo +nightly fuzz run -s none gguf_header -- -max_total_time=180 -max_len=4096
# `-s none`: the reader is safe Rust, so no sanitizer is needed; panics, overflows (debug
# assertions are on) and oversized allocations (the target's allocator aborts) are crashes.
set -eu
cd "$(dirname "$0")"
cargo run --quiet --bin gguf_seeds -- corpus/gguf_header
