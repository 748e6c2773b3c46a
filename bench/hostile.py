#!/usr/bin/env python3
"""Hostile but bounded API clients against one `shoal serve` on 127.0.0.1: prints a table of
probe, what came back, and whether that is what a server should answer.

Starts the server itself (`--bin`, default target/release/shoal) with smollm2 and no keys,
runs the probes a keyless node must withstand, creates an administrator key and two user
keys from the node's own machine, then runs the probes of a keyed node. Every probe sends a
bounded number of requests to 127.0.0.1 only. The flood of /health is bench/hostile-flood.sh.

    bench/hostile.py [--bin target/release/shoal]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def call(url, path, body=None, key=None, headers=None, method=None, raw=None, timeout=60):
    h = {"content-type": "application/json", **(headers or {})}
    if key:
        h["authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers=h, method=method)
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}, time.monotonic() - t
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}, time.monotonic() - t
    except Exception as e:  # a timeout or a reset is an answer too
        return type(e).__name__, b"", {}, time.monotonic() - t


ROWS = []


def row(probe, got, ok):
    ROWS.append((probe, got, "yes" if ok else "NO"))


def chat(model="smollm2", **extra):
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}


def keyless(url, host_port):
    s, b, _, _ = call(url, "/v1/chat/completions", chat(stop=[f"s{i}" for i in range(17)]))
    row("17 stop strings (chat)", s, s == 400)
    s, b, _, _ = call(url, "/v1/messages", chat(stop_sequences=["x" * 300]))
    row("a 300-byte stop string (messages)", s, s == 400)
    schema = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    s, b, _, _ = call(url, "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    row("recursive $ref schema", f"{s}, {len(b)} bytes", s == 400 and b"<state>" not in b and len(b) < 1000)
    s, b, _, _ = call(url, "/v1/chat/completions", chat(model="m" * (1 << 20)))
    row("1 MB model name", f"{s}, {len(b)} bytes", s == 404 and len(b) < 2048)
    s, b, h, _ = call(url, "/")
    csp = h.get("content-security-policy", "")
    row("dashboard framing headers", "CSP+XFO" if "frame-ancestors" in csp and h.get("x-frame-options") else "none", "frame-ancestors" in csp)
    s, b, _, _ = call(url, "/cluster/drain", {"node": "x"}, headers={"origin": "http://evil.example"})
    row("drain from another site's page", s, s == 403)
    made = None
    s, b, _, _ = call(url, "/admin/keys", {"name": "x", "admin": True}, headers={"host": f"evil.example:{host_port}"})
    row("create a key by a rebound name", s, s == 403)
    if s == 201:
        made = json.loads(b)["secret"]
    s, b, _, _ = call(url, "/admin/keys", raw=b'{"name": "x", "admin": true}', headers={"content-type": "text/plain"})
    row("create a key with a text/plain body", s, s == 415)
    if s == 201 and made is None:
        made = json.loads(b)["secret"]
    return made


def keyed(url, admin, alice, bob):
    s, b, _, _ = call(url, "/v1/responses", {"model": "smollm2", "input": "my secret is 42", "max_output_tokens": 2}, key=alice)
    rid = json.loads(b)["id"] if s == 200 else "none"
    s, b, _, _ = call(url, "/v1/responses", {"model": "smollm2", "input": "what is it?", "previous_response_id": rid, "max_output_tokens": 2}, key=bob)
    row("continue another key's response", s, s == 404)
    s, b, _, _ = call(url, "/cluster/doctor", key=alice)
    row("cluster view with a user key", s, s == 403)
    # no key, a body that never ends: the answer must come before the body
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 4000000\r\n\r\n{\"model\": ")
        c.settimeout(5)
        try:
            first = c.recv(64).decode(errors="replace").split("\r\n")[0]
        except socket.timeout:
            first = "no answer in 5 s"
    row("no key, a body that never ends", first, "401" in first)
    # many empty calls in one stored response
    items = [{"type": "function_call", "call_id": f"c{i}", "name": "", "arguments": "{}"} for i in range(20000)]
    s, b, _, took = call(url, "/v1/responses", {"model": "smollm2", "input": items + [{"role": "user", "content": "hi"}], "max_output_tokens": 1}, key=alice, timeout=120)
    row("20k empty calls in a stored response", f"{s} in {took:.1f} s", s in (200, 400))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/release/shoal")
    a = p.parse_args()
    work = tempfile.mkdtemp()
    srv = subprocess.Popen([a.bin, "serve", "--model", "smollm2", "--api", "127.0.0.1:0", "--data-dir", work],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        api = json.loads(srv.stdout.readline())["api"]
        url = f"http://{api}"
        # an administrator key, unless a probe above already made one
        admin = keyless(url, api.split(":")[1])
        if admin is None:
            admin = json.loads(call(url, "/admin/keys", {"name": "ops", "admin": True})[1])["secret"]
        alice = json.loads(call(url, "/admin/keys", {"name": "alice"}, key=admin)[1])["secret"]
        bob = json.loads(call(url, "/admin/keys", {"name": "bob"}, key=admin)[1])["secret"]
        keyed(url, admin, alice, bob)
        rss = int(next(l.split()[1] for l in open(f"/proc/{srv.pid}/status") if l.startswith("VmRSS")))
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    w = max(len(r[0]) for r in ROWS)
    print(f"{'probe':{w}}  {'answer':28}  as it should")
    for probe, got, ok in ROWS:
        print(f"{probe:{w}}  {str(got):28}  {ok}")
    print(f"server resident memory at the end: {rss // 1024} MB")
    sys.exit(0 if all(r[2] == "yes" for r in ROWS) else 1)


if __name__ == "__main__":
    main()
