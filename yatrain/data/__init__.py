"""Tokenized data: raw documents -> sentencepiece tokens -> sharded files -> global batches."""

from yatrain.data.corpus import default_corpus_files, iter_documents
from yatrain.data.loader import GlobalBatchLoader
from yatrain.data.shards import TokenShards, prepare_data
from yatrain.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "GlobalBatchLoader",
    "TokenShards",
    "Tokenizer",
    "default_corpus_files",
    "iter_documents",
    "prepare_data",
    "train_tokenizer",
]
