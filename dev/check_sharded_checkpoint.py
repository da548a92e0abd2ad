#!/usr/bin/env python3
"""Check that a sharded fugu checkpoint loads in Hugging Face transformers.

Usage: dev/check_sharded_checkpoint.py CKPT [REFERENCE_CKPT] [--greedy PROMPT N EXPECTED_FILE]

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
  * transformers: AutoModelForCausalLM.from_pretrained(CKPT) (GPT2LMHeadModel or
    LlamaForCausalLM, from config.json) loads with no missing or unexpected
    weights, and every parameter equals the tensor in the shards (lm_head tied
    to the embedding when the config says so, a tensor of its own otherwise);
  * a forward pass on a few tokens gives finite logits;
  * with REFERENCE_CKPT (a single-file checkpoint of the same model and step,
    e.g. the same run on one process): every weight is equal to within 1e-5 and
    so are the logits;
  * with --greedy PROMPT N EXPECTED_FILE: the checkpoint's own tokenizer
    (AutoTokenizer) encodes PROMPT (no special tokens), `generate` adds N tokens
    greedily, and the decoded text must equal EXPECTED_FILE's contents with the
    final newline removed (what `fugu sample --checkpoint CKPT --prompt PROMPT
    --max-tokens N --temperature 0` printed).

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
    args = sys.argv[1:]
    greedy = None
    if "--greedy" in args:
        i = args.index("--greedy")
        if len(args) < i + 4:
            print(__doc__)
            sys.exit(2)
        greedy = (args[i + 1], int(args[i + 2]), args[i + 3])
        del args[i:i + 4]
    if len(args) not in (1, 2):
        print(__doc__)
        sys.exit(2)
    ckpt = args[0]
    ref = args[1] if len(args) == 2 else None
    try:
        import numpy as np
        import torch
        from safetensors.numpy import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
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

    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt, local_files_only=True, output_loading_info=True
    )
    tied = model.config.tie_word_embeddings
    missing = [k for k in info["missing_keys"]
               if not k.endswith(".attn.bias") and not (tied and k == "lm_head.weight")]
    if missing or info["unexpected_keys"]:
        fail(f"missing {missing}, unexpected {info['unexpected_keys']}")
    sd = model.state_dict()
    for k, t in stored.items():
        name = k if k in sd else k.removeprefix("transformer.")
        got = sd[name].detach().cpu().numpy()
        if got.shape != t.shape or not np.array_equal(got, t):
            fail(f"{k}: transformers holds a different tensor than the shard")
    embedding = model.get_input_embeddings().weight
    if tied and not torch.equal(model.lm_head.weight, embedding):
        fail("lm_head is not tied to the embedding")
    if not tied and "lm_head.weight" not in stored:
        fail("untied model, but the shards hold no lm_head.weight")
    print(f"transformers: {type(model).__name__}, lm_head {'tied' if tied else 'untied'}")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits).all():
        fail("non-finite logits")
    print(f"transformers: {sum(p.numel() for p in model.parameters())} parameters loaded, logits finite")

    if ref:
        other = AutoModelForCausalLM.from_pretrained(ref, local_files_only=True)
        osd = other.state_dict()
        worst = 0.0
        for k, t in sd.items():
            worst = max(worst, (t - osd[k]).abs().max().item())
        with torch.no_grad():
            dl = (other(ids).logits - logits).abs().max().item()
        print(f"against {ref}: max |dweight| {worst:.3e}, max |dlogit| {dl:.3e}")
        if worst > 1e-5 or dl > 1e-4:
            fail("the sharded and the reference checkpoints differ")
    if greedy:
        prompt, n, expected_file = greedy
        tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            # Both stop at the end-of-text token (generation_config.json's eos_token_id), which
            # fugu does not print.
            out = model.generate(ids, max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        with open(expected_file) as f:
            want = f.read().removesuffix("\n")
        print(f"greedy ({out.shape[1] - ids.shape[1]} new tokens): {text!r}")
        if text != want:
            fail(f"transformers' greedy text differs from fugu's: {want!r}")
        print("greedy text identical to fugu sample --temperature 0")
    print("ok")


if __name__ == "__main__":
    main()
