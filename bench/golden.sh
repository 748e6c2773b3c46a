#!/usr/bin/env bash
# Writes the golden data of crates/shoal-engine/tests/golden.rs to stdout: for each demo
# model and prompt, llama.cpp's prompt tokens (tokenized as `shoal run --raw` does), its
# first N greedy tokens, and its top 8 logits after the prompt and after each of those
# tokens (teacher-forced: every step conditions on llama.cpp's own tokens). llama.cpp is the
# test kit's oracle (scripts/build-llama-oracle.sh: F32 KV cache, no flash attention, one
# thread). Not run in CI; the output is committed as tests/data/golden.json.
#
#   bench/golden.sh [N] > crates/shoal-engine/tests/data/golden.json
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-32}
oracle=$(scripts/build-llama-oracle.sh)
shoal=target/release/shoal
[ -x "$shoal" ] || cargo build --release -p shoal >&2
prompts=("The capital of France is" "def fibonacci(n):" "Once upon a time, there was a little"
  "The three primary colors are")
models=$("$shoal" models list --json)
{
  for key in smollm2 qwen05 gemma3; do
    path=$(python3 -c 'import json,sys; m=[x for x in json.load(sys.stdin) if x["key"]==sys.argv[1]][0]
assert m["cached"], sys.argv[1] + " is not fetched (shoal models fetch " + sys.argv[1] + ")"
print(m["path"])' "$key" <<<"$models")
    for p in "${prompts[@]}"; do
      printf '%s\t%s\t' "$key" "$p"
      "$oracle" "$path" --raw-text "$p" --generate "$n" --top 8 --kv-f16
    done
  done
} | python3 -c '
import json, sys
out = {}
for line in sys.stdin:
    key, prompt, run = line.rstrip("\n").split("\t", 2)
    r = json.loads(run)
    out.setdefault(key, []).append({
        "prompt": prompt, "prompt_ids": r["ids"], "ids": r["generated"], "steps": r["steps"],
    })
out["about"] = ("llama.cpp (scripts/build-llama-oracle.sh: F16 KV cache, no flash attention, "
                "1 thread), bench/golden.sh " + sys.argv[1])
print(json.dumps(out, separators=(",", ":")))
' "$n"
