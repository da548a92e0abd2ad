#!/usr/bin/env python3
"""Hugging Face fixtures for fugu's checkpoint module (src/checkpoint/), and a check that
`transformers` loads what fugu writes.

    python3 dev/make_hf_fixture.py                # rewrite tests/fixtures/hf-tiny*/
    python3 dev/make_hf_fixture.py --verify DIR   # GPT2LMHeadModel.from_pretrained(DIR) must
                                                  # reproduce tests/fixtures/hf-tiny exactly

Needs torch, transformers, safetensors and numpy (see dev/README.md). The Rust tests only
read the committed files; they never run Python.

Fixtures (a randomly initialised GPT2LMHeadModel: vocab 101, n_positions 16, n_embd 32,
n_head 4, n_layer 2):

  hf-tiny/          save_pretrained(safe_serialization=True): F32, `transformer.` keys
  hf-tiny-bf16/     the same model cast to bfloat16, save_pretrained
  hf-tiny-hub-f16/  the layout of the original hub `gpt2` files: unprefixed keys, causal-mask
                    buffers `h.N.attn.bias` (F32 [1, 1, P, P]) and `h.N.attn.masked_bias`
                    (F32 scalar), hub-style config.json (n_ctx, task_specific_params); the
                    weights in float16, written with safetensors.torch.save_file
"""

import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SIZES = dict(vocab_size=101, n_positions=16, n_embd=32, n_head=4, n_layer=2)


def model():
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(**SIZES))
    m.eval()
    return m


def save_hf(m, out):
    shutil.rmtree(out, ignore_errors=True)
    m.save_pretrained(out, safe_serialization=True)
    # Not part of the model; fugu neither reads nor writes it.
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)


def save_hub_style(m, out):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    p = SIZES["n_positions"]
    sd = {}
    for k, v in m.state_dict().items():
        if k == "lm_head.weight":
            continue
        sd[k.removeprefix("transformer.")] = v.detach().to(torch.float16).contiguous()
    mask = torch.tril(torch.ones(p, p)).view(1, 1, p, p)
    for layer in range(SIZES["n_layer"]):
        sd[f"h.{layer}.attn.bias"] = mask.clone()
        sd[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": p,
        "n_embd": SIZES["n_embd"],
        "n_head": SIZES["n_head"],
        "n_layer": SIZES["n_layer"],
        "n_positions": p,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": SIZES["vocab_size"],
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def make():
    m = model()
    save_hf(m, os.path.join(FIXTURES, "hf-tiny"))
    save_hf(model().to(torch.bfloat16), os.path.join(FIXTURES, "hf-tiny-bf16"))
    save_hub_style(m, os.path.join(FIXTURES, "hf-tiny-hub-f16"))
    for d in sorted(os.listdir(FIXTURES)):
        if d.startswith("hf-tiny"):
            for f in sorted(os.listdir(os.path.join(FIXTURES, d))):
                size = os.path.getsize(os.path.join(FIXTURES, d, f))
                print(f"tests/fixtures/{d}/{f}: {size} bytes")
    # Each variant must load in transformers too.
    for d in ["hf-tiny-bf16", "hf-tiny-hub-f16"]:
        load(os.path.join(FIXTURES, d))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


def load(path):
    m, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    # transformers lists the hub file's causal-mask buffers as unexpected and ignores them.
    problems.pop("unexpected_keys", None) if path.endswith("hub-f16") else None
    if problems:
        sys.exit(f"{path}: transformers reported {problems}")
    return m.eval()


def verify(path):
    ref = model()
    got = load(path)
    assert got.config.vocab_size == SIZES["vocab_size"] and got.config.n_layer == 2
    assert got.lm_head.weight.data_ptr() == got.transformer.wte.weight.data_ptr(), "not tied"
    rsd, gsd = ref.state_dict(), got.state_dict()
    assert rsd.keys() == gsd.keys(), (rsd.keys() ^ gsd.keys())
    for k in rsd:
        if not torch.equal(rsd[k], gsd[k]):
            sys.exit(f"{path}: tensor {k} differs from the fixture model")
    x = torch.randint(0, SIZES["vocab_size"], (2, SIZES["n_positions"]))
    with torch.no_grad():
        if not torch.equal(ref(x).logits, got(x).logits):
            sys.exit(f"{path}: logits differ")
    print(f"OK: GPT2LMHeadModel.from_pretrained({path}) loads fugu's files: "
          f"{len(gsd)} tensors and the logits equal the fixture model's "
          f"(transformers {transformers.__version__})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verify", metavar="DIR", help="check a directory written by fugu")
    args = ap.parse_args()
    if args.verify:
        verify(args.verify)
    else:
        make()
