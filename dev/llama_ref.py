#!/usr/bin/env python3
"""Independent float64 NumPy reference of Llama-family training for fugu.

The model is Hugging Face `LlamaForCausalLM` without dropout, biases or RoPE scaling:
RMSNorm (eps from the config), rotary position embeddings in transformers' `rotate_half`
convention (the head split in halves, not interleaved pairs), grouped-query attention
(`num_key_value_heads` dividing `num_attention_heads`, an explicit `head_dim`), a SwiGLU MLP
(`down(silu(gate(x)) * up(x))`) and a tied or untied LM head. Parameter names are those of
`save_pretrained` (`model.layers.0.self_attn.q_proj.weight`, ...), linear weights (out, in).

Forward, a hand-written backward pass (one explicit backward function per op), and the
optimizer, clipping and schedule of `dev/gpt2_ref.py` (AdamW as torch.optim.AdamW; weight
decay on 2-D tensors only, so never on the norms).

transformers computes RMSNorm, the RoPE frequencies and cos/sin, and the eager softmax in
float32 even for a float64 model; this reference keeps everything in float64, so a float64
transformers model must have those casts lifted before the two are compared
(`--check-transformers` does that; it runs only where torch and transformers import).

    python3 dev/llama_ref.py --selftest             # finite-difference gradient checks
    python3 dev/llama_ref.py --check-transformers   # against LlamaForCausalLM (float64)
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, asdict

import numpy as np

import gpt2_ref
from gpt2_ref import crossentropy_backward, crossentropy_forward, split_batch


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.head_dim % 2:
            raise ValueError("RoPE needs an even head_dim")

    def to_dict(self):
        return asdict(self)


def param_shapes(cfg: LlamaConfig):
    """(name, shape) of every parameter, in save_pretrained's naming."""
    C, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out = [("model.embed_tokens.weight", (V, C))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (C,)),
            (p + "self_attn.q_proj.weight", (q, C)),
            (p + "self_attn.k_proj.weight", (kv, C)),
            (p + "self_attn.v_proj.weight", (kv, C)),
            (p + "self_attn.o_proj.weight", (C, q)),
            (p + "post_attention_layernorm.weight", (C,)),
            (p + "mlp.gate_proj.weight", (I, C)),
            (p + "mlp.up_proj.weight", (I, C)),
            (p + "mlp.down_proj.weight", (C, I)),
        ]
    out.append(("model.norm.weight", (C,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, C)))
    return out


def init_params(cfg: LlamaConfig, rng: np.random.Generator, std: float = 0.02, norm_jitter: float = 0.0):
    """Normal(0, std) matrices (transformers' `initializer_range`), norms 1 (+ jitter, so that a
    test sees a norm weight that is not all ones). Values are float32-representable."""
    params = {}
    for name, shape in param_shapes(cfg):
        if len(shape) == 1:
            x = 1.0 + norm_jitter * rng.standard_normal(shape)
        else:
            x = std * rng.standard_normal(shape)
        params[name] = x.astype(np.float32).astype(np.float64)
    return params


def head_weight(params, cfg: LlamaConfig):
    return params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


# --------------------------------------------------------------------------
# ops: forward and backward
# --------------------------------------------------------------------------

def rmsnorm_forward(x, w, eps):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w, (x, r)


def rmsnorm_backward(dy, w, cache):
    x, r = cache
    g = dy * w
    C = x.shape[-1]
    dx = r * g - x * (r ** 3) * np.sum(g * x, axis=-1, keepdims=True) / C
    dw = np.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))
    return dx, dw


def linear_forward(x, w):
    """x @ w.T with w (out, in), as torch.nn.Linear without a bias."""
    return x @ w.T


