#!/usr/bin/env python3
"""Independent float64 NumPy reference implementation of GPT-2 training for fugu.

Forward, hand-written backward (one explicit backward function per op, llm.c
style), AdamW exactly as torch.optim.AdamW, global-norm gradient clipping as
torch.nn.utils.clip_grad_norm_, and the warmup + cosine / constant learning
rate schedules.  The model is Hugging Face GPT2LMHeadModel without dropout and
the parameter names are those of the HF `gpt2` model.safetensors checkpoint.

    python3 dev/gpt2_ref.py --selftest      # finite-difference gradient check
    python3 dev/gpt2_ref.py --check-torch   # compare with PyTorch (if installed)

Only numpy is needed.  See dev/README.md for the exact formulas.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, asdict

import numpy as np

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------
# configuration and parameters
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_head: int
    n_layer: int

    def to_dict(self):
        return asdict(self)


def param_shapes(cfg: GPT2Config):
    """Ordered list of (HF name, shape).  This order is also the init order."""
    V, P, C, L = cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_layer
    out = [("wte.weight", (V, C)), ("wpe.weight", (P, C))]
    for i in range(L):
        h = f"h.{i}."
        out += [
            (h + "ln_1.weight", (C,)),
            (h + "ln_1.bias", (C,)),
            (h + "attn.c_attn.weight", (C, 3 * C)),
            (h + "attn.c_attn.bias", (3 * C,)),
            (h + "attn.c_proj.weight", (C, C)),
            (h + "attn.c_proj.bias", (C,)),
            (h + "ln_2.weight", (C,)),
            (h + "ln_2.bias", (C,)),
            (h + "mlp.c_fc.weight", (C, 4 * C)),
            (h + "mlp.c_fc.bias", (4 * C,)),
            (h + "mlp.c_proj.weight", (4 * C, C)),
            (h + "mlp.c_proj.bias", (C,)),
        ]
    out += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return out


def init_std(name: str, cfg: GPT2Config):
    """(mean, std) of the normal init of a parameter (see dev/README.md)."""
    if ".ln_" in name or name.startswith("ln_"):
        return (1.0, 0.1) if name.endswith(".weight") else (0.0, 0.1)
    if name.endswith("c_proj.weight"):
        return (0.0, 0.02 / math.sqrt(2 * cfg.n_layer))
    return (0.0, 0.02)  # other weights, both embeddings, all linear biases


def init_params(cfg: GPT2Config, rng: np.random.Generator, scale: float = 1.0):
    """Deterministic GPT-2 style init, rounded to float32 first, returned as float64.

    For each parameter in param_shapes() order: x = mean + std*scale*rng.standard_normal(shape)
    (float64), then rounded to float32.  `scale` != 1 is only used by the self-test.
    """
    params = {}
    for name, shape in param_shapes(cfg):
        mean, std = init_std(name, cfg)
        x = mean + (std * scale) * rng.standard_normal(shape)
        params[name] = x.astype(np.float32).astype(np.float64)
    return params


def decay_mask(name: str, value: np.ndarray) -> bool:
    """Weight decay applies to 2-D tensors only (weight matrices and both embeddings)."""
    return value.ndim == 2


# --------------------------------------------------------------------------
# ops: forward and backward
# --------------------------------------------------------------------------

def encoder_forward(wte, wpe, idx):
    B, T = idx.shape
    return wte[idx] + wpe[:T][None, :, :]


def encoder_backward(dwte, dwpe, dout, idx):
    B, T = idx.shape
    np.add.at(dwte, idx.reshape(-1), dout.reshape(B * T, -1))
    dwpe[:T] += dout.sum(axis=0)


def layernorm_forward(x, w, b):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)  # biased variance
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd)


def layernorm_backward(dout, w, cache):
    xhat, rstd = cache
    dw = (dout * xhat).reshape(-1, xhat.shape[-1]).sum(axis=0)
    db = dout.reshape(-1, xhat.shape[-1]).sum(axis=0)
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw, db


def linear_forward(x, w, b):
    """HF Conv1D: w has layout (in, out); y = x @ w + b."""
    y = x @ w
    if b is not None:
        y = y + b
    return y


def linear_backward(dout, x, w):
    cin, cout = w.shape
    dx = dout @ w.T
    dw = x.reshape(-1, cin).T @ dout.reshape(-1, cout)
    db = dout.reshape(-1, cout).sum(axis=0)
    return dx, dw, db


def gelu_forward(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_K * (x + 0.044715 * x ** 3)))


def gelu_backward(dout, x):
    u = GELU_K * (x + 0.044715 * x ** 3)
    th = np.tanh(u)
    sech2 = 1.0 - th * th
    du = GELU_K * (1.0 + 3.0 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + th) + 0.5 * x * sech2 * du)


def attention_forward(qkv, n_head):
    """qkv: [B, T, 3C] (q | k | v along the last axis, heads contiguous inside each)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    q = q.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)  # [B, nh, T, hd]
    k = k.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
    scale = 1.0 / math.sqrt(hd)
    pre = (q @ k.transpose(0, 1, 3, 2)) * scale              # [B, nh, T, T]
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)        # True above diagonal = masked
    pre = np.where(mask, -np.inf, pre)
    pre = pre - pre.max(axis=-1, keepdims=True)
    e = np.exp(pre)
    att = e / e.sum(axis=-1, keepdims=True)
    y = att @ v                                             # [B, nh, T, hd]
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
    return y, (q, k, v, att, scale)


