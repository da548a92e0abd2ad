#!/usr/bin/env python3
"""Writes tests/fixtures/llama-tokenizer/: a Llama-style tokenizer made the way Llama, Mistral
and LLM-jp make theirs, and the ids it must give.

A SentencePiece BPE model is trained on the bundled Shakespeare corpus with Llama's settings
(byte fallback, digits split, a dummy prefix, no normalisation, <unk>/<s>/</s> as ids 0/1/2),
then converted by transformers' own converter (LlamaTokenizer from the .model file) and saved
with save_pretrained: the tokenizer.json is the byte-fallback BPE format those models ship
(`model.byte_fallback: true`, `<0x00>`..`<0xFF>` tokens, a `▁` space marker, a decoder of
Replace/ByteFallback/Fuse/Strip). expected_ids.json lists texts with the ids transformers'
tokenizer gives them (no special tokens added); the script checks that they decode back to
the text and that SentencePiece itself agrees except on runs of spaces (where converted
tokenizers are known to differ), and the Rust tests (io/tests/io_tokenizer.rs) check fugu
against the file.

Usage: dev/make_llama_tokenizer.py [OUT_DIR]   (needs sentencepiece, transformers, tokenizers)
"""

import json
import os
import sys
import tarfile
import tempfile

VOCAB = 1000
TEXTS = [
    "Hello world",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "  two leading spaces, trailing ones   ",
    "\nstarts with a newline\n\nand has a blank line",
    "digits 1234567 and 3.14159",
    "unicode: café, naïve, Ærø, 日本語のテキスト, emoji 🎉🐟",
    "tabs\tand\u00a0no-break spaces",
    "",
    " ",
    "KING HENRY V.\nO for a Muse of fire, that would ascend\nThe brightest heaven of invention!",
]


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests/fixtures/llama-tokenizer")
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(os.path.join(root, "data/shakespeare.tar.gz")) as tar:
            tar.extractall(tmp, filter="data")
        files = sorted(
            os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.endswith(".txt"))
        prefix = os.path.join(tmp, "sp")
        spm.SentencePieceTrainer.train(
            input=",".join(files), model_prefix=prefix, model_type="bpe", vocab_size=VOCAB,
            byte_fallback=True, split_digits=True, add_dummy_prefix=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, max_sentencepiece_length=16,
            character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, num_threads=2, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        spdir = os.path.join(tmp, "spdir")
        os.makedirs(spdir)
        os.replace(prefix + ".model", os.path.join(spdir, "tokenizer.model"))
        with open(os.path.join(spdir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": False,
                       "add_bos_token": False, "add_eos_token": False}, f)
        hf = LlamaTokenizer.from_pretrained(spdir, local_files_only=True)
        os.makedirs(out, exist_ok=True)
        hf.save_pretrained(out)
    for extra in ("special_tokens_map.json", "tokenizer.model", "chat_template.jinja"):
        path = os.path.join(out, extra)
        if os.path.exists(path):
            os.remove(path)
    cases, differ = [], []
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False).input_ids
        # A text that starts with a space loses it (the decoder strips the `▁` prefix that
        # encoding adds only when the text does not start with one): as in Llama's own.
        if hf.decode(ids) != (text[1:] if text.startswith(" ") else text):
            sys.exit(f"transformers does not decode its ids for {text!r} back to the text")
        if ids != sp.encode(text):
            differ.append(text)
        cases.append({"text": text, "ids": ids})
    if len(differ) > 2:
        sys.exit(f"transformers and SentencePiece differ on {differ}")
    with open(os.path.join(out, "expected_ids.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n")
    print(f"wrote {out}: {len(sp)} ids, {len(cases)} texts; SentencePiece itself gives other "
          f"ids for {differ} (runs of spaces: a known difference of the converted tokenizer)")


if __name__ == "__main__":
    main()
