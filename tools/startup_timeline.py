#!/usr/bin/env python3
"""Times a command's start-up: each line it writes (to stdout or stderr,
a carriage return ending a line too) with the seconds since the command
was started, and the moment it exited.

    python3 tools/startup_timeline.py [--runs N] [--grep REGEX] -- fusec train MODEL ...

With FUSEC_STARTUP_TIMES=1 in the environment, fusec adds its own marks
("[start-up  0.412 s] GPU open") counted from its `main`; this script's
column also counts the loader and the process's exit.
"""
import argparse
import os
import re
import subprocess
import sys
import time


def one_run(cmd, pattern):
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise SystemExit(f"error: cannot run {cmd[0]}: {e}")
    buf = b""
    while True:
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        parts = re.split(rb"[\r\n]", buf)
        buf = parts.pop()
        now = time.monotonic() - t0
        for line in parts:
            text = line.decode(errors="replace").rstrip()
            if text and (pattern is None or pattern.search(text)):
                print(f"{now:8.3f}  {text}", flush=True)
    rc = p.wait()
    end = time.monotonic() - t0
    if buf.strip():
        print(f"{end:8.3f}  {buf.decode(errors='replace').rstrip()}")
    print(f"{end:8.3f}  exited ({rc})", flush=True)
    return rc, end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="run the command this many times")
    ap.add_argument("--grep", help="print only the lines matching this regular expression")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command to time after --")
    pattern = re.compile(a.grep) if a.grep else None
    worst = 0
    for i in range(a.runs):
        print(f"# run {i + 1} of {a.runs}: {' '.join(cmd)}", flush=True)
        rc, _ = one_run(cmd, pattern)
        worst = worst or rc
    sys.exit(worst)


if __name__ == "__main__":
    main()
