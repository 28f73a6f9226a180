"""Small tokenizer files of every kind, trained here in milliseconds: nothing is downloaded."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from yatrain.data.tokenizer_export import byte_to_unicode
from yatrain.data.tokenizer_tiktoken import PATTERN

SENTENCE = (
    "the model reads tokens from a packed stream and every sequence shares its boundary "
    "token with the next one so that resuming a run never repeats data while gradients "
    "accumulate over micro batches across ranks"
)
WORDS = SENTENCE.split(" ")


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


def _byte_level_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_tiktoken(path: Path, texts: list[str] | None = None, vocab_size: int = 600) -> Path:
    """A tiktoken BPE ranks file (Llama 3's tokenizer.model format) trained on ``texts``."""
    from_char = {c: b for b, c in byte_to_unicode().items()}
    vocab = _byte_level_bpe(texts or sample_texts(), vocab_size).get_vocab()
    lines = []
    for token, rank in sorted(vocab.items(), key=lambda item: item[1]):
        raw = bytes(from_char[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {rank}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


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
    tokenizer = _byte_level_bpe(texts or sample_texts(), vocab_size)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<pad>")]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return folder / "tokenizer.json"
