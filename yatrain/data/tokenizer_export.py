"""Writing a tokenizer into a Hugging Face model directory, in a form ``transformers`` loads.

- sentencepiece: ``tokenizer.model`` with a ``LlamaTokenizer`` config (as Llama 2 ships);
- tiktoken (Llama 3): converted to a byte-level BPE ``tokenizer.json`` for
  ``PreTrainedTokenizerFast``, as Meta's own Hugging Face release does: the same ranks as
  vocabulary, every split of a token into two vocabulary tokens as a merge (ordered by the
  token's rank, so BPE merges in tiktoken's order), the same pre-tokenization pattern, the
  256 special tokens, and a post-processor that starts each text with BOS;
- Hugging Face: its ``tokenizer.json`` and a config naming the BOS/EOS the data used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFBackend

from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.data.tokenizer_hf import CONFIG, HFTokenizer
from yatrain.data.tokenizer_sentencepiece import SentencePieceTokenizer
from yatrain.data.tokenizer_tiktoken import PATTERN, TiktokenTokenizer


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for the
    code points from 256 on, in byte order (what ``tokenizers``' ByteLevel expects)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def tiktoken_to_hf(tokenizer: TiktokenTokenizer) -> HFBackend:
    """An equivalent ``tokenizers`` BPE tokenizer for a tiktoken one (see the docstring)."""
    ranks = tokenizer.ranks()
    alphabet = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    backend = HFBackend(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in merges],
            ignore_merges=True,  # a whole pre-token in the vocabulary is one token, as in tiktoken
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special.items(), key=lambda item: item[1])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    for token, expected in specials:
        assert backend.token_to_id(token) == expected, "special token ids must follow the ranks"
    bos = backend.id_to_token(tokenizer.bos_id)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tokenizer.bos_id)],
            ),
        ]
    )
    return backend


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """The tokenizer files of a Hugging Face model directory (see the module docstring)."""
    folder = Path(folder)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(folder)
        return
    if isinstance(tokenizer, SentencePieceTokenizer):
        shutil.copyfile(tokenizer.path, folder / "tokenizer.model")
        piece = tokenizer.sp.id_to_piece
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": piece(tokenizer.bos_id),
            "eos_token": piece(tokenizer.eos_id),
            "unk_token": piece(tokenizer.sp.unk_id()),
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "add_prefix_space": False,
        }
    elif isinstance(tokenizer, TiktokenTokenizer):
        tiktoken_to_hf(tokenizer).save(str(folder / "tokenizer.json"))
        names = {i: t for t, i in tokenizer.special.items()}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": names[tokenizer.bos_id],
            "eos_token": names[tokenizer.eos_id],
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        }
    else:
        raise TypeError(f"no Hugging Face export for {tokenizer!r}")
    (folder / CONFIG).write_text(json.dumps(config, indent=1) + "\n")


def export_tokenizer(source: Path, folder: Path) -> tuple[int, int] | None:
    """Write the tokenizer found in ``source`` (a checkpoint or data directory) into the
    Hugging Face directory ``folder``; its (BOS, EOS) ids, or None if ``source`` has none."""
    source = Path(source)
    if not any((source / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    tokenizer = load_tokenizer(source)
    write_hf_tokenizer(tokenizer, folder)
    return tokenizer.bos_id, tokenizer.eos_id
