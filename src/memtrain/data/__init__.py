"""Data pipeline: text source -> GPT-2 tokens -> cached train/validation split -> batches.

    splits = prepare_splits(cfg.data)                       # cached on disk, memory-mapped
    check_split_documents(splits, cfg.data)                 # each split holds a document
    loader = make_train_loader(splits.train, seq_len, batch_size, seed)
    x, y = loader.next_batch()                              # resumable: loader.state_dict()
    val = make_val_batches(splits.val, seq_len, cfg.data.val_blocks, batch_size)
"""

from memtrain.data.cache import FORMAT_VERSION, TokenSplits, cache_key, cache_root, prepare_tokens
from memtrain.data.default_corpus import default_documents
from memtrain.data.html_text import html_to_text
from memtrain.data.loader import (
    BlockDataset,
    ResumableBatchSampler,
    TrainLoader,
    check_split_documents,
    make_train_loader,
    make_val_batches,
)
from memtrain.data.sources import data_fingerprint, iter_documents, source_identity
from memtrain.data.tokenizer import EOT_ID, N_VOCAB, TOKENIZER_NAME, encode_batch, get_tokenizer
from memtrain.data.validation import check_val_tokens, prepare_splits, same_source_warning, validation_source_name

__all__ = [
    "BlockDataset",
    "EOT_ID",
    "FORMAT_VERSION",
    "N_VOCAB",
    "ResumableBatchSampler",
    "TOKENIZER_NAME",
    "TokenSplits",
    "TrainLoader",
    "cache_key",
    "cache_root",
    "check_split_documents",
    "check_val_tokens",
    "data_fingerprint",
    "default_documents",
    "encode_batch",
    "get_tokenizer",
    "html_to_text",
    "iter_documents",
    "make_train_loader",
    "make_val_batches",
    "prepare_splits",
    "prepare_tokens",
    "same_source_warning",
    "source_identity",
    "validation_source_name",
]
