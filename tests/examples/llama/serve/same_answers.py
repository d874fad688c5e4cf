#!/usr/bin/env python3
"""same_answers.py LAUNCH... -- SERVE...

Starts the server SERVE twice on free local ports: once alone with --tp 1 --pp 1 (the oracle, on
the machine that runs the test), once as LAUNCH SERVE (e.g. mpirun -n 2 llama-serve ...: the
ranks are then mpirun's processes). Asks both for the same greedy completions and fails unless
the answers are equal and the second server reports several ranks (tp N, pp P). Each server is then stopped with
SIGTERM and must end by itself within the time limit (no rank left hanging), saying that it
stopped after the requests and printing no error; the server alone must exit 0 (mpirun exits 1
whenever it is itself signalled, however its processes ended).
"""
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

LIMIT_S = 40
PROMPTS = ["Once upon a time", "hello", "1 2 3 4"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd):
    port = free_port()
    p = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + LIMIT_S
    for line in p.stdout:
        seen.append(line)
        if "listening on http://" in line:
            return p, port, "".join(seen)
        if time.time() > deadline:
            break
    p.kill()
    sys.exit("server did not start: " + " ".join(cmd) + "\n" + "".join(seen) + p.stdout.read())


def complete(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=LIMIT_S) as r:
        return json.load(r)["choices"][0]["text"]


def stop(p, what, launched):
    p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        sys.exit(what + ": did not end within %d s of SIGTERM" % LIMIT_S)
    print(out, end="")
    if "stopping after %d requests" % len(PROMPTS) not in out or "error" in out:
        sys.exit(what + ": did not stop cleanly after the requests")
    if not launched and p.returncode != 0:
        sys.exit("%s: exited with %d" % (what, p.returncode))


def main():
    sep = sys.argv.index("--")
    launch, serve = sys.argv[1:sep], sys.argv[sep + 1:]
    answers = []
    one = "--tp 1 --pp 1"
    for name, cmd in ((one, serve + one.split()), (" ".join(launch), launch + serve)):
        p, port, banner = start(cmd)
        print(name + ":\n" + banner, end="")
        answers.append([complete(port, q) for q in PROMPTS])
        stop(p, name, launched=name != one)
        ranks = re.search(r"tp (\d+), pp (\d+)\)", banner)
        if name != one and not (ranks and int(ranks[1]) * int(ranks[2]) > 1):
            sys.exit(name + ": the server does not report several ranks")
    print("answers:", answers)
    if answers[0] != answers[1]:
        sys.exit("the answers differ: --tp 1 --pp 1 %r, launched %r" % (answers[0], answers[1]))


main()
