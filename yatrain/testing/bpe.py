"""Tokenizers made on the spot, for tests and benchmarks that must not download one.

A byte-level BPE with Llama 3's pre-tokenization pattern, trained with ``tokenizers`` on any
text, and its vocabulary written in tiktoken's ``base64 rank`` format, the format of Llama
3's ``tokenizer.model``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFBackend

from yatrain.data.tokenizer_export import byte_to_unicode
from yatrain.data.tokenizer_tiktoken import PATTERN


def byte_level_bpe(texts: Iterable[str], vocab_size: int) -> HFBackend:
    """A byte-level BPE with Llama 3's pre-tokenization pattern, trained on ``texts``."""
    bpe = HFBackend(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return bpe


def write_tiktoken_ranks(bpe: HFBackend, out: Path) -> Path:
    """``bpe``'s vocabulary in tiktoken's ``base64 rank`` format (Llama 3's tokenizer.model)."""
    from_char = {c: b for b, c in byte_to_unicode().items()}
    ranked = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "".join(
            f"{base64.b64encode(bytes(from_char[c] for c in t)).decode()} {r}\n" for t, r in ranked
        )
    )
    return out
