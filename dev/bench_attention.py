#!/usr/bin/env python3
"""PyTorch's attention beside `fugu bench attention`: scaled-dot-product attention (causal)
forward and backward on the same shapes, once per SDPA backend.

    python3 dev/bench_attention.py --device cuda [--set gpt2,llama] [--shape BxTxHxHS[xKV]]
    python3 dev/bench_attention.py --device cuda --dtype bf16 --budget 0.5 --rounds 5

Per shape and backend (`flash`: FlashAttention-2 as PyTorch ships it; `efficient`: the
memory-efficient kernels; `cudnn`: cuDNN's fused attention; `math`: PyTorch's unfused
reference), in rounds that alternate the backends (median of the rounds):

* forward: `F.scaled_dot_product_attention(q, k, v, is_causal=True)` with q, k, v requiring
  gradients (as in training: the kernels keep what their backward needs), timed between CUDA
  events over enough calls to fill the budget;
* backward: `torch.autograd.grad` of one forward's output against q, k and v with a fixed
  output gradient (`retain_graph`), timed the same way: the backward kernels alone, as
  FlashAttention's own benchmark times them.

q, k and v are laid out as a training step makes them (views of one (B, T, H + 2·KV, hs)
tensor, heads transposed), the layout fugu's kernels read too. Grouped-query shapes (KV < H)
pass `enable_gqa=True`; a backend that refuses a shape or a type prints why and is skipped.

The shape sets and FLOP counts are `fugu bench attention`'s (`src/bench/attention.rs`):
gpt2 = GPT-2 124M (16 x 1024, 12 heads of 64), llama = llama-d128 (8 x 2048, 8 heads of 128,
2 key/value heads) and a Llama 3 8B layer (8 x 2048, 32 heads of 128, 8 key/value heads);
TFLOP/s over the causal (query, key) pairs, B*H*T*(T+1)/2, with 2 products of 2*hs FLOPs each
forward and 4 backward (FlashAttention counts the backward as 5: x1.25).

Needs `torch` with CUDA for GPU runs (the CPU works too, slowly). A development tool: fugu's
tests never run it. `scripts/gpu-check.sh` (stage 10) runs it beside fugu's in one device call.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SETS = {
    "gpt2": [("gpt2-124m", (16, 1024, 12, 12, 64))],
    "llama": [
        ("llama-d128", (8, 2048, 8, 2, 128)),
        ("llama3-8b", (8, 2048, 32, 8, 128)),
    ],
}
SETS["all"] = SETS["gpt2"] + SETS["llama"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16,
          "f32": torch.float32, "fp32": torch.float32}


def parse_shape(s):
    n = [int(p) for p in s.split("x")]
    if len(n) == 4:
        b, t, h, hs = n
        kv = h
    elif len(n) == 5:
        b, t, h, hs, kv = n
    else:
        raise SystemExit(f"attention shape {s!r}: expected BxTxHxHS or BxTxHxHSxKV")
    if min(n) < 1 or h % kv:
        raise SystemExit(f"attention shape {s!r}: sizes at least 1, KV dividing H")
    return ("custom", (b, t, h, kv, hs))


def backends():
    from torch.nn.attention import SDPBackend
    names = [("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
             ("cudnn", "CUDNN_ATTENTION"), ("math", "MATH")]
    return [(n, getattr(SDPBackend, a)) for n, a in names if hasattr(SDPBackend, a)]


class Timer:
    """Milliseconds of a block of work: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, calls):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) * 1e3 / calls


def inputs(shape, dtype, device):
    b, t, h, kv, hs = shape
    g = torch.Generator(device="cpu").manual_seed(1)
    qkv = (torch.rand(b, t, h + 2 * kv, hs, generator=g) * 2 - 1).to(device=device, dtype=dtype)
    # Views of the one tensor, heads transposed: (B, heads, T, hs), as a model's split makes.
    q = qkv[:, :, :h].transpose(1, 2).detach().requires_grad_()
    k = qkv[:, :, h:h + kv].transpose(1, 2).detach().requires_grad_()
    v = qkv[:, :, h + kv:].transpose(1, 2).detach().requires_grad_()
    dout = (torch.rand(b, t, h, hs, generator=g) * 2 - 1).to(device=device, dtype=dtype)
    return q, k, v, dout.transpose(1, 2)