def attention_backward(dy, n_head, cache):
    q, k, v, att, scale = cache
    B, nh, T, hd = q.shape
    C = nh * hd
    dy = dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
    datt = dy @ v.transpose(0, 1, 3, 2)
    dv = att.transpose(0, 1, 3, 2) @ dy
    # softmax backward; masked entries have att == 0 so their gradient is 0
    dpre = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    dpre = dpre * scale
    dq = dpre @ k
    dk = dpre.transpose(0, 1, 3, 2) @ q
    def merge(t):
        return t.transpose(0, 2, 1, 3).reshape(B, T, C)
    return np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


def crossentropy_forward(logits, targets):
    """Mean cross-entropy over all positions. Returns (loss, probs)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    probs = e / e.sum(axis=-1, keepdims=True)
    lse = np.log(e.sum(axis=-1))
    tgt = np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    losses = lse - tgt
    return losses.mean(), probs


def crossentropy_backward(probs, targets):
    n = targets.size
    dlogits = probs.copy()
    B, T = targets.shape
    bi, ti = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    dlogits[bi, ti, targets] -= 1.0
    return dlogits / n


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def split_batch(window):
    """window: int [B, T+1] -> inputs [:, :T], targets [:, 1:]."""
    window = np.asarray(window)
    return window[:, :-1], window[:, 1:]


def forward(params, cfg: GPT2Config, inputs, targets=None):
    """Returns (loss or None, logits, cache)."""
    B, T = inputs.shape
    assert T <= cfg.n_positions
    x = encoder_forward(params["wte.weight"], params["wpe.weight"], inputs)
    layers = []
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        c = {"x_in": x}
        ln1, c["ln1"] = layernorm_forward(x, params[h + "ln_1.weight"], params[h + "ln_1.bias"])
        c["ln1_out"] = ln1
        qkv = linear_forward(ln1, params[h + "attn.c_attn.weight"], params[h + "attn.c_attn.bias"])
        atty, c["att"] = attention_forward(qkv, cfg.n_head)
        c["atty"] = atty
        attproj = linear_forward(atty, params[h + "attn.c_proj.weight"], params[h + "attn.c_proj.bias"])
        x2 = x + attproj
        c["x2"] = x2
        ln2, c["ln2"] = layernorm_forward(x2, params[h + "ln_2.weight"], params[h + "ln_2.bias"])
        c["ln2_out"] = ln2
        fch = linear_forward(ln2, params[h + "mlp.c_fc.weight"], params[h + "mlp.c_fc.bias"])
        c["fch"] = fch
        fch_gelu = gelu_forward(fch)
        c["fch_gelu"] = fch_gelu
        fcproj = linear_forward(fch_gelu, params[h + "mlp.c_proj.weight"], params[h + "mlp.c_proj.bias"])
        x = x2 + fcproj
        layers.append(c)
    xf, lnf_cache = layernorm_forward(x, params["ln_f.weight"], params["ln_f.bias"])
    logits = linear_forward(xf, params["wte.weight"].T, None)  # tied LM head
    cache = {"inputs": inputs, "layers": layers, "lnf": lnf_cache, "xf": xf}
    loss = None
    if targets is not None:
        loss, probs = crossentropy_forward(logits, targets)
        cache["probs"] = probs
        cache["targets"] = targets
    return loss, logits, cache


def backward(params, cfg: GPT2Config, cache):
    """Gradients of the mean cross-entropy loss w.r.t. every parameter (float64)."""
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    dlogits = crossentropy_backward(cache["probs"], cache["targets"])
    C = cfg.n_embd
    xf = cache["xf"]
    wte = params["wte.weight"]
    # logits = xf @ wte^T
    dxf = dlogits @ wte
    grads["wte.weight"] += dlogits.reshape(-1, wte.shape[0]).T @ xf.reshape(-1, C)
    dx, dw, db = layernorm_backward(dxf, params["ln_f.weight"], cache["lnf"])
    grads["ln_f.weight"] += dw
    grads["ln_f.bias"] += db
    for i in reversed(range(cfg.n_layer)):
        h = f"h.{i}."
        c = cache["layers"][i]
        # x_out = x2 + fcproj
        dx2 = dx.copy()
        dfcproj = dx
        dfch_gelu, dw, db = linear_backward(dfcproj, c["fch_gelu"], params[h + "mlp.c_proj.weight"])
        grads[h + "mlp.c_proj.weight"] += dw
        grads[h + "mlp.c_proj.bias"] += db
        dfch = gelu_backward(dfch_gelu, c["fch"])
        dln2, dw, db = linear_backward(dfch, c["ln2_out"], params[h + "mlp.c_fc.weight"])
        grads[h + "mlp.c_fc.weight"] += dw
        grads[h + "mlp.c_fc.bias"] += db
        dxx, dw, db = layernorm_backward(dln2, params[h + "ln_2.weight"], c["ln2"])
        grads[h + "ln_2.weight"] += dw
        grads[h + "ln_2.bias"] += db
        dx2 += dxx
        # x2 = x_in + attproj
        dx_in = dx2.copy()
        datty, dw, db = linear_backward(dx2, c["atty"], params[h + "attn.c_proj.weight"])
        grads[h + "attn.c_proj.weight"] += dw
        grads[h + "attn.c_proj.bias"] += db
        dqkv = attention_backward(datty, cfg.n_head, c["att"])
        dln1, dw, db = linear_backward(dqkv, c["ln1_out"], params[h + "attn.c_attn.weight"])
        grads[h + "attn.c_attn.weight"] += dw
        grads[h + "attn.c_attn.bias"] += db
        dxx, dw, db = layernorm_backward(dln1, params[h + "ln_1.weight"], c["ln1"])
        grads[h + "ln_1.weight"] += dw
        grads[h + "ln_1.bias"] += db
        dx = dx_in + dxx
    encoder_backward(grads["wte.weight"], grads["wpe.weight"], dx, cache["inputs"])
    return grads


def loss_and_grads(params, cfg, window):
    inputs, targets = split_batch(window)
    loss, logits, cache = forward(params, cfg, inputs, targets)
    grads = backward(params, cfg, cache)
    return loss, logits, grads


# --------------------------------------------------------------------------
# optimizer, clipping, schedule
# --------------------------------------------------------------------------

def global_grad_norm(grads, names):
    """sqrt of the sum of squares of every gradient element (torch: norm of per-tensor norms)."""
    return math.sqrt(sum(float(np.sum(grads[n] * grads[n])) for n in names))


def clip_grads(grads, names, max_norm):
    """torch.nn.utils.clip_grad_norm_: returns the pre-clip total norm; scales grads in place."""
    total = global_grad_norm(grads, names)
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for n in names:
                grads[n] *= coef
    return total


def lr_at(step, lr, min_lr, warmup_steps, steps, schedule="cosine"):
    """Learning rate for 0-based `step` (see dev/README.md)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}")
    if steps <= warmup_steps:
        progress = 1.0
    else:
        progress = (step - warmup_steps) / (steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class AdamW:
    """torch.optim.AdamW (amsgrad=False, maximize=False), single-tensor code path order."""

    def __init__(self, params, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1):
        self.beta1, self.beta2, self.eps, self.wd = beta1, beta2, eps, weight_decay
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params, grads, lr):
        self.t += 1
        b1, b2, t = self.beta1, self.beta2, self.t
        bc1 = 1.0 - b1 ** t
        bc2 = 1.0 - b2 ** t
        step_size = lr / bc1
        bc2_sqrt = math.sqrt(bc2)
        for name, p in params.items():
            g = grads[name]
            wd = self.wd if decay_mask(name, p) else 0.0
            p *= 1.0 - lr * wd                       # decoupled weight decay first
            m = self.m[name]
            v = self.v[name]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * g * g
            denom = np.sqrt(v) / bc2_sqrt + self.eps
            p -= step_size * (m / denom)


