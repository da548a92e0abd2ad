#!/usr/bin/env python3
"""Independent check of `fugu eval --choices`: scores a HellaSwag-layout JSONL file with
transformers (float64) on the checkpoint and compares each ending's mean loss with fugu's.

    python dev/check_choices.py CKPT QUESTIONS.jsonl FUGU_EVAL.json [--tol 1e-4]

FUGU_EVAL.json is `fugu eval CKPT --choices QUESTIONS.jsonl --format json`. The context is
[bos_token_id] + tokens(ctx) and each ending tokens(" " + ending), as docs/EVAL.md says (for
byte-level BPE tokenizers, where an ending's tokens do not depend on what precedes it).
Exits 1 when a mean loss differs by more than --tol or an answer differs.
"""
import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("questions")
    ap.add_argument("fugu_json")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, torch_dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    bos = model.config.bos_token_id
    fugu = json.load(open(a.fugu_json))["score"]
    worst, n = 0.0, 0
    with open(a.questions) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    for qi, q in enumerate(questions):
        ctx = [bos] + tok(q["ctx"], add_special_tokens=False).input_ids
        means = []
        for e in q["endings"]:
            end = tok(" " + e, add_special_tokens=False).input_ids
            ids = torch.tensor([ctx + end])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0], dim=-1)
            nll = [-logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(end)]
            means.append(sum(nll) / len(nll))
        for m, f_ in zip(means, fugu["mean_losses"][qi]):
            worst = max(worst, abs(m - f_))
            n += 1
    print(f"{len(questions)} questions, {n} endings: max |fugu - transformers float64| "
          f"mean loss {worst:.3e} (tol {a.tol})")
    sys.exit(0 if worst <= a.tol else 1)


if __name__ == "__main__":
    main()
