//! fugu-io: tokenizer, tar shards and the training-data loader.
