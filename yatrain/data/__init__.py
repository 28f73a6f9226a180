"""Tokenized data: raw documents -> tokens -> sharded files -> global batches."""

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
