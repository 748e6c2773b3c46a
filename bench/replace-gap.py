#!/usr/bin/env python3
"""The gap a stream sees when a node of its split instance dies, for a model of any size.

Each round starts three loopback `shoal serve` nodes (a, b, c), each offering at most 3/4 of
the model file's size and 512 MiB, so that no node holds the model alone. It places the model
with
`--strategy tensor --nodes a,b` (or `--strategy pipeline --nodes a,b,c`), asked at c, which
then offers the whole file (the others fetch their slices from it), and streams one greedy
completion of TOKENS tokens from the lead, uninterrupted, then the same again, killing the
placement's last node other than the lead and c when 40% of the first one's time has
passed. The
instance is placed again on the survivors (and c, for the tensor split), the lead picks the
request up again, and the stream ends. Per round it prints the gap: how much longer the
second stream took than the first (the time the cluster took to notice the death, place the
instance again, load the new shares and go on; measured by the whole stream, not between
two chunks, because a synthetic file's tokens mostly have no text and send no chunk),
whether its text equals the first one's, and, where the build counts them, the layers the
survivors kept loaded from the old placement (`shoal_shard_layers_kept_total`).

With --before BIN (another build of shoal), each round runs once with this build and once
with BIN, the order flipping every round. The rule, set before any run: the figure is the
ratio of the two builds' median gaps (this build's over BIN's), and every stream must end
with the uninterrupted text with either build.

    bench/replace-gap.py MODEL.gguf [--strategy tensor|pipeline] [--rounds 10] [--before BIN]

The model file is linked into a home of its own under ~/.cache/shoal/bench-replace-gap. Not
in CI; run it on an idle machine (the gap includes loading shares, which competes with
anything else running).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The lighthouse keeper opened the logbook and wrote"


def run(binary, *args, timeout=900):
    """`shoal ARGS`: stdout, or an exception saying what failed."""
    p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"shoal {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


class Node:
    """A `shoal serve` process."""

    def __init__(self, binary, work, name, secret, home, cap, peer=None):
        self.name = name
        log = open(os.path.join(work, f"{name}.log"), "a")
        cmd = [binary, "serve", "--api", "127.0.0.1:0", "--listen", "127.0.0.1:0",
               "-t", "1", "--name", name, "--max-memory", cap, "--no-mdns",
               "--secret-file", secret, "--data-dir", os.path.join(work, name)]
        if peer:
            cmd += ["--peer", peer]
        env = dict(os.environ, SHOAL_HOME=home, SHOAL_LOG="info")
        env.pop("SHOAL_SECRET", None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        ready = json.loads(self.proc.stdout.readline())
        self.url = "http://" + ready["api"]
        self.listen = ready["listen"]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def wait_until(what, seconds, f):
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            v = f()
            if v:
                return v
        except Exception:  # noqa: BLE001 - a node not answering yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def layers_kept(url, model):
    """The node's `shoal_shard_layers_kept_total` for `model` (0 where the build lacks it)."""
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    except Exception:  # noqa: BLE001 - a killed node
        return 0
    series = f'shoal_shard_layers_kept_total{{model="{model}"}} '
    for line in text.splitlines():
        if line.startswith(series):
            return int(float(line[len(series):]))
    return 0