def contenders(shape, dtype, device):
    """(name, forward fn, backward fn) of each backend that runs this shape; prints why not."""
    from torch.nn.attention import sdpa_kernel
    q, k, v, dout = inputs(shape, dtype, device)
    gqa = shape[2] != shape[3]
    out = []
    for name, backend in backends():
        kw = {"is_causal": True}
        if gqa:
            kw["enable_gqa"] = True

        def fwd(backend=backend, kw=kw):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        try:
            y = fwd()
            grads = torch.autograd.grad(y, (q, k, v), dout, retain_graph=True)
            del grads
        except Exception as e:  # a backend that does not take this shape or type
            print(f"  {name}: not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                  file=sys.stderr)
            continue

        def bwd(y=y):
            torch.autograd.grad(y, (q, k, v), dout, retain_graph=True)
        out.append((name, fwd, bwd))
    return out


def flops(shape, products):
    b, t, h, _, hs = shape
    return 2 * products * hs * b * h * t * (t + 1) / 2


def run_case(name, shape, dtype_name, device, budget, rounds, as_json):
    dtype = DTYPES[dtype_name]
    b, t, h, kv, hs = shape
    head = (f"{name}: {b} sequences of {t} tokens, {h} heads of {hs} ({kv} key/value heads), "
            f"{dtype_name}; PyTorch {torch.__version__} scaled_dot_product_attention on {device_name(device)}")
    print(head, file=sys.stderr)
    timer = Timer(device)
    cs = contenders(shape, dtype, device)
    rows = []
    for pass_name, products, pick in [("forward", 2, 1), ("backward", 4, 2)]:
        fns = [(c[0], c[pick]) for c in cs]
        per_round = budget * 1e3 / rounds
        calls = [max(1, min(10000, int(per_round / max(timer(fn, 1), 1e-3)) + 1)) for _, fn in fns]
        times = [[] for _ in fns]
        for _ in range(rounds):
            for (_, fn), n, ts in zip(fns, calls, times):
                ts.append(timer(fn, n))
        for (backend, _), ts in zip(fns, times):
            ms = statistics.median(ts)
            rows.append({"case": name, "b": b, "t": t, "heads": h, "kv_heads": kv,
                         "head_size": hs, "dtype": dtype_name, "pass": pass_name,
                         "backend": backend, "ms": ms, "ms_min": min(ts),
                         "tflops": flops(shape, products) / (ms * 1e-3) / 1e12})
    if as_json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(head)
        print(f"{'pass':<8} {'ms':>8} {'min ms':>8} {'TFLOP/s':>8}  backend")
        for r in rows:
            rate = f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.4f}"
            print(f"{r['pass']:<8} {r['ms']:>8.3f} {r['ms_min']:>8.3f} {rate:>8}  {r['backend']}")
    sys.stdout.flush()


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "the CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", default=None, help="gpt2, llama, all (comma-separated)")
    p.add_argument("--shape", action="append", default=[], help="BxTxHxHS or BxTxHxHSxKV")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=0.5,
                   help="seconds of timed calls per backend and pass")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--format", default="table", choices=["table", "json"])
    a = p.parse_args()
    if a.rounds < 1 or a.budget < 0:
        raise SystemExit("--rounds at least 1, --budget at least 0")
    cases = []
    if a.set is not None or not a.shape:
        for s in (a.set or "gpt2").split(","):
            if s not in SETS:
                raise SystemExit(f"unknown shape set {s!r}: expected gpt2, llama or all")
            cases += SETS[s]
    cases += [parse_shape(s) for s in a.shape]
    device = torch.device(a.device)
    for name, shape in cases:
        run_case(name, shape, a.dtype, device, a.budget, a.rounds, a.format == "json")


if __name__ == "__main__":
    main()
