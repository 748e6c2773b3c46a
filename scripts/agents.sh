#!/usr/bin/env bash
# Coding agents against `shoal serve`: installs the agents from their registries (npm
# @openai/codex, @anthropic-ai/claude-code, @qwen-code/qwen-code; PyPI aider-chat, into
# $SHOAL_HOME/agents, outside the clone), serves one model on 127.0.0.1, and runs each agent
# non-interactively with its default features on scripted tasks in a scratch git repository:
#   read  a tool call reads README.md; the answer must name the secret word in it
#   edit  greeting.txt must read "hello shoal" afterwards
# Each run is checked from outside: the agent's exit status, no protocol error in its output
# and no request the server refused (4xx/5xx in shoal's request counters), the answer or the
# file. Prints a table of agent x task with the time each took, and the share of prompt
# tokens each agent's requests took from the prefix cache after its first request.
#
# A cell's protocol checks (exit status, nothing refused, no API error) are required; its task
# check (answer or file) is required only for the cells in REQUIRED_TASKS (default none: the
# small models here do not do these tasks reliably, see the README). Exits non-zero when a
# required check fails.
#
#   scripts/agents.sh [--model KEY] [--agents codex,claude,qwen,aider] [--tasks read,edit]
#                     [--timeout S]
# Needs a release build and the fetched model.
set -euo pipefail
cd "$(dirname "$0")/.."
export SHOAL_HOME=${SHOAL_HOME:-$HOME/.cache/shoal}
MODEL=qwen05
AGENTS=codex,claude,qwen,aider
TASKS=read,edit
TIMEOUT=900
REQUIRED_TASKS=${REQUIRED_TASKS:-}
while [ $# -gt 0 ]; do
  case $1 in
    --model) MODEL=$2; shift 2 ;;
    --agents) AGENTS=$2; shift 2 ;;
    --tasks) TASKS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the comment atop $0)" >&2; exit 2 ;;
  esac
done

# the agents, pinned; installed once
CODEX=@openai/codex@0.171.0
CLAUDE=@anthropic-ai/claude-code@2.1.197
QWEN=@qwen-code/qwen-code@0.15.10
AIDER=aider-chat==0.86.1
TOOLS=$SHOAL_HOME/agents
mkdir -p "$TOOLS"
if [ ! -x "$TOOLS/node_modules/.bin/codex" ] || [ ! -x "$TOOLS/node_modules/.bin/claude" ] ||
  [ ! -x "$TOOLS/node_modules/.bin/qwen" ]; then
  (cd "$TOOLS" && { [ -f package.json ] || npm init -y >/dev/null; } &&
    npm install --no-audit --no-fund --loglevel=error "$CODEX" "$CLAUDE" "$QWEN" >/dev/null)
fi
if [[ ,$AGENTS, == *,aider,* ]] && [ ! -x "$TOOLS/aider-venv/bin/aider" ]; then
  python3 -m venv "$TOOLS/aider-venv"
  "$TOOLS/aider-venv/bin/pip" install --quiet --disable-pip-version-check "$AIDER"
fi

