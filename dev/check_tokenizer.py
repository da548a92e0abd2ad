#!/usr/bin/env python3
"""Check that fugu's Hugging Face tokenizer files load in Python.

Usage: dev/check_tokenizer.py DIR [TEXT_FILE]

DIR holds the files fugu writes next to a checkpoint (tokenizer.json,
vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json) and
optionally expected_ids.json, a list of {"text": ..., "ids": [...]} written by
the Rust side (the ignored test `write_python_check_fixture` in
io/tests/io_tokenizer.rs writes DIR/gpt2 and DIR/bpe-4096:

    FUGU_TOKENIZER_FIXTURE=/tmp/fx cargo test -p fugu-io --release \
        --test io_tokenizer -- --ignored write_python_check_fixture
    python3 dev/check_tokenizer.py /tmp/fx/gpt2
    python3 dev/check_tokenizer.py /tmp/fx/bpe-4096 some.txt

Checks, with each package that is importable:
  * tokenizers: Tokenizer.from_file(DIR/tokenizer.json) encodes every
    expected text to the expected ids (no special tokens added) and decodes
    back to the text;
  * transformers: AutoTokenizer.from_pretrained(DIR, local_files_only=True)
    (from tokenizer.json) and GPT2Tokenizer loaded from a copy of DIR without
    tokenizer.json (so from vocab.json + merges.txt) give the same ids; eos is
    <|endoftext|>; the `tokenizers` BPE built from vocab.json + merges.txt
    alone is checked the same way.
  * TEXT_FILE: its text encodes the same with every loaded tokenizer and
    decodes back to itself.

Special-token strings in the expected texts: fugu encodes `<|endoftext|>`
inside text as plain text, while the Hugging Face tokenizers map it to the
special id by default; the check asks for fugu's behaviour
(`encode_special_tokens = True` in `tokenizers`, `split_special_tokens=True`
in transformers), or skips those texts where the installed version cannot.

Exits 0 and prints `skipped: <reason>` when neither package is installed;
exits 1 on any mismatch.
"""

import json
import os
import sys

EOT = "<|endoftext|>"


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    d = argv[1]
    text_file = argv[2] if len(argv) > 2 else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        tokenizers = None
    try:
        import transformers  # noqa: F401
    except ImportError:
        transformers = None
    if tokenizers is None and transformers is None:
        print("skipped: neither `tokenizers` nor `transformers` is installed")
        return 0

    expected = []
    p = os.path.join(d, "expected_ids.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            expected = json.load(f)
    extra = None
    if text_file:
        with open(text_file, encoding="utf-8") as f:
            extra = f.read()

    failures = 0
    encoders = {}  # name -> (encode(text) -> ids, decode(ids) -> text, splits specials)

    if tokenizers is not None:
        tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        # fugu encodes special-token strings in text as plain text.
        specials_plain = hasattr(tok, "encode_special_tokens")
        if specials_plain:
            tok.encode_special_tokens = True
        print(f"tokenizers {tokenizers.__version__}: vocab {tok.get_vocab_size()}, "
              f"{EOT} = {tok.token_to_id(EOT)}")
        encoders["tokenizers"] = (
            lambda t: tok.encode(t, add_special_tokens=False).ids,
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            specials_plain,
        )
        # The same BPE built from vocab.json + merges.txt alone.
        from tokenizers import decoders, models, pre_tokenizers
        vm = tokenizers.Tokenizer(models.BPE.from_file(os.path.join(d, "vocab.json"),
                                                       os.path.join(d, "merges.txt")))
        vm.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        vm.decoder = decoders.ByteLevel()
        vm.add_special_tokens([EOT])
        if specials_plain:
            vm.encode_special_tokens = True
        encoders["tokenizers(vocab.json+merges.txt)"] = (
            lambda t: vm.encode(t, add_special_tokens=False).ids,
            lambda ids: vm.decode(ids, skip_special_tokens=False),
            specials_plain,
        )

    if transformers is not None:
        from transformers import AutoTokenizer, GPT2Tokenizer

        fast = AutoTokenizer.from_pretrained(d, local_files_only=True)
        # GPT2Tokenizer from vocab.json + merges.txt only (no tokenizer.json).
        import shutil
        import tempfile
        vm_dir = tempfile.mkdtemp(prefix="fugu-tok-")
        for f in os.listdir(d):
            if f not in ("tokenizer.json", "expected_ids.json"):
                shutil.copy(os.path.join(d, f), vm_dir)
        slow = GPT2Tokenizer.from_pretrained(vm_dir, local_files_only=True)
        print(f"transformers {transformers.__version__}: AutoTokenizer -> "
              f"{type(fast).__name__}, vocab {len(fast)}, eos {fast.eos_token!r} = "
              f"{fast.eos_token_id}, model_max_length {fast.model_max_length}")
        if fast.eos_token != EOT or slow.eos_token != EOT:
            print(f"FAIL: eos token is {fast.eos_token!r}/{slow.eos_token!r}, expected {EOT!r}")
            failures += 1
        for name, t in (("AutoTokenizer", fast),
                        ("GPT2Tokenizer(vocab.json+merges.txt)", slow)):
            encoders[name] = (
                (lambda t: lambda s: t(s, add_special_tokens=False,
                                       split_special_tokens=True)["input_ids"])(t),
                (lambda t: lambda ids: t.decode(ids, skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False))(t),
                True,
            )

    for name, (enc, dec, splits_specials) in encoders.items():
        ok = 0
        skipped = 0
        for i, case in enumerate(expected):
            text, want = case["text"], case["ids"]
            if EOT in text and not splits_specials:
                skipped += 1
                continue
            got = enc(text)
            if got != want:
                k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                print(f"FAIL {name}: text {i} {text[:60]!r}: ids differ at {k}: "
                      f"{got[k:k + 8]} vs expected {want[k:k + 8]}")
                failures += 1
                continue
            back = dec(got)
            if back != text:
                print(f"FAIL {name}: text {i} {text[:60]!r}: decodes to {back[:60]!r}")
                failures += 1
                continue
            ok += 1
        note = f" ({skipped} with {EOT} in the text not compared)" if skipped else ""
        print(f"{name}: {ok}/{len(expected)} expected texts match{note}")
        if len(expected) and ok:
            print(f"  e.g. {expected[0]['text'][:40]!r} -> {enc(expected[0]['text'])[:12]}")

    if extra is not None:
        ref = None
        for name, (enc, dec, _) in encoders.items():
            ids = enc(extra)
            if ref is None:
                ref = (name, ids)
                print(f"{text_file}: {len(extra.encode())} bytes -> {len(ids)} tokens "
                      f"({len(ids) / max(1, len(extra.encode())):.4f} tokens/byte) with {name}")
            elif ids != ref[1]:
                print(f"FAIL {name}: {text_file} encodes differently from {ref[0]}")
                failures += 1
            if dec(ids) != extra:
                print(f"FAIL {name}: {text_file} does not round-trip")
                failures += 1

    if failures:
        print(f"{failures} failure(s)")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
