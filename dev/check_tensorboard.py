#!/usr/bin/env python3
"""Reads a fugu run folder's TensorBoard event files with TensorBoard's own reader
(EventAccumulator) and compares every scalar with metrics.jsonl.

    python dev/check_tensorboard.py RUN_DIR

Checks train/loss, train/lr, train/bpb at every logged step and val/loss, val/bpb at every
evaluation, to float32 rounding (TensorBoard stores simple_value as float32). Exits 1 on a
missing tag or a mismatch.
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run):
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    got = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}
    want = {}
    for line in open(f"{run}/metrics.jsonl"):
        r = json.loads(line)
        if r["type"] == "step":
            for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("train/bpb", "bpb")]:
                if r.get(key) is not None:
                    want.setdefault(tag, {})[r["step"]] = r[key]
        elif r["type"] == "eval":
            for tag, key in [("val/loss", "val_loss"), ("val/bpb", "val_bpb")]:
                if r.get(key) is not None:
                    want.setdefault(tag, {})[r["step"]] = r[key]
    bad = 0
    for tag, steps in want.items():
        for step, v in steps.items():
            g = got.get(tag, {}).get(step)
            if g is None or abs(g - v) > 1e-6 * max(1.0, abs(v)):
                print(f"{tag} at step {step}: tensorboard {g}, metrics.jsonl {v}")
                bad += 1
    n = sum(len(s) for s in want.values())
    print(f"{len(tags)} tags in the event files; {n} values compared with metrics.jsonl, "
          f"{bad} differ")
    sys.exit(1 if bad or n == 0 else 0)


if __name__ == "__main__":
    main(sys.argv[1])