BIN=target/release/shoal
WORK=$(mktemp -d)
SERVER=
cleanup() {
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null
  # SHOAL_AGENTS_LOGS=DIR keeps each run's output and the server's log
  if [ -n "${SHOAL_AGENTS_LOGS:-}" ]; then
    mkdir -p "$SHOAL_AGENTS_LOGS" && cp "$WORK"/*.log "$WORK"/serve.err "$SHOAL_AGENTS_LOGS"/ 2>/dev/null
  fi
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

"$BIN" serve --model "$MODEL" --api 127.0.0.1:0 --ctx 32768 --data-dir "$WORK/data" \
  >"$WORK/serve.out" 2>"$WORK/serve.err" &
SERVER=$!
for _ in $(seq 1 600); do
  [ -s "$WORK/serve.out" ] && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.err" >&2; echo "shoal serve exited" >&2; exit 1; }
  sleep 0.2
done
API=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["api"])' "$WORK/serve.out")
URL=http://$API
echo "shoal serve: $MODEL at $URL"

# metric NAME: the sum of a counter's or gauge's samples for the model (0 when absent)
metric() {
  curl -s "$URL/metrics" | awk -v n="$1" '$1 ~ "^"n"\\{" && $1 ~ /model=/ {s += $2} END {print s+0}'
}
# refused: requests answered with a 4xx or 5xx so far
refused() {
  curl -s "$URL/metrics" |
    awk '$1 ~ /^shoal_http_requests_total\{/ && $1 ~ /status="[45]/ {s += $2} END {print s+0}'
}

# scratch: a new git repository with the task files
scratch() {
  local dir=$WORK/repo-$1
  rm -rf "$dir"
  mkdir -p "$dir"
  printf '# Demo project\n\nThe secret word is: pelican.\n' >"$dir/README.md"
  printf 'hello world\n' >"$dir/greeting.txt"
  git -C "$dir" init -q
  git -C "$dir" add -A
  git -C "$dir" -c user.email=agents@shoal.invalid -c user.name=agents commit -qm init
  echo "$dir"
}

prompt_of() {
  case $1 in
    read) echo "What is the secret word written in README.md? Read the file, then answer with the word only." ;;
    edit) echo "In greeting.txt, replace the word world with shoal, so the file reads: hello shoal" ;;
  esac
}

# run AGENT TASK DIR HOMEDIR OUT: runs the agent on the task in DIR, output to OUT
run() {
  local agent=$1 task=$2 dir=$3 home=$4 out=$5 prompt
  prompt=$(prompt_of "$task")
  (
    cd "$dir"
    export HOME=$home
    case $agent in
      codex)
        mkdir -p "$home/.codex"
        cat >"$home/.codex/config.toml" <<TOML
model = "$MODEL"
model_provider = "shoal"
check_for_update_on_startup = false
[model_providers.shoal]
name = "shoal"
base_url = "$URL/v1"
wire_api = "responses"
env_key = "SHOAL_API_KEY"
[analytics]
enabled = false
TOML
        SHOAL_API_KEY=none timeout "$TIMEOUT" "$TOOLS/node_modules/.bin/codex" exec \
          --skip-git-repo-check --sandbox workspace-write "$prompt" </dev/null
        ;;
      claude)
        ANTHROPIC_BASE_URL=$URL ANTHROPIC_API_KEY=none DISABLE_TELEMETRY=1 \
          DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
          ANTHROPIC_SMALL_FAST_MODEL=$MODEL ANTHROPIC_DEFAULT_HAIKU_MODEL=$MODEL \
          timeout "$TIMEOUT" "$TOOLS/node_modules/.bin/claude" -p --model "$MODEL" \
          --permission-mode acceptEdits "$prompt" </dev/null
        ;;
      qwen)
        mkdir -p "$home/.qwen"
        echo '{"privacy": {"usageStatisticsEnabled": false}, "telemetry": {"enabled": false}}' \
          >"$home/.qwen/settings.json"
        OPENAI_BASE_URL=$URL/v1 OPENAI_API_KEY=none OPENAI_MODEL=$MODEL \
          timeout "$TIMEOUT" "$TOOLS/node_modules/.bin/qwen" -p "$prompt" --auth-type openai \
          --approval-mode auto-edit </dev/null
        ;;
      aider)
        OPENAI_API_BASE=$URL/v1 OPENAI_API_KEY=none \
          timeout "$TIMEOUT" "$TOOLS/aider-venv/bin/aider" --model "openai/$MODEL" \
          --no-analytics --no-check-update --no-show-model-warnings --no-gitignore \
          --yes-always --no-auto-commits --no-stream --no-pretty \
          $([ "$task" = edit ] && echo greeting.txt || echo --read README.md) \
          --message "$prompt" </dev/null
        ;;
    esac
  ) >"$out" 2>&1
}

# check TASK DIR OUT: whether the task was done
check() {
  case $1 in
    read) grep -qi pelican "$3" ;;
    edit) [ "$(tr -d '\r' <"$2/greeting.txt" | sed 's/[[:space:]]*$//')" = "hello shoal" ] ;;
  esac
}

status=0
rows=()
for agent in ${AGENTS//,/ }; do
  prompt0=$(metric shoal_prompt_tokens_total)
  cached0=$(metric shoal_prompt_tokens_cached)
  first=
  cfirst=
  for task in ${TASKS//,/ }; do
    dir=$(scratch "$agent-$task")
    home=$WORK/home-$agent-$task
    mkdir -p "$home"
    out=$WORK/$agent-$task.log
    before=$(refused)
    t0=$(date +%s)
    rc=0
    run "$agent" "$task" "$dir" "$home" "$out" || rc=$?
    secs=$(($(date +%s) - t0))
    if [ -z "$first" ]; then
      first=$(metric shoal_prompt_tokens_total)
      cfirst=$(metric shoal_prompt_tokens_cached)
    fi
    nrefused=$(($(refused) - before))
    proto=pass
    why=
    if [ $rc -ne 0 ]; then proto=fail; why="exit $rc"; fi
    if [ "$nrefused" -gt 0 ]; then proto=fail; why="$why; $nrefused refused"; fi
    if grep -qiE 'API Error|invalid_request_error|unexpected status|stream disconnected|400 Bad Request' "$out"; then
      proto=fail; why="$why; protocol error in output"
    fi
    taskok=fail
    check "$task" "$dir" "$out" && taskok=pass
    required_task=no
    [[ ,$REQUIRED_TASKS, == *,$agent-$task,* ]] && required_task=yes
    rows+=("$(printf '%-7s %-5s %-6s %-5s %-4s %5ss  %s' "$agent" "$task" "$proto" "$taskok" "$required_task" "$secs" "${why#; }")")
    if [ "$proto" = fail ] || { [ "$required_task" = yes ] && [ "$taskok" = fail ]; }; then
      status=1
      echo "--- $agent $task: output (tail)"
      tail -15 "$out"
    fi
  done
  prompt1=$(metric shoal_prompt_tokens_total)
  cached1=$(metric shoal_prompt_tokens_cached)
  # the share of prompt tokens taken from the cache: over all the agent's requests, and over
  # those after its first task (the first request of an agent pays for its system prompt)
  share=$(python3 -c 'import sys; p0,c0,pf,cf,p1,c1=map(float,sys.argv[1:])
pct=lambda c,p: "%.1f%% of %d" % (100*c/p if p else 0, p)
print("all tasks %s, after the first task %s" % (pct(c1-c0,p1-p0), pct(c1-cf,p1-pf)))' \
    "$prompt0" "$cached0" "${first:-$prompt0}" "${cfirst:-$cached0}" "$prompt1" "$cached1")
  rows+=("$(printf '%-7s prompt tokens from the cache: %s' "$agent" "$share")")
done

echo
echo "agent   task  proto  task  req   time  notes"
printf '%s\n' "${rows[@]}"
if [ $status -ne 0 ]; then
  echo "--- shoal serve log (tail)"
  tail -20 "$WORK/serve.err"
fi
exit $status
