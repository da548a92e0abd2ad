#!/usr/bin/env python3
"""PyTorch baseline (eager or torch.compile) for fugu's training-step benchmark
(`cargo bench --bench train`).

    python3 dev/bench_pytorch.py [--threads 2] [--shape 4x64 --shape 4x256] [--steps 5]
    python3 dev/bench_pytorch.py --device cuda [--tf32] --shape 4x1024 --shape 16x1024
    python3 dev/bench_pytorch.py --device cuda --autocast bf16 --shape 16x1024
    python3 dev/bench_pytorch.py --device cuda --autocast bf16 --compile --shape 16x1024
    python3 dev/bench_pytorch.py --device cuda --autocast bf16 --compile --config llama-124m

`--compile` runs the model under `torch.compile` (inductor: fused elementwise and normalisation
kernels, SDPA flash attention; `--compile-mode` passes a mode such as `max-autotune`) with
PyTorch's fused AdamW (`fused=True`; `--no-fused-adamw` for the default implementation), the
strongest PyTorch baseline a GPU user would pick; its warm-up (`--warmup`, default 3 with
--compile, 1 without) includes the compilation and is not timed.

On a GPU (`--device cuda`) the same step runs on CUDA in fp32, with
`torch.backends.cuda.matmul.allow_tf32` set by `--tf32` (off by default: strict fp32), and each
step ends with `torch.cuda.synchronize()` before the clock is read. Compare with
`cargo bench --features cuda --bench train -- --device cuda [--tf32]` on the same GPU.
`--autocast bf16|fp16` wraps the forward and loss in `torch.autocast` (fp32 master weights and
optimizer, matmuls and activations in the low type; fp16 adds a `GradScaler`), the mixed-precision
baseline for `--precision bf16|fp16`.

`--config llama-124m|llama-d128` builds the Llama-family model of that fugu config instead
(RMS norms, rotary embeddings in transformers' rotate-half convention, grouped-query attention
through SDPA's `enable_gqa`, SwiGLU, no biases; the same AdamW groups), its TFLOP/s counted
as for GPT-2 (3 x the forward's matmuls, attention over all T^2 pairs).

Builds GPT-2 124M (vocab 50257, n_positions 1024, n_embd 768, 12 heads, 12 layers, tanh-GELU,
pre-LN, tied token embedding / LM head, no dropout) as a small plain-PyTorch module, in fp32 on
the CPU, eager mode (no torch.compile). Per shape BxT it runs 1 warm-up step and then `--steps`
timed steps of: forward + cross-entropy on random tokens, backward, grad-norm clip at 1.0,
AdamW step (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on 2-D weights only, as fugu
does; PyTorch's default foreach/fused choice), zero_grad. It prints the median ms/step,
tokens/s and model TFLOP/s by the Megatron formula
72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)), in the same columns as fugu's bench (without MFU and
non-GEMM share, which fugu measures from its own kernels).

Needs only `torch` (`pip install torch`; the CPU wheel is enough, e.g.
`pip install torch --index-url https://download.pytorch.org/whl/cpu`). It is a development
tool: fugu's test suite never runs it and never needs torch.
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, NPOS, H, NHEAD, NLAYER = 50257, 1024, 768, 12, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(H)
        self.c_attn = nn.Linear(H, 3 * H)
        self.c_proj = nn.Linear(H, H)
        self.ln_2 = nn.LayerNorm(H)
        self.c_fc = nn.Linear(H, 4 * H)
        self.mlp_proj = nn.Linear(4 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(H, dim=2)
        q, k, v = (z.view(b, t, NHEAD, H // NHEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, H))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.wpe = nn.Embedding(NPOS, H)
        self.h = nn.ModuleList(Block() for _ in range(NLAYER))
        self.ln_f = nn.LayerNorm(H)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * NLAYER) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))


def megatron_flops(b, s, l, h, v):
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


# The Llama-family configs of configs/ (fugu's `--config`): hidden, blocks, query heads,
# key/value heads, SwiGLU width, vocabulary, tied embeddings, RoPE theta, RMS norm epsilon.
LLAMA = {
    "llama-124m": dict(h=768, l=12, nh=12, kv=4, ff=2304, v=50257, tied=True, theta=1e4, eps=1e-5),
    "llama-d128": dict(h=1024, l=16, nh=8, kv=2, ff=2816, v=32000, tied=False, theta=1e4,
                       eps=1e-5),
}


class RMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rotate(x, cos, sin):
    # transformers' rotate_half convention (fugu's too): pairs (c, c + hs/2).
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, nh, kv = c["h"], c["nh"], c["kv"]
        self.nh, self.kv, self.hs = nh, kv, h // nh
        self.attn_norm = RMSNorm(h, c["eps"])
        self.qkv = nn.Linear(h, (nh + 2 * kv) * self.hs, bias=False)
        self.o = nn.Linear(nh * self.hs, h, bias=False)
        self.mlp_norm = RMSNorm(h, c["eps"])
        self.gate_up = nn.Linear(h, 2 * c["ff"], bias=False)
        self.down = nn.Linear(c["ff"], h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.nh * self.hs, self.kv * self.hs, self.kv * self.hs], dim=2)
        q = rotate(q.view(b, t, self.nh, self.hs).transpose(1, 2), cos, sin)
        k = rotate(k.view(b, t, self.kv, self.hs).transpose(1, 2), cos, sin)
        v = v.view(b, t, self.kv, self.hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.nh)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, self.nh * self.hs))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """A Llama-family decoder as fugu's `arch = "llama"` builds it: RMS norms (weights only),
    rotary embeddings, grouped-query attention, SwiGLU, no biases, tied or untied head."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["v"], c["h"])
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c["l"]))
        self.norm = RMSNorm(c["h"], c["eps"])
        self.head = None if c["tied"] else nn.Linear(c["h"], c["v"], bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        hs = c["h"] // c["nh"]
        inv = 1.0 / (c["theta"] ** (torch.arange(0, hs, 2).float() / hs))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        f = torch.outer(torch.arange(t, device=idx.device).float(), self.inv_freq)
        e = torch.cat((f, f), dim=-1)
        cos, sin = e.cos(), e.sin()
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight if self.head is None else self.head.weight)
        return F.cross_entropy(logits.view(-1, self.c["v"]), targets.reshape(-1))