def train(params, cfg, window, n_steps, hp, model=None):
    """Runs n_steps optimizer steps on the same batch. Mutates params.

    hp keys: lr, min_lr, warmup_steps, steps, schedule, beta1, beta2, eps,
    weight_decay, grad_clip.  Returns (losses, grad_norms, lrs).  `model`: the module whose
    `loss_and_grads` is trained (default this one, GPT-2; `llama_ref` passes itself).
    """
    model = model or sys.modules[__name__]
    names = list(params.keys())
    opt = AdamW(params, hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
    losses, norms, lrs = [], [], []
    for step in range(n_steps):
        loss, _, grads = model.loss_and_grads(params, cfg, window)
        norm = clip_grads(grads, names, hp["grad_clip"])
        lr = lr_at(step, hp["lr"], hp["min_lr"], hp["warmup_steps"], hp["steps"], hp["schedule"])
        opt.step(params, grads, lr)
        losses.append(loss)
        norms.append(norm)
        lrs.append(lr)
    return losses, norms, lrs


# --------------------------------------------------------------------------
# self-test: finite differences
# --------------------------------------------------------------------------

def fd_check(cfg, params, window, rng, per_tensor=4, h=1e-3, tol=1e-6, floor=1e-6, label="",
             model=None):
    """Compares analytic gradients with 4th-order central differences
    g ~ (-f(x+2h) + 8 f(x+h) - 8 f(x-h) + f(x-2h)) / (12 h)   (error O(h^4)).

    rel = |a - n| / max(|a|, |n|, floor): gradients below `floor` (1e-6) in magnitude are
    thus checked with an absolute tolerance of tol * floor = 1e-12, which is above the
    rounding noise of the differences (~eps * loss / h ~ 1e-13) but far below any real
    gradient.  Some gradients are exactly 0: the key part of c_attn.bias (softmax is
    invariant to adding a constant to a row of scores) and wpe rows >= T.

    `model`: the module whose `param_shapes`, `forward` and `loss_and_grads` are checked
    (default this one, GPT-2; `llama_ref` passes itself).
    """
    model = model or sys.modules[__name__]
    inputs, targets = split_batch(window)
    loss, _, grads = model.loss_and_grads(params, cfg, window)
    print(f"[{label}] config {cfg.to_dict()} B={inputs.shape[0]} T={inputs.shape[1]} loss={loss:.12f}")
    worst = 0.0
    ok = True
    shapes = model.param_shapes(cfg)
    width = max(len(name) for name, _ in shapes)
    for name, shape in shapes:
        p = params[name]
        flat = p.reshape(-1)
        if per_tensor is None:  # every element
            idxs = np.arange(flat.size)
        else:
            idxs = rng.choice(flat.size, size=min(per_tensor, flat.size), replace=False)
        errs = []
        for j in idxs:
            orig = flat[j]
            vals = []
            for d in (2, 1, -1, -2):
                flat[j] = orig + d * h
                vals.append(model.forward(params, cfg, inputs, targets)[0])
            flat[j] = orig
            num = ((vals[3] - vals[0]) + 8 * (vals[1] - vals[2])) / (12 * h)
            ana = grads[name].reshape(-1)[j]
            rel = abs(ana - num) / max(abs(ana), abs(num), floor)
            errs.append((rel, j, ana, num))
        maxrel = max(e[0] for e in errs)
        worst = max(worst, maxrel)
        status = "ok" if maxrel < tol else "FAIL"
        ok &= maxrel < tol
        _, j, a, n = max(errs)
        detail = f"worst [{j}] analytic {a:+.10e} numeric {n:+.10e}"
        print(f"  {status:4s} {name:{width}s} {str(shape):10s} n={len(idxs):4d} max rel err {maxrel:.2e}  {detail}")
    print(f"[{label}] worst relative error {worst:.2e} (tolerance {tol:g}): {'PASS' if ok else 'FAIL'}")
    return ok


def check_ops(rng):
    """Direct finite-difference checks of the single-op backward functions."""
    ok = True
    h = 1e-5
    def num_grad(f, x, dout):
        g = np.zeros_like(x)
        fx = x.reshape(-1)
        gf = g.reshape(-1)
        for j in range(fx.size):
            o = fx[j]
            fx[j] = o + h; yp = np.sum(f(x) * dout)
            fx[j] = o - h; ym = np.sum(f(x) * dout)
            fx[j] = o
            gf[j] = (yp - ym) / (2 * h)
        return g
    def report(name, a, n):
        nonlocal ok
        err = np.max(np.abs(a - n)) / max(np.max(np.abs(n)), 1e-12)
        good = err < 1e-7
        ok &= good
        print(f"  {'ok' if good else 'FAIL':4s} op {name:20s} max err / max |grad| = {err:.2e}")
    x = rng.standard_normal((2, 3, 8)) * 2
    w = 1 + 0.3 * rng.standard_normal(8)
    b = 0.3 * rng.standard_normal(8)
    dout = rng.standard_normal((2, 3, 8))
    dx, _, _ = layernorm_backward(dout, w, layernorm_forward(x, w, b)[1])
    report("layernorm dx", dx, num_grad(lambda t: layernorm_forward(t, w, b)[0], x, dout))
    report("gelu dx", gelu_backward(dout, x), num_grad(gelu_forward, x, dout))
    qkv = rng.standard_normal((2, 5, 12))
    dy = rng.standard_normal((2, 5, 4))
    y, cache = attention_forward(qkv, 2)
    report("attention dqkv", attention_backward(dy, 2, cache),
           num_grad(lambda t: attention_forward(t, 2)[0], qkv, dy))
    return ok


def selftest():
    print("== op-level checks (2nd-order central differences, h=1e-5)")
    ok = check_ops(np.random.default_rng(7))
    print("== model gradient checks (4th-order central differences, h=1e-3)")
    # 1) tiny model, larger init so attention/GELU/LayerNorm are well inside their nonlinear range
    cfg = GPT2Config(vocab_size=13, n_positions=8, n_embd=8, n_head=2, n_layer=2)
    rng = np.random.default_rng(42)
    params = init_params(cfg, rng, scale=10.0)
    window = rng.integers(0, cfg.vocab_size, size=(2, 7))  # T=6 < n_positions: unused wpe rows
    ok &= fd_check(cfg, params, window, rng, per_tensor=None, label="tiny, init x10, every element")
    # 2) the golden gpt2-micro config with its own init, 6 random elements per tensor
    cfg = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_head=4, n_layer=2)
    rng = np.random.default_rng(1234)
    params = init_params(cfg, rng)
    window = rng.integers(0, cfg.vocab_size, size=(2, 9))
    ok &= fd_check(cfg, params, window, np.random.default_rng(5), per_tensor=6,
                   label="gpt2-micro, 6 random elements per tensor")
    # 3) optimizer sanity: 3 steps with clipping must reduce the loss
    hp = dict(lr=1e-2, min_lr=1e-3, warmup_steps=1, steps=3, schedule="cosine", beta1=0.9,
              beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    losses, norms, lrs = train(params, cfg, window, 3, hp)
    good = losses[-1] < losses[0]
    ok &= good
    print(f"== train sanity: losses {[f'{l:.6f}' for l in losses]} lrs {lrs} "
          f"-> {'ok' if good else 'FAIL'}")
    print("SELFTEST", "PASS" if ok else "FAIL")
    return ok


# --------------------------------------------------------------------------
# optional cross-check against PyTorch (hand-written module, no HF)
# --------------------------------------------------------------------------

def check_torch():
    try:
        import torch
    except ImportError:
        print("torch is not importable; skipping --check-torch")
        return True
    import torch.nn.functional as F
    torch.set_default_dtype(torch.float64)

    cfg = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_head=4, n_layer=2)
    rng = np.random.default_rng(1234)
    params = init_params(cfg, rng)
    window = rng.integers(0, cfg.vocab_size, size=(2, 9))
    hp = dict(lr=1e-3, min_lr=1e-4, warmup_steps=2, steps=4, schedule="cosine", beta1=0.9,
              beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)

    tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}

    def tforward(idx, tgt):
        B, T = idx.shape
        C, nh = cfg.n_embd, cfg.n_head
        x = tp["wte.weight"][idx] + tp["wpe.weight"][:T]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(cfg.n_layer):
            h = f"h.{i}."
            a = F.layer_norm(x, (C,), tp[h + "ln_1.weight"], tp[h + "ln_1.bias"], eps=LN_EPS)
            qkv = a @ tp[h + "attn.c_attn.weight"] + tp[h + "attn.c_attn.bias"]
            q, k, v = qkv.split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + y @ tp[h + "attn.c_proj.weight"] + tp[h + "attn.c_proj.bias"]
            a = F.layer_norm(x, (C,), tp[h + "ln_2.weight"], tp[h + "ln_2.bias"], eps=LN_EPS)
            a = F.gelu(a @ tp[h + "mlp.c_fc.weight"] + tp[h + "mlp.c_fc.bias"], approximate="tanh")
            x = x + a @ tp[h + "mlp.c_proj.weight"] + tp[h + "mlp.c_proj.bias"]
        x = F.layer_norm(x, (C,), tp["ln_f.weight"], tp["ln_f.bias"], eps=LN_EPS)
        logits = x @ tp["wte.weight"].T
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt.reshape(-1)), logits

    idx = torch.tensor(window[:, :-1], dtype=torch.long)
    tgt = torch.tensor(window[:, 1:], dtype=torch.long)
    ok = True

    def cmp(label, a, b, tol=1e-10):
        nonlocal ok
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        good = err < tol
        ok &= good
        print(f"  {'ok' if good else 'FAIL':4s} {label:36s} rel max err {err:.2e}")

    loss, logits, grads = loss_and_grads({k: v.copy() for k, v in params.items()}, cfg, window)
    tloss, tlogits = tforward(idx, tgt)
    tloss.backward()
    cmp("loss", np.array([loss]), np.array([tloss.item()]))
    cmp("logits", logits, tlogits.detach().numpy())
    for name, _ in param_shapes(cfg):
        cmp("grad." + name, grads[name], tp[name].grad.numpy())

    # optimizer: torch AdamW + clip_grad_norm_ + our schedule vs ours
    ref = {k: v.copy() for k, v in params.items()}
    losses, norms, lrs = train(ref, cfg, window, 4, hp)
    for t in tp.values():
        t.grad = None
    decay = [t for k, t in tp.items() if t.dim() == 2]
    nodecay = [t for k, t in tp.items() if t.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            foreach=False)
    tl, tn = [], []
    for step in range(4):
        lr = lr_at(step, hp["lr"], hp["min_lr"], hp["warmup_steps"], hp["steps"], hp["schedule"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        l, _ = tforward(idx, tgt)
        l.backward()
        n = torch.nn.utils.clip_grad_norm_(list(tp.values()), hp["grad_clip"])
        opt.step()
        tl.append(l.item())
        tn.append(float(n))
    cmp("step_losses", np.array(losses), np.array(tl))
    cmp("step_grad_norms", np.array(norms), np.array(tn))
    for name, _ in param_shapes(cfg):
        cmp("final." + name, ref[name], tp[name].detach().numpy(), tol=1e-9)
    print("CHECK-TORCH", "PASS" if ok else "FAIL")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="finite-difference gradient check")
    ap.add_argument("--check-torch", action="store_true", help="compare with PyTorch float64 if installed")
    args = ap.parse_args(argv)
    if not (args.selftest or args.check_torch):
        ap.print_help()
        return 0
    ok = True
    if args.selftest:
        ok &= selftest()
    if args.check_torch:
        ok &= check_torch()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
