#!/usr/bin/env bash
# Coding agents against `shoal serve`: installs the agents from their registries (npm
# @openai/codex, @anthropic-ai/claude-code, @qwen-code/qwen-code; PyPI aider-chat, into
# $SHOAL_HOME/agents, outside the clone), serves the models on 127.0.0.1, and runs each agent
# non-interactively with its default features on scripted tasks in a scratch git repository:
#   read  a tool call reads README.md; the answer must name the secret word in it
#   edit  greeting.txt must read "hello shoal" afterwards
# Each run is checked from outside: the agent's exit status, no protocol error in its output
# and no request the server refused (4xx/5xx in shoal's request counters), the answer or the
# file. An agent still working when its time is up (--timeout) fails its task, not the
# protocol, if shoal's counters of answered requests and prompt and generated tokens moved
# in the last PROGRESS_WINDOW seconds (default 300) before; an agent left waiting on a
# server that had stopped answering fails the protocol. Prints a table of agent x task with the time each took, and the share of prompt
# tokens each agent's requests took from the prefix cache (over all its requests, and over
# those after its first task: each task is a new session in the same project).
#
# Each agent runs on the smallest fetched model that does its tasks (MODELS, default aider on
# qwen15, the others on qwen05: no model fetched here does the tasks through the Codex CLI,
# Claude Code or Qwen Code, and qwen05 is the fastest). A cell's protocol checks are always
# required; its task check only for the cells in REQUIRED_TASKS (default: aider's two).
# Exits non-zero when a required check fails.
#
# `--server llama` runs the same agents and models against llama.cpp's llama-server (built by
# bench/llamacpp-build.sh, one server per model, `--jinja`) instead, to tell a model's
# failure from shoal's: a task that fails the same way there is the model's.
#
#   scripts/agents.sh [--agents codex,claude,qwen,aider] [--tasks read,edit]
#                     [--models codex=qwen05,claude=qwen05,qwen=qwen05,aider=qwen15]
#                     [--server shoal|llama] [--timeout S]
# (CTX=N in the environment: the context each model is served with, default 32768)
# Needs a release build and the fetched models.
set -euo pipefail
cd "$(dirname "$0")/.."
export SHOAL_HOME=${SHOAL_HOME:-$HOME/.cache/shoal}
AGENTS=codex,claude,qwen,aider
TASKS=read,edit
MODELS=codex=qwen05,claude=qwen05,qwen=qwen05,aider=qwen15
SERVER_KIND=shoal
TIMEOUT=900
# the context the server gives each model (CTX in the environment; default 32768). Codex is
# told it, so that it compacts its conversation at three quarters of it: it knows no window of
# a model it has no metadata for.
CTX=${CTX:-32768}
PROGRESS_WINDOW=${PROGRESS_WINDOW:-300}
REQUIRED_TASKS=${REQUIRED_TASKS-aider-read,aider-edit}
while [ $# -gt 0 ]; do
  case $1 in
    --agents) AGENTS=$2; shift 2 ;;
    --tasks) TASKS=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --server) SERVER_KIND=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the comment atop $0)" >&2; exit 2 ;;
  esac