def llama_flops(b, s, c):
    """Training FLOPs of a step, as megatron_flops counts GPT-2's: 3 × the forward's matmuls
    (2 per multiply-add), attention's over all T² pairs."""
    h, l, nh, kv, ff, v = c["h"], c["l"], c["nh"], c["kv"], c["ff"], c["v"]
    hs = h // nh
    per_token = l * (h * (nh + 2 * kv) * hs + nh * hs * h + 3 * h * ff) + h * v
    attention = l * 2 * s * nh * hs
    return 3.0 * 2.0 * b * s * (per_token + attention)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpt2-124m", choices=["gpt2-124m", *LLAMA],
                    help="the model (fugu's config of that name)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", action="append", default=None, help="BxT (repeatable)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls (GPU)")
    ap.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                    help="torch.autocast mixed precision (fp32 weights; fp16 adds a GradScaler)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    ap.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                    help="AdamW(fused=True) (default: on with --compile)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default: 3 with --compile, else 1)")
    args = ap.parse_args()
    fused = args.compile if args.fused_adamw is None else args.fused_adamw
    warmup = args.warmup if args.warmup is not None else (3 if args.compile else 1)
    if warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    shapes = args.shape or ["4x64", "4x256"]
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32

    def sync():
        if gpu:
            torch.cuda.synchronize(dev)

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    where = (f"{torch.cuda.get_device_name(dev)}, {'TF32' if args.tf32 else 'strict fp32'}"
             if gpu else f"{torch.get_num_threads()} threads, CPU")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    how = "compiled" if args.compile else "eager"
    if args.compile and args.compile_mode:
        how += f" ({args.compile_mode})"
    mode = f"{how} + autocast {args.autocast}" if amp else f"fp32 {how}"
    mode += ", fused AdamW" if fused else ""
    print(f"torch {torch.__version__} | {mode} | {where}")
    print(f"{'config':<12} {'BxT':>7} {'ms/step':>10} {'tokens/s':>10} {'TFLOP/s':>9}")
    for s in shapes:
        b, t = (int(z) for z in s.split("x"))
        model = (GPT2() if args.config == "gpt2-124m" else Llama(LLAMA[args.config])).to(dev)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if fused else {}),
        )
        step_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
        gen = torch.Generator().manual_seed(7)
        scaler = torch.amp.GradScaler(dev.type, enabled=args.autocast == "fp16")
        times = []
        for step in range(args.steps + warmup):
            vocab = V if args.config == "gpt2-124m" else LLAMA[args.config]["v"]
            window = torch.randint(0, vocab, (b, t + 1), generator=gen).to(dev)
            sync()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = step_model(window[:, :-1], window[:, 1:])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            if step >= warmup:
                times.append(ms)
        med = statistics.median(times)
        flops = (megatron_flops(b, t, NLAYER, H, V) if args.config == "gpt2-124m"
                 else llama_flops(b, t, LLAMA[args.config]))
        tflops = flops / (med / 1e3) / 1e12
        print(f"{args.config:<12} {s:>7} {med:>10.1f} {b * t / (med / 1e3):>10.1f} "
              f"{tflops:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
