"""Tokenized data: raw documents -> tokens -> sharded files -> global batches.

The names below load their module on first use (PEP 562): a run that reads tokenized shards
never imports the readers (pyarrow, zstandard) or the tokenizer libraries (tokenizers,
tiktoken, sentencepiece) that preparing data needs, and ``yatrain --help`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "BatchLoader": "loader",
    "Corpus": "corpus",
    "GlobalBatchLoader": "loader",
    "MicroBatch": "batch",
    "MixtureLoader": "mixture",
    "TokenShards": "shards",
    "Tokenizer": "tokenizer",
    "build_loader": "build",
    "default_corpus_files": "corpus",
    "document_layout": "documents",
    "export_tokenizer": "tokenizer_export",
    "iter_documents": "corpus",
    "load_tokenizer": "tokenizer_formats",
    "prepare_data": "prepare",
    "train_tokenizer": "tokenizer_sentencepiece",
}

if TYPE_CHECKING:  # the same names, for type checkers (a run imports each on first use)
    from yatrain.data.batch import MicroBatch
    from yatrain.data.build import build_loader
    from yatrain.data.corpus import Corpus, default_corpus_files, iter_documents
    from yatrain.data.documents import document_layout
    from yatrain.data.loader import BatchLoader, GlobalBatchLoader
    from yatrain.data.mixture import MixtureLoader
    from yatrain.data.prepare import prepare_data
    from yatrain.data.shards import TokenShards
    from yatrain.data.tokenizer import Tokenizer
    from yatrain.data.tokenizer_export import export_tokenizer
    from yatrain.data.tokenizer_formats import load_tokenizer
    from yatrain.data.tokenizer_sentencepiece import train_tokenizer

__all__ = [
    "BatchLoader",
    "Corpus",
    "GlobalBatchLoader",
    "MicroBatch",
    "MixtureLoader",
    "TokenShards",
    "Tokenizer",
    "build_loader",
    "default_corpus_files",
    "document_layout",
    "export_tokenizer",
    "iter_documents",
    "load_tokenizer",
    "prepare_data",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'yatrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"yatrain.data.{_HOME[name]}"), name)
