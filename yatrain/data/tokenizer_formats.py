"""Which tokenizer a file is, decided by its content, not its name.

Llama 2's and Llama 3's files are both called ``tokenizer.model``: the first is a
sentencepiece protobuf, the second tiktoken's text format (``base64 rank`` per line). A
``tokenizer.json`` is a JSON document; a Hugging Face model directory holds one.
"""

from __future__ import annotations

import re
from pathlib import Path

from yatrain.data.tokenizer import Tokenizer
from yatrain.errors import DataError

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?$")


def detect_kind(path: Path) -> tuple[str, Path]:
    """(kind, file) for a tokenizer file or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return detect_kind(path / name)
        raise DataError(
            f"tokenizer directory {path} holds neither tokenizer.json nor tokenizer.model: "
            "pass the tokenizer file itself"
        )
    if not path.is_file():
        raise DataError(f"tokenizer {path} not found: check the tokenizer path")
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.lstrip()[:1] == b"{":
        return "hf", path
    if _TIKTOKEN_LINE.match(head.split(b"\n", 1)[0]):
        return "tiktoken", path
    return "sentencepiece", path


def load_tokenizer(
    path: Path, bos_token: str | None = None, eos_token: str | None = None
) -> Tokenizer:
    """Open a sentencepiece model, a tiktoken ranks file or a Hugging Face tokenizer.json.

    ``bos_token``/``eos_token`` (a token string or an id) override what a tokenizer.json's
    configuration says; the other formats define BOS/EOS themselves.
    """
    kind, file = detect_kind(Path(path))
    if kind != "hf" and (bos_token is not None or eos_token is not None):
        raise DataError(
            f"{file} is a {kind} model with fixed BOS/EOS tokens: --bos-token/--eos-token "
            "apply to a Hugging Face tokenizer.json only"
        )
    # Each library is imported only when a file of its kind is opened (a run that reads
    # tokenized shards of one kind never loads the other two).
    if kind == "hf":
        from yatrain.data.tokenizer_hf import HFTokenizer

        return HFTokenizer(file, bos_token=bos_token, eos_token=eos_token)
    if kind == "tiktoken":
        from yatrain.data.tokenizer_tiktoken import TiktokenTokenizer

        return TiktokenTokenizer(file)
    from yatrain.data.tokenizer_sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(file)
