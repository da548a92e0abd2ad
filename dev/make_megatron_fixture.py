#!/usr/bin/env python3
"""Writes a tiny Megatron-LM indexed dataset with Megatron's own builder (megatron-core's
`IndexedDatasetBuilder`): OUT/tiny_text_document.{bin,idx} (uint16, as Megatron's
preprocess_data.py writes for vocabularies under 65,500) and OUT/wide_text_document.{bin,idx}
(int32). The documents' ids are `ids()`: io/tests/io_loader.rs reads them back as one stream.
"""
import os
import sys

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

SIZES = [300, 500, 200]


def ids():
    return [(t * 13) % 4000 for t in range(sum(SIZES))]


def main(out):
    os.makedirs(out, exist_ok=True)
    for name, dtype in [("tiny_text_document", np.uint16), ("wide_text_document", np.int32)]:
        prefix = os.path.join(out, name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        start = 0
        for size in SIZES:
            builder.add_document(torch.tensor(ids()[start:start + size]), [size])
            start += size
        builder.finalize(prefix + ".idx")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/megatron")
