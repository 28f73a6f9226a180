"""Any Hugging Face model's tokenizer, from its ``tokenizer.json``, through ``tokenizers``.

BOS and EOS come from ``--bos-token``/``--eos-token`` when given, else from the
``tokenizer_config.json`` (then ``special_tokens_map.json``) beside the file; a tokenizer
that names neither is refused, since documents must be wrapped in them. Special tokens in
the text are encoded as ordinary text (``encode_special_tokens``), and no post-processor
template is applied: the pipeline adds BOS/EOS itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFBackend

from yatrain.data.tokenizer import Tokenizer, file_sha256
from yatrain.errors import DataError

CONFIG = "tokenizer_config.json"
_SPECIAL_MAP = "special_tokens_map.json"


def _token_text(value: object) -> str | None:
    """A token as configs write it: a string or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured(folder: Path, role: str) -> tuple[str | None, str | None]:
    """(token, file it came from) for ``bos_token``/``eos_token`` in the config files."""
    for name in (CONFIG, _SPECIAL_MAP):
        file = folder / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{file} is not valid JSON ({e}): fix or remove it") from None
        token = _token_text(config.get(role)) if isinstance(config, dict) else None
        if token is not None:
            return token, name
    return None, None


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer plus the BOS/EOS ids the data is wrapped in."""

    kind = "hf"
    stored_name = "tokenizer.json"

    def __init__(self, path: Path, bos_token: str | None = None, eos_token: str | None = None):
        self.path = Path(path)
        self.overrides = (bos_token, eos_token)
        try:
            self.backend = HFBackend.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DataError(
                f"{self.path} is not a Hugging Face tokenizer.json ({detail}): pass the "
                "tokenizer.json of a model, or its directory"
            ) from None
        self.backend.encode_special_tokens = True  # "<s>" in the data stays text
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id = self._resolve("bos_token", bos_token, "--bos-token")
        self.eos_id = self._resolve("eos_token", eos_token, "--eos-token")
        self.sha256 = file_sha256(self.path)

    def _resolve(self, role: str, override: str | None, flag: str) -> int:
        where = flag
        token = override
        if token is None:
            token, where = _configured(self.path.parent, role)
        if token is None:
            raise DataError(
                f"{self.path} defines no {role.split('_')[0].upper()} token (no {role} in a "
                f"{CONFIG} or {_SPECIAL_MAP} beside it): pass {flag} TOKEN, e.g. the token "
                "the model was pretrained to start/end documents with"
            )
        digits = token.strip()  # an id (digits are no BOS/EOS; isdigit alone takes '²')
        if override is not None and digits.isascii() and digits.isdigit() and len(digits) < 20:
            found = int(token)
        else:
            found = self.backend.token_to_id(token)
        if found is None or not 0 <= found < self.vocab_size:
            raise DataError(
                f"{role} {token!r} (from {where}) is not a token of {self.path}: pass {flag} "
                f"with a token string it has, or an id below {self.vocab_size}"
            )
        return found

    def __reduce__(self):
        return type(self), (self.path, *self.overrides)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        if threads <= 1:  # encode_batch would use every core through its thread pool
            return [self.encode(text) for text in texts]
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in (self.bos_id, self.eos_id)]
        return self.backend.decode(keep, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def save(self, folder: Path) -> list[str]:
        """tokenizer.json plus a tokenizer_config.json naming the BOS/EOS in use."""
        names = super().save(folder)
        (Path(folder) / CONFIG).write_text(json.dumps(self.config(), indent=1) + "\n")
        return [*names, CONFIG]

    def config(self) -> dict:
        """The tokenizer_config.json that reproduces this tokenizer's BOS/EOS (and loads in
        ``transformers`` as a fast tokenizer)."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        try:
            original = json.loads((self.path.parent / CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            original = {}
        for key in ("model_max_length", "chat_template", "pad_token", "unk_token"):
            if isinstance(original, dict) and key in original:
                config[key] = original[key]
        config["bos_token"] = self.backend.id_to_token(self.bos_id)
        config["eos_token"] = self.backend.id_to_token(self.eos_id)
        config["clean_up_tokenization_spaces"] = False
        return config
