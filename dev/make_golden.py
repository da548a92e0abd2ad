#!/usr/bin/env python3
"""Writes the golden safetensors files in tests/golden/ from the float64 reference.

    python3 dev/make_golden.py            # (re)write tests/golden/*.safetensors
    python3 dev/make_golden.py --check    # regenerate in memory, compare bytes with the committed files
    python3 dev/make_golden.py --f32-report   # deviation of a float32 run of the reference

Deterministic: the same numpy/safetensors give byte-identical files (the header JSON is
re-serialised canonically, because safetensors writes __metadata__ in hash-map order).
See tests/golden/README.md for the contents.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np
from safetensors.numpy import save as st_save, load as st_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_ref as ref  # noqa: E402
import llama_ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(REPO, "tests", "golden")

# dtype of the `final.*` tensors.  float64 as specified; switching to np.float32 would cut
# gpt2-micro.safetensors from ~607 KB to ~490 KB at a relative precision of 6e-8, far below
# any f32 trainer's tolerance.
FINAL_DTYPE = np.float64

CASES = [
    {
        "file": "gpt2-micro.safetensors",
        "description": "2-layer micro GPT-2, vocab 101, cosine schedule with warmup, grad clipping",
        "seed": 1234,
        "config": ref.GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_head=4, n_layer=2),
        "B": 2,
        "T": 8,
        "train": dict(n_steps=4, lr=1e-3, min_lr=1e-4, warmup_steps=2, steps=4, schedule="cosine",
                      beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0),
    },
    {
        "file": "gpt2-l1-constant.safetensors",
        "description": "1-layer GPT-2, vocab 37, T == n_positions, constant lr, no clipping (pre-clip norms > 1), beta2 0.999",
        "seed": 5678,
        "config": ref.GPT2Config(vocab_size=37, n_positions=8, n_embd=16, n_head=4, n_layer=1),
        "B": 3,
        "T": 8,
        "train": dict(n_steps=4, lr=2e-3, min_lr=0.0, warmup_steps=0, steps=4, schedule="constant",
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, grad_clip=0.0),
    },
    {
        "file": "llama-gqa-untied.safetensors",
        "model": llama_ref,
        "description": "2-layer Llama, 4 query heads sharing 2 key/value heads of size 12 (heads * head_dim != "
                       "hidden), untied head, rope_theta 100, vocab 61, cosine schedule, grad clipping",
        "seed": 4321,
        "config": llama_ref.LlamaConfig(vocab_size=61, max_position_embeddings=16, hidden_size=32,
                                        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
                                        rope_theta=100.0, tie_word_embeddings=False),
        "B": 2,
        "T": 12,
        "train": dict(n_steps=4, lr=1e-3, min_lr=1e-4, warmup_steps=2, steps=4, schedule="cosine",
                      beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0),
    },
    {
        "file": "llama-mha-tied.safetensors",
        "model": llama_ref,
        "description": "2-layer Llama, 2 heads each with its own key/value head, tied embeddings, T == "
                       "max_position_embeddings, vocab 37, constant lr, no clipping",
        "seed": 8765,
        "config": llama_ref.LlamaConfig(vocab_size=37, max_position_embeddings=8, hidden_size=16,
                                        intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                        rope_theta=10000.0, tie_word_embeddings=True),
        "B": 3,
        "T": 8,
        "train": dict(n_steps=4, lr=2e-3, min_lr=0.0, warmup_steps=0, steps=4, schedule="constant",
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, grad_clip=0.0),
    },
]

# How each model's goldens are initialised (recorded in the file's metadata).
INIT = {
    "gpt2": {
        "order": "params in HF order (wte, wpe, h.0.*, ..., ln_f.*), each mean + std*rng.standard_normal(shape) "
                 "rounded to float32; then tokens = rng.integers(0, vocab_size, size=(B, T+1))",
        "std": "weights/embeddings/linear biases 0.02; c_proj weights 0.02/sqrt(2*n_layer); "
               "LayerNorm weight 1 + 0.1*N, LayerNorm bias 0.1*N",
    },
    "llama": {
        "order": "params in save_pretrained order (model.embed_tokens, model.layers.0.*, ..., model.norm, "
                 "lm_head when untied), each rounded to float32; then tokens = rng.integers(0, vocab_size, "
                 "size=(B, T+1))",
        "std": "matrices and the embedding 0.02*N; RMSNorm weights 1 + 0.1*N",
    },
}


def canonical_safetensors(tensors: dict, metadata: dict) -> bytes:
    """safetensors.numpy.save, then rewrite the JSON header deterministically
    (__metadata__ first with sorted keys, then tensors in data order, compact JSON,
    space-padded to a multiple of 8 bytes like safetensors itself)."""
    raw = st_save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", None) or {}
    ordered = {"__metadata__": {k: meta[k] for k in sorted(meta)}}
    for name in sorted(header, key=lambda k: (header[k]["data_offsets"][0], k)):
        ordered[name] = header[name]
    hjson = json.dumps(ordered, separators=(",", ":"), ensure_ascii=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    out = struct.pack("<Q", len(hjson)) + hjson + data
    # the rewritten file must load to exactly the same tensors
    back = st_load(out)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v), k
    return out


def model_of(case):
    """The reference module of a case (GPT-2 unless it names another) and its INIT key."""
    m = case.get("model", ref)
    return m, ("llama" if m is llama_ref else "gpt2")


def make_case(case) -> tuple[bytes, dict]:
    cfg = case["config"]
    B, T, hp = case["B"], case["T"], case["train"]
    mod, kind = model_of(case)
    assert T <= (cfg.max_position_embeddings if kind == "llama" else cfg.n_positions)
    rng = np.random.default_rng(case["seed"])
    if kind == "llama":
        params = mod.init_params(cfg, rng, norm_jitter=0.1)  # float64 holding float32 values
    else:
        params = mod.init_params(cfg, rng)
    tokens = rng.integers(0, cfg.vocab_size, size=(B, T + 1)).astype(np.int32)
    names = [n for n, _ in mod.param_shapes(cfg)]

    loss, logits, grads = mod.loss_and_grads({k: v.copy() for k, v in params.items()}, cfg, tokens)

    trained = {k: v.copy() for k, v in params.items()}
    losses, norms, lrs = ref.train(trained, cfg, tokens, hp["n_steps"], hp, model=mod)
    assert losses[0] == loss

    t = {}
    for n in names:
        p32 = params[n].astype(np.float32)
        assert np.array_equal(p32.astype(np.float64), params[n])  # exactly representable
        t[n] = p32
    t["tokens"] = tokens
    t["logits"] = np.ascontiguousarray(logits, dtype=np.float64)
    t["loss"] = np.array([loss], dtype=np.float64)
    for n in names:
        t["grad." + n] = np.ascontiguousarray(grads[n], dtype=np.float64)
    t["step_losses"] = np.array(losses, dtype=np.float64)
    t["step_grad_norms"] = np.array(norms, dtype=np.float64)
    t["step_lrs"] = np.array(lrs, dtype=np.float64)
    for n in names:
        t["final." + n] = np.ascontiguousarray(trained[n], dtype=FINAL_DTYPE)

    metadata = {
        "format": "fugu-golden-v1",
        "description": case["description"],
        "config": json.dumps(cfg.to_dict(), sort_keys=True),
        "batch": json.dumps({"B": B, "T": T}, sort_keys=True),
        "train": json.dumps(hp, sort_keys=True),
        "init": json.dumps({
            "rng": "numpy.random.default_rng(seed)",
            "seed": case["seed"],
            **INIT[kind],
        }, sort_keys=True),
        "param_names": json.dumps(names),
        "generator": f"dev/make_golden.py (reference dev/{mod.__name__}.py, float64)",
    }
    summary = dict(loss=loss, losses=losses, norms=norms, lrs=lrs)
    return canonical_safetensors(t, metadata), summary


def f32_report(case) -> None:
    """Runs the same reference algorithm in float32 NumPy from the same float32 start and
    prints how far it lands from the float64 goldens: a floor for a Rust f32 trainer's
    deviation (it sums in different orders, so allow a healthy margin above these)."""
    cfg, hp = case["config"], case["train"]
    mod, kind = model_of(case)
    if kind == "llama":
        print(f"{case['file']}: skipped (dev/llama_ref.py computes in float64 only)")
        return
    data, _ = make_case(case)
    g = st_load(data)
    names = [n for n, _ in mod.param_shapes(cfg)]
    p32 = {n: g[n].copy() for n in names}  # float32
    loss, logits, grads = mod.loss_and_grads({k: v.copy() for k, v in p32.items()}, cfg, g["tokens"])
    assert logits.dtype == np.float32
    print(f"{case['file']}: float32 reference vs float64 golden")
    print(f"  loss   rel diff {abs(float(loss) - g['loss'][0]) / g['loss'][0]:.2e}")
    print(f"  logits max abs diff {np.abs(logits - g['logits']).max():.2e}")
    d = max((np.abs(grads[n] - g['grad.' + n]).max() / np.abs(g['grad.' + n]).max(), n) for n in names)
    print(f"  grads  max over tensors of max|diff|/max|golden| {d[0]:.2e} ({d[1]})")
    losses, norms, lrs = ref.train(p32, cfg, g["tokens"], hp["n_steps"], hp, model=mod)
    print(f"  step_losses max abs diff {np.abs(np.array(losses, dtype=np.float64) - g['step_losses']).max():.2e}")
    print(f"  step_grad_norms max rel diff "
          f"{(np.abs(np.array(norms) - g['step_grad_norms']) / g['step_grad_norms']).max():.2e}")
    d = max((np.abs(p32[n] - g['final.' + n]).max(), n) for n in names)
    print(f"  final  max abs diff {d[0]:.2e} ({d[1]})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 unless the committed files are byte-identical")
    ap.add_argument("--out", default=GOLDEN_DIR, help="output directory (default tests/golden)")
    ap.add_argument("--f32-report", action="store_true",
                    help="do not write; show how far a float32 run of the reference lands from the goldens")
    args = ap.parse_args(argv)
    if args.f32_report:
        for case in CASES:
            f32_report(case)
        return 0
    ok = True
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        data, s = make_case(case)
        path = os.path.join(args.out, case["file"])
        print(f"{case['file']}: {len(data)} bytes, loss {s['loss']:.15f}")
        print(f"  step_losses     {[float(x) for x in s['losses']]}")
        print(f"  step_grad_norms {[float(x) for x in s['norms']]}")
        print(f"  step_lrs        {[float(x) for x in s['lrs']]}")
        if args.check:
            try:
                with open(path, "rb") as f:
                    same = f.read() == data
            except FileNotFoundError:
                same = False
            print(f"  {'identical' if same else 'DIFFERS from'} {path}")
            ok &= same
        else:
            with open(path, "wb") as f:
                f.write(data)
            print(f"  wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