def linear_backward(dout, x, w):
    dx = dout @ w
    dw = dout.reshape(-1, dout.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return dx, dw


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu_forward(gate, up):
    """silu(gate) * up."""
    return silu(gate) * up


def swiglu_backward(dy, gate, up):
    s = 1.0 / (1.0 + np.exp(-gate))
    dgate = dy * up * (s + gate * s * (1.0 - s))
    dup = dy * gate * s
    return dgate, dup


def rope_cos_sin(T, head_dim, theta):
    """cos, sin [T, head_dim] of transformers' default rotary embedding: frequencies
    theta^(-2i/d) for i < d/2, each used for both halves of the head."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(np.arange(T, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rotate_half_transposed(d):
    """The transpose of rotate_half (a linear map): [d1, d2] -> [d2, -d1]."""
    h = d.shape[-1] // 2
    return np.concatenate([d[..., h:], -d[..., :h]], axis=-1)


def rope_forward(x, cos, sin):
    """x [B, heads, T, hd]."""
    return x * cos + rotate_half(x) * sin


def rope_backward(dy, cos, sin):
    return dy * cos + rotate_half_transposed(dy * sin)


def attention_forward(q, k, v, n_rep):
    """Causal attention; q [B, nh, T, hd], k and v [B, nkv, T, hd]: query head h reads
    key/value head h // n_rep (transformers' repeat_kv)."""
    B, nh, T, hd = q.shape
    kr = np.repeat(k, n_rep, axis=1)
    vr = np.repeat(v, n_rep, axis=1)
    scale = 1.0 / math.sqrt(hd)
    pre = (q @ kr.transpose(0, 1, 3, 2)) * scale
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    pre = np.where(mask, -np.inf, pre)
    pre = pre - pre.max(axis=-1, keepdims=True)
    e = np.exp(pre)
    att = e / e.sum(axis=-1, keepdims=True)
    y = att @ vr
    return y, (q, kr, vr, att, scale, n_rep)


def attention_backward(dy, cache):
    q, kr, vr, att, scale, n_rep = cache
    B, nh, T, hd = q.shape
    datt = dy @ vr.transpose(0, 1, 3, 2)
    dvr = att.transpose(0, 1, 3, 2) @ dy
    dpre = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) * scale
    dq = dpre @ kr
    dkr = dpre.transpose(0, 1, 3, 2) @ q
    # The repeated heads' gradients summed onto their key/value head.
    dk = dkr.reshape(B, nh // n_rep, n_rep, T, hd).sum(axis=2)
    dv = dvr.reshape(B, nh // n_rep, n_rep, T, hd).sum(axis=2)
    return dq, dk, dv


def heads(x, n, hd):
    """[B, T, n*hd] -> [B, n, T, hd]."""
    B, T, _ = x.shape
    return x.reshape(B, T, n, hd).transpose(0, 2, 1, 3)


def merge(x):
    """[B, n, T, hd] -> [B, T, n*hd]."""
    B, n, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, n * hd)


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def block_forward(params, cfg: LlamaConfig, i, x, cos, sin):
    p = f"model.layers.{i}."
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = {"x": x}
    h, c["ln1"] = rmsnorm_forward(x, params[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    c["h"] = h
    q = heads(linear_forward(h, params[p + "self_attn.q_proj.weight"]), nh, hd)
    k = heads(linear_forward(h, params[p + "self_attn.k_proj.weight"]), nkv, hd)
    v = heads(linear_forward(h, params[p + "self_attn.v_proj.weight"]), nkv, hd)
    y, c["att"] = attention_forward(rope_forward(q, cos, sin), rope_forward(k, cos, sin), v, nh // nkv)
    c["y"] = merge(y)
    x2 = x + linear_forward(c["y"], params[p + "self_attn.o_proj.weight"])
    c["x2"] = x2
    h2, c["ln2"] = rmsnorm_forward(x2, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    c["h2"] = h2
    c["gate"] = linear_forward(h2, params[p + "mlp.gate_proj.weight"])
    c["up"] = linear_forward(h2, params[p + "mlp.up_proj.weight"])
    c["act"] = swiglu_forward(c["gate"], c["up"])
    out = x2 + linear_forward(c["act"], params[p + "mlp.down_proj.weight"])
    return out, c


def block_backward(params, cfg: LlamaConfig, i, dout, c, cos, sin, grads):
    p = f"model.layers.{i}."
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # MLP: out = x2 + down(swiglu(gate(h2), up(h2)))
    dact, grads[p + "mlp.down_proj.weight"] = linear_backward(dout, c["act"], params[p + "mlp.down_proj.weight"])
    dgate, dup = swiglu_backward(dact, c["gate"], c["up"])
    dh2_g, grads[p + "mlp.gate_proj.weight"] = linear_backward(dgate, c["h2"], params[p + "mlp.gate_proj.weight"])
    dh2_u, grads[p + "mlp.up_proj.weight"] = linear_backward(dup, c["h2"], params[p + "mlp.up_proj.weight"])
    dx2, grads[p + "post_attention_layernorm.weight"] = rmsnorm_backward(
        dh2_g + dh2_u, params[p + "post_attention_layernorm.weight"], c["ln2"])
    dx2 = dx2 + dout
    # Attention: x2 = x + o(attention(rope(q(h)), rope(k(h)), v(h)))
    dy, grads[p + "self_attn.o_proj.weight"] = linear_backward(dx2, c["y"], params[p + "self_attn.o_proj.weight"])
    dqr, dkr, dv = attention_backward(heads(dy, nh, hd), c["att"])
    dq, dk = rope_backward(dqr, cos, sin), rope_backward(dkr, cos, sin)
    dh = np.zeros_like(c["h"])
    for name, d in (("q_proj", dq), ("k_proj", dk), ("v_proj", dv)):
        dpart, grads[p + f"self_attn.{name}.weight"] = linear_backward(
            merge(d), c["h"], params[p + f"self_attn.{name}.weight"])
        dh += dpart
    dx, grads[p + "input_layernorm.weight"] = rmsnorm_backward(dh, params[p + "input_layernorm.weight"], c["ln1"])
    return dx + dx2


def forward(params, cfg: LlamaConfig, inputs, targets=None):
    """Returns (loss or None, logits, cache)."""
    B, T = inputs.shape
    assert T <= cfg.max_position_embeddings
    cos, sin = rope_cos_sin(T, cfg.head_dim, cfg.rope_theta)
    x = params["model.embed_tokens.weight"][inputs]
    blocks = []
    for i in range(cfg.num_hidden_layers):
        x, c = block_forward(params, cfg, i, x, cos, sin)
        blocks.append(c)
    hf, lnf = rmsnorm_forward(x, params["model.norm.weight"], cfg.rms_norm_eps)
    logits = linear_forward(hf, head_weight(params, cfg))
    cache = {"inputs": inputs, "targets": targets, "cos": cos, "sin": sin, "blocks": blocks,
             "hf": hf, "lnf": lnf}
    loss = None
    if targets is not None:
        loss, cache["probs"] = crossentropy_forward(logits, targets)
    return loss, logits, cache


def backward(params, cfg: LlamaConfig, cache):
    grads = {}
    dlogits = crossentropy_backward(cache["probs"], cache["targets"])
    dhf, dhead = linear_backward(dlogits, cache["hf"], head_weight(params, cfg))
    dx, grads["model.norm.weight"] = rmsnorm_backward(dhf, params["model.norm.weight"], cache["lnf"])
    for i in reversed(range(cfg.num_hidden_layers)):
        dx = block_backward(params, cfg, i, dx, cache["blocks"][i], cache["cos"], cache["sin"], grads)
    demb = np.zeros_like(params["model.embed_tokens.weight"])
    np.add.at(demb, cache["inputs"], dx)
    if cfg.tie_word_embeddings:
        demb += dhead
    else:
        grads["lm_head.weight"] = dhead
    grads["model.embed_tokens.weight"] = demb
    return grads


def loss_and_grads(params, cfg, window):
    inputs, targets = split_batch(window)
    loss, logits, cache = forward(params, cfg, inputs, targets)
    return loss, logits, backward(params, cfg, cache)


# --------------------------------------------------------------------------
# self-test: finite differences
# --------------------------------------------------------------------------

# The finite-difference step of the whole-model checks: 3e-4, not gpt2_ref's 1e-3. At 10x the
# usual init the GQA model's truncation error at 1e-3 reaches 9e-6 on a few elements (it falls
# as h^4: 4e-9 at 3e-4), while the rounding noise of the differences stays near
# eps * loss / h ~ 1e-12.
FD_STEP = 3e-4


def check_ops(rng):
    """The single ops' backward functions against central differences (h = 1e-5)."""
    h, ok = 1e-5, True

    def numeric(f, x, dy):
        g = np.zeros_like(x)
        flat, gf = x.reshape(-1), g.reshape(-1)
        for j in range(flat.size):
            o = flat[j]
            flat[j] = o + h
            fp = np.sum(f(x) * dy)
            flat[j] = o - h
            fm = np.sum(f(x) * dy)
            flat[j] = o
            gf[j] = (fp - fm) / (2 * h)
        return g

    def report(name, a, n):
        nonlocal ok
        err = np.max(np.abs(a - n)) / max(np.max(np.abs(n)), 1e-12)
        ok &= err < 1e-7
        print(f"  {'ok' if err < 1e-7 else 'FAIL':4s} {name:28s} max rel err {err:.2e}")

    x = rng.standard_normal((2, 3, 8))
    w = 1.0 + 0.3 * rng.standard_normal(8)
    dy = rng.standard_normal(x.shape)
    _, c = rmsnorm_forward(x, w, 1e-5)
    dx, dw = rmsnorm_backward(dy, w, c)
    report("rmsnorm dx", dx, numeric(lambda t: rmsnorm_forward(t, w, 1e-5)[0], x, dy))
    report("rmsnorm dw", dw, numeric(lambda t: rmsnorm_forward(x, t, 1e-5)[0], w, dy))
    g, u = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
    dy = rng.standard_normal(g.shape)
    dg, du = swiglu_backward(dy, g, u)
    report("swiglu dgate", dg, numeric(lambda t: swiglu_forward(t, u), g, dy))
    report("swiglu dup", du, numeric(lambda t: swiglu_forward(g, t), u, dy))
    cos, sin = rope_cos_sin(5, 6, 100.0)
    x = rng.standard_normal((2, 3, 5, 6))
    dy = rng.standard_normal(x.shape)
    report("rope", rope_backward(dy, cos, sin), numeric(lambda t: rope_forward(t, cos, sin), x, dy))
    q, k, v = (rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 5, 3)),
               rng.standard_normal((2, 2, 5, 3)))
    dy = rng.standard_normal(q.shape)
    _, c = attention_forward(q, k, v, 2)
    dq, dk, dv = attention_backward(dy, c)
    report("gqa attention dq", dq, numeric(lambda t: attention_forward(t, k, v, 2)[0], q, dy))
    report("gqa attention dk", dk, numeric(lambda t: attention_forward(q, t, v, 2)[0], k, dy))
    report("gqa attention dv", dv, numeric(lambda t: attention_forward(q, k, t, 2)[0], v, dy))
    return ok


def tiny_configs():
    """A GQA model with an untied head and head_dim * heads != hidden_size, and an MHA model
    with a tied one."""
    gqa = LlamaConfig(vocab_size=13, max_position_embeddings=8, hidden_size=8, intermediate_size=12,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                      rms_norm_eps=1e-5, rope_theta=100.0, tie_word_embeddings=False)
    mha = LlamaConfig(vocab_size=11, max_position_embeddings=8, hidden_size=8, intermediate_size=10,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    return {"gqa-untied": gqa, "mha-tied": mha}


def selftest():
    this = sys.modules[__name__]
    rng = np.random.default_rng(0)
    ok = check_ops(rng)
    for label, cfg in tiny_configs().items():
        # 10x the usual std, so that attention, SwiGLU and the norms are clearly nonlinear.
        params = init_params(cfg, rng, std=0.2, norm_jitter=0.3)
        window = rng.integers(0, cfg.vocab_size, size=(2, 7))
        ok &= gpt2_ref.fd_check(cfg, params, window, rng, per_tensor=None, h=FD_STEP, label=label,
                                model=this)
        hp = dict(lr=1e-2, min_lr=1e-3, warmup_steps=1, steps=3, schedule="cosine", beta1=0.9,
                  beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
        losses, _, _ = gpt2_ref.train(params, cfg, window, 3, hp, model=this)
        fell = losses[-1] < losses[0]
        ok &= fell
        print(f"[{label}] 3 AdamW steps: losses {[f'{x:.6f}' for x in losses]}: {'ok' if fell else 'FAIL'}")
    print("selftest:", "PASS" if ok else "FAIL")
    return ok


# --------------------------------------------------------------------------
# cross-check with transformers
# --------------------------------------------------------------------------

def check_transformers():
    """Loss, logits and every gradient against transformers' LlamaForCausalLM in float64,
    with its float32 RMSNorm, RoPE and softmax lifted to float64."""
    try:
        import torch
        import transformers
        from transformers.models.llama import modeling_llama as ml
    except ImportError as e:
        print(f"skipped: torch/transformers not importable ({e})")
        return True

    class RMSNorm64(torch.nn.Module):
        """LlamaRMSNorm without its float32 cast."""

        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def rotary64(self, x, position_ids):
        """LlamaRotaryEmbedding.forward in float64 (its frequencies are computed in float32)."""
        hd = self.config.head_dim
        theta = self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """eager_attention_forward with the softmax in the inputs' dtype (it forces float32)."""
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.nn.functional.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    ml.LlamaRMSNorm = RMSNorm64
    ml.LlamaRotaryEmbedding.forward = rotary64
    ml.eager_attention_forward = eager64
    rng = np.random.default_rng(1)
    ok = True
    for label, cfg in tiny_configs().items():
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, mlp_bias=False,
            attn_implementation="eager")
        model = ml.LlamaForCausalLM(hf_cfg).to(torch.float64)
        params = init_params(cfg, rng, std=0.2, norm_jitter=0.3)
        state = {n: torch.tensor(v) for n, v in params.items()}
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            print(f"[{label}] FAIL: missing {missing}, unexpected {unexpected}")
            ok = False
            continue
        window = rng.integers(0, cfg.vocab_size, size=(2, 7))
        inputs, targets = split_batch(window)
        loss, logits, grads = loss_and_grads(params, cfg, window)
        out = model(input_ids=torch.tensor(inputs))
        tl = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), torch.tensor(targets).reshape(-1))
        tl.backward()
        errs = {"loss": abs(tl.item() - loss),
                "logits": float(np.max(np.abs(out.logits.detach().numpy() - logits)))}
        for n, p in model.named_parameters():
            errs[n] = float(np.max(np.abs(p.grad.numpy() - grads[n])))
        worst = max(errs.values())
        ok &= worst < 1e-10
        print(f"[{label}] transformers {transformers.__version__}: max |difference| {worst:.2e} "
              f"over loss, logits and {len(errs) - 2} gradients: {'ok' if worst < 1e-10 else 'FAIL'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--check-transformers", action="store_true")
    a = ap.parse_args(argv)
    if not (a.selftest or a.check_transformers):
        ap.print_help()
        return 2
    ok = True
    if a.selftest:
        ok &= selftest()
    if a.check_transformers:
        ok &= check_transformers()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
