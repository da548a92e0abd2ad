#!/usr/bin/env python3
"""Check that a sharded fugu checkpoint loads in Hugging Face transformers.

Usage: dev/check_sharded_checkpoint.py CKPT [REFERENCE_CKPT]

CKPT is a `ckpt-STEP` folder written by a parallel run (`--pp`/`--tp` above 1:
model-0000i-of-0000N.safetensors + model.safetensors.index.json). For example:

    cargo build --release --features mpi
    mpirun -np 4 --oversubscribe target/release/fugu train --config gpt2-tiny \
        --pp 2 --tp 2 --micro-batches 2 --steps 2 --out /tmp/pp2tp2
    python3 dev/check_sharded_checkpoint.py /tmp/pp2tp2/ckpt-00000002

Checks:
  * the index names every shard file, every shard holds exactly the tensors the
    index places in it (read with `safetensors`), and the optimizer index does
    the same for optimizer-*.safetensors;
  * transformers: GPT2LMHeadModel.from_pretrained(CKPT) loads with no missing or
    unexpected weights, and every parameter equals the tensor in the shards
    (lm_head tied to wte);
  * a forward pass on a few tokens gives finite logits;
  * with REFERENCE_CKPT (a single-file checkpoint of the same model and step,
    e.g. the same run on one process): every weight is equal to within 1e-5 and
    so are the logits.

Exits 0 and prints `skipped: <reason>` when torch/transformers/safetensors are
not installed; exits 1 on any mismatch.
"""

import json
import os
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        sys.exit(2)
    ckpt = sys.argv[1]
    ref = sys.argv[2] if len(sys.argv) == 3 else None
    try:
        import numpy as np
        import torch
        from safetensors.numpy import load_file
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"skipped: {e}")
        return

    stored = {}
    for kind in ("model", "optimizer"):
        index_path = os.path.join(ckpt, f"{kind}.safetensors.index.json")
        if not os.path.exists(index_path):
            fail(f"{index_path} missing: not a sharded checkpoint")
        with open(index_path) as f:
            index = json.load(f)
        wmap = index["weight_map"]
        files = sorted(set(wmap.values()))
        total = 0
        for fname in files:
            tensors = load_file(os.path.join(ckpt, fname))
            want = {k for k, v in wmap.items() if v == fname}
            if set(tensors) != want:
                fail(f"{fname}: holds {sorted(set(tensors) ^ want)} against the index")
            for k, t in tensors.items():
                total += t.nbytes
                if kind == "model":
                    stored[k] = t
        if total != index["metadata"]["total_size"]:
            fail(f"{kind} index total_size {index['metadata']['total_size']} != {total} bytes")
        print(f"{kind}: {len(wmap)} tensors in {len(files)} shards, {total} bytes")

    model, info = GPT2LMHeadModel.from_pretrained(
        ckpt, local_files_only=True, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if not k.endswith(".attn.bias") and k != "lm_head.weight"]
    if missing or info["unexpected_keys"]:
        fail(f"missing {missing}, unexpected {info['unexpected_keys']}")
    sd = model.state_dict()
    for k, t in stored.items():
        name = k if k in sd else k.removeprefix("transformer.")
        got = sd[name].detach().cpu().numpy()
        if got.shape != t.shape or not np.array_equal(got, t):
            fail(f"{k}: transformers holds a different tensor than the shard")
    if not torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        fail("lm_head is not tied to wte")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits).all():
        fail("non-finite logits")
    print(f"transformers: {sum(p.numel() for p in model.parameters())} parameters loaded, logits finite")

    if ref:
        other = GPT2LMHeadModel.from_pretrained(ref, local_files_only=True)
        osd = other.state_dict()
        worst = 0.0
        for k, t in sd.items():
            worst = max(worst, (t - osd[k]).abs().max().item())
        with torch.no_grad():
            dl = (other(ids).logits - logits).abs().max().item()
        print(f"against {ref}: max |dweight| {worst:.3e}, max |dlogit| {dl:.3e}")
        if worst > 1e-5 or dl > 1e-4:
            fail("the sharded and the reference checkpoints differ")
    print("ok")


if __name__ == "__main__":
    main()