done
# model_of AGENT: the model the agent runs on
model_of() {
  local pair
  for pair in ${MODELS//,/ }; do
    [ "${pair%%=*}" = "$1" ] && { echo "${pair#*=}"; return; }
  done
  echo qwen05
}

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
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  # SHOAL_AGENTS_LOGS=DIR keeps each run's output and the server's log
  if [ -n "${SHOAL_AGENTS_LOGS:-}" ]; then
    mkdir -p "$SHOAL_AGENTS_LOGS" && cp "$WORK"/*.log "$WORK"/*.err "$SHOAL_AGENTS_LOGS"/ 2>/dev/null
  fi
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# wait_ready PID FILE: waits until FILE has a line or the process exits
wait_ready() {
  for _ in $(seq 1 900); do
    [ -s "$2" ] && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

declare -A URLS
used_models=$(for a in ${AGENTS//,/ }; do model_of "$a"; done | sort -u)
if [ "$SERVER_KIND" = shoal ]; then
  args=()
  for m in $used_models; do args+=(--model "$m"); done
  "$BIN" serve "${args[@]}" --api 127.0.0.1:0 --ctx "$CTX" --data-dir "$WORK/data" \
    >"$WORK/serve.out" 2>"$WORK/serve.err" &
  PIDS+=($!)
  wait_ready "${PIDS[-1]}" "$WORK/serve.out" || { tail "$WORK/serve.err" >&2; echo "shoal serve did not start" >&2; exit 1; }
  api=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["api"])' "$WORK/serve.out")
  for m in $used_models; do URLS[$m]=http://$api; done
elif [ "$SERVER_KIND" = llama ]; then
  LLAMA_BIN=$(bench/llamacpp-build.sh)/llama-server
  port=18400
  for m in $used_models; do
    path=$("$BIN" models list --json | python3 -c 'import json,sys; print(next(x["path"] for x in json.load(sys.stdin) if x["key"] == sys.argv[1]))' "$m")
    port=$((port + 1))
    "$LLAMA_BIN" -m "$path" --alias "$m" --jinja --host 127.0.0.1 --port "$port" --ctx-size "$CTX" \
      --threads "$(nproc)" >"$WORK/llama-$m.err" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 600); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
      sleep 0.2
    done
    URLS[$m]=http://127.0.0.1:$port
  done
else
  echo "--server is shoal or llama" >&2
  exit 2
fi
for m in $used_models; do echo "$SERVER_KIND: $m at ${URLS[$m]}"; done

# metric NAME: the sum of shoal's samples of a counter or gauge for MODEL at URL (0 when
# absent, and from llama-server)
metric() {
  curl -s "$URL/metrics" | awk -v n="$1" -v m="model=\"$MODEL\"" '$1 ~ "^"n"\\{" && index($1, m) {s += $2} END {print s+0}'
}
# refused: requests shoal answered with a 4xx or 5xx so far, less those whose prompt did not
# fit the context (a limit the agents handle, by compacting their conversation, not a fault)
refused() {
  curl -s "$URL/metrics" |
    awk '$1 ~ /^shoal_http_requests_total\{/ && $1 ~ /status="[45]/ {s += $2}
         $1 ~ /^shoal_prompts_too_long_total\{/ {s -= $2} END {print s+0}'
}

# work_done: the sum of shoal's counters that move while it serves (answered requests, prompt
# and generated tokens); 0 from llama-server
work_done() {
  curl -s "$URL/metrics" |
    awk '$1 ~ /^shoal_(http_requests_total|prompt_tokens_total|generated_tokens_total)\{/ {s += $2}
         END {print s+0}'
}

# watch_progress FILE: every 5 s, writes the time (epoch seconds) to FILE when work_done has
# moved since the last look; runs until killed (the caller writes FILE's first time)
watch_progress() {
  local last now
  last=$(work_done)
  while sleep 5; do
    now=$(work_done)
    if [ "$now" != "$last" ]; then
      date +%s >"$1"
      last=$now
    fi
  done
}

# scratch AGENT: the agent's project, a git repository with the task files, made anew for
# each task at the same path (the agents write the project's path into their system prompts:
# each task is a new session in the same project)
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
model_context_window = $CTX
model_auto_compact_token_limit = $((CTX * 3 / 4))
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
  MODEL=$(model_of "$agent")
  URL=${URLS[$MODEL]}
  prompt0=$(metric shoal_prompt_tokens_total)
  cached0=$(metric shoal_prompt_tokens_cached)
  first=
  cfirst=
  for task in ${TASKS//,/ }; do
    dir=$(scratch "$agent")
    home=$WORK/home-$agent
    mkdir -p "$home"
    out=$WORK/$agent-$task.log
    before=$(refused)
    t0=$(date +%s)
    rc=0
    date +%s >"$WORK/progress"
    watch_progress "$WORK/progress" &
    watcher=$!
    run "$agent" "$task" "$dir" "$home" "$out" || rc=$?
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    secs=$(($(date +%s) - t0))
    idle=$(($(date +%s) - $(cat "$WORK/progress")))
    if [ -z "$first" ]; then
      first=$(metric shoal_prompt_tokens_total)
      cfirst=$(metric shoal_prompt_tokens_cached)
    fi
    nrefused=$(($(refused) - before))
    proto=pass
    why=
    if [ $rc -eq 124 ] && [ "$idle" -le "$PROGRESS_WINDOW" ]; then
      why="timed out, still working: the server's last answer or token ${idle}s before the end"
    elif [ $rc -eq 124 ]; then
      proto=fail
      why="timed out waiting: nothing from the server in the last ${idle}s"
    elif [ $rc -ne 0 ]; then
      proto=fail
      why="exit $rc"
    fi
    if [ "$nrefused" -gt 0 ]; then proto=fail; why="$why; $nrefused refused"; fi
    if grep -qiE 'API Error|invalid_request_error|unexpected status|stream disconnected|400 Bad Request' "$out"; then
      proto=fail; why="$why; protocol error in output"
    fi
    taskok=fail
    check "$task" "$dir" "$out" && taskok=pass
    required_task=no
    [[ ,$REQUIRED_TASKS, == *,$agent-$task,* ]] && required_task=yes
    rows+=("$(printf '%-7s %-7s %-5s %-6s %-5s %-4s %5ss  %s' "$agent" "$MODEL" "$task" "$proto" "$taskok" "$required_task" "$secs" "${why#; }")")
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
  # (llama-server has no such counters)
  if [ "$SERVER_KIND" = shoal ]; then
    rows+=("$(printf '%-7s prompt tokens from the cache: %s' "$agent" "$share")")
  fi
done

echo
echo "agent   model   task  proto  task  req   time  notes"
printf '%s\n' "${rows[@]}"
if [ $status -ne 0 ]; then
  echo "--- server log (tail)"
  tail -20 "$WORK"/*.err
fi
exit $status
