#!/usr/bin/env python3
"""The fastest fused attention forms in `fugu bench attention --format json` output.

    python3 scripts/attention-best.py ROWS.jsonl [...]              # a table per shape and pass
    python3 scripts/attention-best.py --variants gpt2-124m ROWS...  # settings for gpu-check

The table names, per shape and pass, the default form's time, the fastest form's (its
settings, kernels, TFLOP/s, % of peak) and the speed-up. `--variants CASE` prints, for
`scripts/gpu-check.sh`'s stage 2, the settings of the fastest forward form, of the fastest
backward form, and both together (the forward's rows per warp for its kernel, the backward's
for its two) where they do not set one variable two ways, as environment
assignments separated by ';' (the defaults, and those `--known` lists, left out): what the full training step is then
timed with, so that forms measured fastest alone are checked in a step in the same call.
Rows of several files (e.g. a run without the wgmma forms and one with only them) are
pooled; a form is keyed by its settings.
"""

import argparse
import json
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
    return rows


def fastest(rows, case, pass_):
    """(default row, fastest fused row) of one shape and pass (None where absent)."""
    fused = [r for r in rows if r["case"] == case and r["pass"] == pass_
             and r["form"] != "three-step"]
    default = next((r for r in fused if r["form"] == "default"), None)
    best = min(fused, key=lambda r: r["ms"], default=None)
    return default, best


def assignments(form):
    return {} if form == "default" else dict(a.split("=", 1) for a in form.split())


WARP_ROWS = "FUGU_FLASH_WARP_ROWS"


def warp_rows(form):
    """A form's rows per warp of the forward, dQ and dK/dV kernels (`R` or `F,Q,KV`)."""
    rows = form.get(WARP_ROWS, "16").split(",")
    return rows * 3 if len(rows) == 1 else rows


def merge(forward, backward):
    """Both passes' fastest forms as one setting: the forward's rows per warp for its kernel
    and the backward's for dQ and dK/dV; None where they set another variable two ways, or
    where the result asks warpgroup MMA (16 rows per warp only) for other rows."""
    merged = {}
    for s in (forward, backward):
        for k, v in s.items():
            if k == WARP_ROWS:
                continue
            if merged.get(k, v) != v:
                return None
            merged[k] = v
    rows = [warp_rows(forward)[0]] + warp_rows(backward)[1:]
    if rows != ["16"] * 3:
        if merged.get("FUGU_FLASH_MMA") == "wgmma":
            return None
        merged[WARP_ROWS] = rows[0] if len(set(rows)) == 1 else ",".join(rows)
    return merged


def variants(rows, case, known=()):
    """The settings to time in a step (see the module's doc), none that `known` has already."""
    key = lambda v: tuple(sorted(v.split()))
    seen = {key(k) for k in known}
    out = []
    best = {}
    for pass_ in ("forward", "backward"):
        _, b = fastest(rows, case, pass_)
        if b is not None:
            best[pass_] = assignments(b["form"])
    sets = list(best.values())
    if len(best) == 2:
        merged = merge(best["forward"], best["backward"])
        if merged is not None:
            sets.append(merged)
    for s in sets:
        v = " ".join(f"{k}={x}" for k, x in sorted(s.items()))
        if v and key(v) not in seen:
            seen.add(key(v))
            out.append(v)
    return out


def table(rows):
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print(f"{'case':<12} {'pass':<8} {'default ms':>10} {'best ms':>8} {'TFLOP/s':>8} "
          f"{'%peak':>6} {'x dflt':>6}  best form (kernels)")
    for case in cases:
        for pass_ in ("forward", "backward"):
            default, best = fastest(rows, case, pass_)
            if best is None:
                continue
            dms = f"{default['ms']:.3f}" if default else "-"
            speed = f"{default['ms'] / best['ms']:.2f}" if default else "-"
            peak = f"{best['peak_pct']:.1f}%" if best.get("peak_pct") is not None else "-"
            print(f"{case:<12} {pass_:<8} {dms:>10} {best['ms']:>8.3f} {best['tflops']:>8.1f} "
                  f"{peak:>6} {speed:>6}  {best['form']} ({', '.join(best['kernels'])})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--variants", metavar="CASE")
    p.add_argument("--known", default="",
                   help="with --variants: ';'-separated settings already to be timed (left out)")
    a = p.parse_args()
    rows = load(a.files)
    if not rows:
        print("no benchmark rows in " + ", ".join(a.files), file=sys.stderr)
        return 1
    if a.variants:
        known = [k for k in a.known.split(";") if k.strip()]
        print(";".join(variants(rows, a.variants, known)))
    else:
        table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
