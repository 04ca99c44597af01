#!/usr/bin/env python3
"""The steady-state step time of a Hugging Face Trainer script, compile excluded.

    python3 tools/trainer_step_times.py [--skip N] SCRIPT.py [SCRIPT'S ARGUMENTS...]
    python3 tools/trainer_step_times.py --skip 16 out/device/hf_trainer_bert.py --bf16 \
        --optim adamw_torch_fused --compile --batch 32 --samples 4096

The Trainer's own `train_runtime` counts everything from the first step,
torch.compile's compile included (80 s of BERT-large's 64 steps), so it is
not a step time. This runs SCRIPT unchanged with a callback on every Trainer
it builds: the device is synchronized when step N (--skip) ends and when the
last step ends, and the steady step time is the wall time between those two
points over the steps between them (data loading, logging and the optimizer
included, as a user's run pays them). Between the two points nothing is
synchronized, so the Trainer keeps whatever overlap of host and device work
it has. Prints SCRIPT's own output, then one JSON line.
"""

import argparse
import json
import runpy
import statistics
import sys
import time

import torch
import transformers


class StepClock(transformers.TrainerCallback):
    """Wall-clock times at the end of each step; synchronized at `skip` and at the last step."""

    def __init__(self, skip):
        self.skip = skip
        self.ends = []  # (global step, time)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.skip, state.max_steps):
            torch.cuda.synchronize()
        self.ends.append((state.global_step, time.perf_counter()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip", type=int, default=10, help="steps left out at the start (compile, warm-up)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    clock = StepClock(a.skip)
    original = transformers.Trainer.__init__

    def with_clock(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(clock)

    transformers.Trainer.__init__ = with_clock
    sys.argv = [a.script] + a.args
    runpy.run_path(a.script, run_name="__main__")
    timed = [(s, t) for s, t in clock.ends if s >= a.skip]
    if len(timed) < 2:
        sys.exit(f"trainer_step_times: {len(clock.ends)} steps ran; --skip {a.skip} leaves none to time "
                 "(give the script more samples or a smaller --skip)")
    (s0, t0), (s1, t1) = timed[0], timed[-1]
    gaps = [(b - a_) * 1e3 for (_, a_), (_, b) in zip(timed, timed[1:])]
    print(json.dumps({
        "bench": "trainer_step_times", "script": a.script, "args": a.args, "skip": a.skip,
        "steps_timed": s1 - s0, "ms_per_step": round((t1 - t0) * 1e3 / (s1 - s0), 3),
        "median_gap_ms_unsynchronized": round(statistics.median(gaps), 3),
        "first_steps_ms": [round((b - a_) * 1e3, 1) for (_, a_), (_, b) in zip(clock.ends[:4], clock.ends[1:5])],
    }))


if __name__ == "__main__":
    main()
