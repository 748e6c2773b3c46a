#!/usr/bin/env python3
"""Prefix-cache share over a 10-turn agent conversation, on each API an agent uses.

Plays an agent's loop against a running `shoal serve`: a long system prompt and tools, then
turns that alternate a forced tool call (answered with the tool's output) and a text answer.
Every request sends the whole conversation again, with the model's earlier turns rebuilt the
way the agents rebuild them: tool calls as structured JSON (chat completions' `tool_calls`,
Anthropic's `tool_use` blocks, the Responses API's `function_call` items with `store: false`,
as the Codex CLI sends them) and text as returned. Prints each request's prompt tokens and
the tokens taken from the cache (from each response's usage), and the share over the
requests after the first.

`--rebuilt` gives the model's calls back under call ids of the client's own (as a client
that renumbers calls would): the server then cannot recognise its earlier turns and renders
them from the JSON, which is how every turn was rendered before the server kept its
generated turns. Run both to see the difference:

    bench/agent-turns.py --url http://127.0.0.1:7337 --model qwen05 [--api chat,messages,responses] [--rebuilt]
"""

import argparse
import json
import urllib.request

SYSTEM = (
    "You are a coding agent working in a small repository. Use the tools to read and write "
    "files; answer briefly.\n\n"
    + "\n".join(
        f"Rule {i}: keep changes small, explain them in one sentence, and never touch files "
        f"outside the repository (rule text {i} repeated to make the prompt long)."
        for i in range(60)
    )
)
TOOLS = [
    ("read_file", "Reads a file and returns its text.", {"path": {"type": "string"}}),
    ("write_file", "Writes text to a file.", {"path": {"type": "string"}, "text": {"type": "string"}}),
]
FILES = {f"src/part{i}.py": f"def part{i}():\n    return {i} * 2\n" for i in range(10)}


def post(url, body, headers=None):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def schema(props):
    return {"type": "object", "properties": props, "required": list(props)}


class Chat:
    """OpenAI chat completions (Qwen Code, aider)."""

    def __init__(self, a):
        self.a, self.msgs = a, [{"role": "system", "content": SYSTEM}]
        self.tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": schema(p)}} for n, d, p in TOOLS]

    def ask(self, text, force):
        self.msgs.append({"role": "user", "content": text})
        r = post(self.a.url + "/v1/chat/completions", {
            "model": self.a.model, "messages": self.msgs, "tools": self.tools, "temperature": 0,
            "max_tokens": 48, "tool_choice": "required" if force else "none"})
        m = r["choices"][0]["message"]
        calls = m.get("tool_calls") or []
        for n, c in enumerate(calls):
            c["id"] = renumber(self.a, c["id"], n)
        self.msgs.append({"role": "assistant", "content": m.get("content") or "", **({"tool_calls": calls} if calls else {})})
        for c in calls:
            self.msgs.append({"role": "tool", "tool_call_id": c["id"], "content": output(c["function"]["arguments"])})
        u = r["usage"]
        return u["prompt_tokens"], u.get("prompt_tokens_details", {}).get("cached_tokens", 0)


class Messages:
    """Anthropic messages (Claude Code)."""

    def __init__(self, a):
        self.a, self.msgs = a, []
        self.tools = [{"name": n, "description": d, "input_schema": schema(p)} for n, d, p in TOOLS]

    def ask(self, text, force):
        self.msgs.append({"role": "user", "content": [{"type": "text", "text": text}]})
        r = post(self.a.url + "/v1/messages", {
            "model": self.a.model, "system": [{"type": "text", "text": SYSTEM}], "messages": self.msgs,
            "tools": self.tools, "temperature": 0, "max_tokens": 48,
            "tool_choice": {"type": "any" if force else "none"}})
        content = r["content"]
        calls = [b for b in content if b["type"] == "tool_use"]
        for n, c in enumerate(calls):
            c["id"] = renumber(self.a, c["id"], n)
        self.msgs.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        if calls:
            self.msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"], "content": output(json.dumps(c["input"]))} for c in calls]})
        u = r["usage"]
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


class Responses:
    """OpenAI Responses with store: false and the whole history each time (Codex CLI)."""

    def __init__(self, a):
        self.a, self.items = a, []
        self.tools = [{"type": "function", "name": n, "description": d, "parameters": schema(p)} for n, d, p in TOOLS]

    def ask(self, text, force):
        self.items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        r = post(self.a.url + "/v1/responses", {
            "model": self.a.model, "instructions": SYSTEM, "input": self.items, "tools": self.tools,
            "store": False, "temperature": 0, "max_output_tokens": 48,
            "tool_choice": "required" if force else "none"})
        n = 0
        for item in r["output"]:
            item.pop("id", None)
            item.pop("status", None)
            if item["type"] == "function_call":
                item["call_id"] = renumber(self.a, item["call_id"], n)
                n += 1
            self.items.append(item)
            if item["type"] == "function_call":
                self.items.append({"type": "function_call_output", "call_id": item["call_id"], "output": output(item["arguments"])})
        u = r["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def renumber(a, call_id, n):
    a.calls += 1
    return f"client_{a.calls}_{n}" if a.rebuilt else call_id


def output(arguments):
    try:
        path = json.loads(arguments).get("path", "")
    except (ValueError, AttributeError):
        path = ""
    return FILES.get(path, f"no such file: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api", default="chat,messages,responses")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--rebuilt", action="store_true")
    a = p.parse_args()
    a.calls = 0
    kinds = {"chat": Chat, "messages": Messages, "responses": Responses}
    for name in a.api.split(","):
        agent = kinds[name](a)
        rows = []
        for t in range(a.turns):
            force = t % 2 == 0
            ask = f"Read src/part{t // 2}.py with read_file." if force else "What does that function return? One sentence."
            rows.append(agent.ask(ask, force))
        later = rows[1:]
        prompt, cached = sum(r[0] for r in later), sum(r[1] for r in later)
        per = " ".join(f"{c}/{p}" for p, c in rows)
        mode = "rebuilt ids" if a.rebuilt else "as answered"
        print(f"{name:9} {mode}: cached/prompt per turn: {per}")
        print(f"{name:9} {mode}: after the first turn {cached}/{prompt} prompt tokens from the cache = {100 * cached / max(prompt, 1):.1f}%")


if __name__ == "__main__":
    main()
