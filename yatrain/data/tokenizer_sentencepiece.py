"""sentencepiece models: Llama 2's ``tokenizer.model``, or one trained on the inputs.

The settings aim at exact round trips, ``decode(encode(text)) == text``, on code and prose:
no normalization, whitespace kept as-is (runs of spaces become pieces, which suits Python
indentation), no dummy leading space, and byte fallback so that any character the model
never saw (a newline included: training sees single lines) still encodes, as UTF-8 bytes.
The one exception is U+2581 "▁", which sentencepiece itself uses to stand for a space.
"""

import io
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from yatrain.data.tokenizer import Tokenizer, file_sha256
from yatrain.errors import DataError

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
MIN_VOCAB_SIZE = 260  # 256 byte pieces + 3 specials; each distinct character needs one more
_MAX_LINE_BYTES = 1 << 15  # longer lines (minified data, tables) would only slow training
_MAX_TRAINING_LINES = 2_000_000  # sentencepiece samples this many lines when given more


def _training_lines(documents: Iterable[str]) -> Iterator[str]:
    # sentencepiece learns from "sentences"; for code and prose a line is the natural one.
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip() and len(line.encode("utf-8")) <= _MAX_LINE_BYTES:
                yield line


def train_tokenizer(documents: Iterable[str], output_prefix: Path, vocab_size: int) -> Path:
    """Train a BPE model on the lines of ``documents``; returns ``<output_prefix>.model``.

    The same documents and vocab size give the same model file, byte for byte.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab size {vocab_size} is too small for a byte-fallback BPE tokenizer: "
            f"use at least {MIN_VOCAB_SIZE}"
        )
    model_path = Path(output_prefix).with_name(Path(output_prefix).name + ".model")
    # Train into memory: written to a prefix, the model would record that path in its
    # trainer spec and hash differently depending on where it was trained.
    model = io.BytesIO()
    spm.set_random_generator_seed(0)  # the line sampling below would otherwise vary per run
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(documents),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            num_threads=2,
            input_sentence_size=_MAX_TRAINING_LINES,
            shuffle_input_sentence=True,
            max_sentence_length=_MAX_LINE_BYTES,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            normalization_rule_name="identity",
            hard_vocab_limit=False,  # tiny corpora may not support the full vocab: use fewer
            minloglevel=2,
        )
    except RuntimeError as e:
        found = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if found:
            raise DataError(
                f"vocab size {vocab_size} cannot hold the {found.group(1)} byte, special and "
                f"character pieces this corpus needs: use at least {found.group(1)}"
            ) from None
        if "sentences_.empty()" in str(e):
            raise DataError("no text to train the tokenizer on: check the inputs") from None
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"tokenizer training failed ({message}): add more text or lower the vocab size"
        ) from None
    model_path.parent.mkdir(parents=True, exist_ok=True)
    model_path.write_bytes(model.getvalue())
    return model_path


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model; BOS/EOS are its control tokens, never produced from text."""

    kind = "sentencepiece"

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer model {self.path} not found: check the tokenizer path")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(str(self.path))
        except (OSError, RuntimeError):
            raise DataError(
                f"{self.path} is not a tokenizer: expected a sentencepiece model (Llama 2), "
                "a tiktoken BPE file (Llama 3's tokenizer.model) or a Hugging Face "
                "tokenizer.json"
            ) from None
        self.vocab_size = self.sp.vocab_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise DataError(
                f"tokenizer {self.path} has no bos/eos tokens, which mark document boundaries: "
                "use a model trained with bos_id and eos_id set"
            )
        self.sha256 = file_sha256(self.path)

    def __reduce__(self):
        return type(self), (self.path,)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """sentencepiece encodes a list in C++, on its own ``threads`` threads."""
        return self.sp.encode(list(texts), num_threads=threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        found = self.sp.piece_to_id(token)
        return found if self.sp.id_to_piece(found) == token else None
