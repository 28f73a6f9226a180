"""Small tokenizer files of every kind, trained here in milliseconds: nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken

from yatrain.testing.bpe import byte_level_bpe, write_tiktoken_ranks

SENTENCE = (
    "the model reads tokens from a packed stream and every sequence shares its boundary "
    "token with the next one so that resuming a run never repeats data while gradients "
    "accumulate over micro batches across ranks"
)
WORDS = SENTENCE.split(" ")

# Meta's Llama 3 split pattern, copied character for character from its llama/tokenizer.py:
# the reference the module's own PATTERN is checked against (never built from it).
META_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501


def sample_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Varied text: prose, indented code, digits, accents, CJK, emoji, blank lines."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15)))
        out.append(
            f"{words.capitalize()}.\n    x_{i} = f({rng.randint(0, 99999)}, '{words[:12]}')\n"
            f"\tcafé naïve – 東京 {rng.random():.4f} 🙂\n\n# {words}  "
        )
    return out


def write_tiktoken(path: Path, texts: list[str] | None = None, vocab_size: int = 600) -> Path:
    """A tiktoken BPE ranks file (Llama 3's tokenizer.model format) trained on ``texts``."""
    return write_tiktoken_ranks(byte_level_bpe(texts or sample_texts(), vocab_size), path)


def write_hf(
    folder: Path,
    texts: list[str] | None = None,
    *,
    config: dict | None = None,
    special_map: dict | None = None,
    vocab_size: int = 500,
) -> Path:
    """A Hugging Face model directory: tokenizer.json (with <s> and </s> as special tokens),
    plus tokenizer_config.json / special_tokens_map.json when given."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_bpe(texts or sample_texts(), vocab_size)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<pad>")]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return folder / "tokenizer.json"