def stream(url, model, tokens):
    """A greedy streamed completion: (text, seconds it took, finish reason or error)."""
    body = json.dumps({"model": model, "prompt": PROMPT, "temperature": 0,
                       "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    text, finish, t0 = "", None, time.time()
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            v = json.loads(data)
            if "error" in v:
                return text, time.time() - t0, f"error: {v['error']}"
            choice = v["choices"][0]
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return text, time.time() - t0, finish


def one_round(binary, label, model_file, args):
    """Places the model on a fresh cluster, kills a node mid-stream: the round's figures."""
    home = args.home
    model = os.path.splitext(os.path.basename(model_file))[0]
    cap = str(int(os.path.getsize(model_file) * 0.75) + (512 << 20))
    work = tempfile.mkdtemp(prefix="replace-gap-")
    nodes = []
    try:
        secret = os.path.join(work, "secret")
        with open(secret, "w") as f:
            f.write(run(binary, "secret"))
        os.chmod(secret, 0o600)
        nodes.append(Node(binary, work, "a", secret, home, cap))
        for n in ["b", "c"]:
            nodes.append(Node(binary, work, n, secret, home, cap, nodes[0].listen))
        for n in nodes:
            wait_until("the nodes to agree", 60, lambda n=n: sum(
                1 for x in json.loads(run(binary, "nodes", "--json", "--url", n.url))
                if x.get("alive")) == 3)
        # asked at c, which then offers the whole file: a and b fetch their slices from it,
        # and c (which the tensor split leaves out) loads the dead node's share from it
        on = "a,b" if args.strategy == "tensor" else "a,b,c"
        t0 = time.time()
        inst = json.loads(run(binary, "load", args.link, "--id", model,
                              "--strategy", args.strategy, "--nodes", on, "--ctx", "512",
                              "--json", "--url", nodes[2].url))
        loaded = time.time() - t0
        lead = "http://" + inst["api"]
        names = {n.name: n for n in nodes}
        victim = next((names[n] for n in reversed(inst["nodes"])
                       if names[n].url != lead and n != "c"), None)
        if victim is None:
            raise RuntimeError(f"no node of {inst['placement']} but its lead and c")
        want, plain, finish = stream(lead, model, args.tokens)
        if finish != "length":
            raise RuntimeError(f"the uninterrupted stream ended with {finish}")
        killer = threading.Timer(plain * 0.4, victim.kill)
        killer.start()
        text, took, finish = stream(lead, model, args.tokens)
        killer.join()
        after = wait_until("the instance placed again", 300, lambda: next(
            (i for i in json.loads(run(binary, "ps", "--json", "--url", lead))
             if i["id"] == model and i["state"] == "ready"
             and i["generation"] > inst["generation"]), None))
        kept = sum(layers_kept(n.url, model) for n in nodes if n is not victim)
        return {
            "build": label, "gap_s": took - plain, "same": text == want and finish == "length",
            "finish": finish, "load_s": loaded, "layers_kept": kept,
            "before": inst["placement"], "after": after["placement"],
        }
    finally:
        for n in nodes:
            n.kill()
        if args.keep_logs:
            print(f"logs in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--strategy", choices=["tensor", "pipeline"], default="tensor")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--before")
    ap.add_argument("--keep-logs", action="store_true", help="keep each round's node logs")
    args = ap.parse_args()
    model_file = os.path.abspath(args.model)
    after_bin = os.path.join(ROOT, "target", "release", "shoal")
    subprocess.run(["cargo", "build", "--release", "-p", "shoal", "-q"], cwd=ROOT, check=True)
    work_bins = tempfile.mkdtemp(prefix="replace-gap-bins-")
    builds = [("this", shutil.copy(after_bin, os.path.join(work_bins, "shoal-this")))]
    if args.before:
        builds.append(("before", shutil.copy(args.before, os.path.join(work_bins, "shoal-before"))))
    # the model in a home of its own, where its checksum is kept between runs
    args.home = os.path.join(os.path.expanduser("~/.cache/shoal/bench-replace-gap"),
                             os.path.splitext(os.path.basename(model_file))[0])
    models = os.path.join(args.home, "models")
    os.makedirs(models, exist_ok=True)
    link = args.link = os.path.join(models, os.path.basename(model_file))
    if not os.path.exists(link):
        try:
            os.link(model_file, link)
        except OSError:
            os.symlink(model_file, link)
    print(f"load: {' '.join(open('/proc/loadavg').read().split()[:3])} (run on an idle machine); "
          f"{os.path.basename(model_file)} ({os.path.getsize(model_file) / 1e9:.2f} GB), "
          f"{args.strategy}, {args.tokens} tokens", flush=True)
    results = []
    for r in range(1, args.rounds + 1):
        order = builds if r % 2 == 1 else builds[::-1]
        for label, binary in order:
            res = one_round(binary, label, model_file, args)
            results.append(res)
            print(f"round {r} {label}: gap {res['gap_s'] * 1000:.0f} ms, text "
                  f"{'same' if res['same'] else 'DIFFERENT (' + str(res['finish']) + ')'}, "
                  f"layers kept {res['layers_kept']}, load {res['load_s']:.1f} s, "
                  f"{res['before']} -> {res['after']}", flush=True)
    medians = {}
    for label, _ in builds:
        gaps = [x["gap_s"] * 1000 for x in results if x["build"] == label]
        medians[label] = statistics.median(gaps)
        print(f"{label}: median gap {medians[label]:.0f} ms, max {max(gaps):.0f} ms over "
              f"{len(gaps)} kills")
    if args.before:
        print(f"this / before, median gap: {medians['this'] / medians['before']:.2f}")
    shutil.rmtree(work_bins, ignore_errors=True)
    if not all(x["same"] for x in results):
        print("FAILED: a stream did not end with the uninterrupted text", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
