"""Each tokenizer kind: detection, round trip, BOS/EOS, specials never injected from text,
vocabulary checks, Meta's split pattern and reference encoding for Llama 3, and Hugging
Face export."""

from __future__ import annotations

import base64
import json
import os
import random

import numpy as np
import pytest
import regex
import tiktoken
from tokenizer_fixtures import META_PATTERN, sample_texts, write_hf, write_tiktoken
from tokenizers import Tokenizer as HFBackend

from yatrain.data import (
    TokenShards,
    export_tokenizer,
    load_tokenizer,
    prepare_data,
    train_tokenizer,
)
from yatrain.data.tokenizer_export import tiktoken_to_hf, write_hf_tokenizer
from yatrain.data.tokenizer_formats import detect_kind
from yatrain.data.tokenizer_tiktoken import PATTERN, special_tokens, split_for_encoding
from yatrain.errors import ConfigError, DataError
from yatrain.recipe.checks import check_vocab
from yatrain.recipe.load import load_recipe

TRICKY = [
    "",
    "plain words, and 12345 digits",
    "  leading and trailing spaces  \n\n\n",
    "<|begin_of_text|><|eot_id|> <s></s> look like specials",
    "unicode: café 東京 🙂 \u00a0nbsp",
    "def f(x):\n\treturn x  # tab\r\n",
]


@pytest.fixture(scope="module")
def tiktoken_path(tmp_path_factory):
    return write_tiktoken(tmp_path_factory.mktemp("tiktoken") / "tokenizer.model")


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_tokenizer(sample_texts(), tmp_path_factory.mktemp("sp") / "sp", 400)


# ------------------------------------------------------------------ detection


def test_kind_is_detected_from_content(tiktoken_path, sp_path, tmp_path):
    hf_file = write_hf(tmp_path / "hf", config={"bos_token": "<s>", "eos_token": "</s>"})
    renamed = tmp_path / "tokenizer.model"  # Llama 2 and Llama 3 share this file name
    renamed.write_bytes(sp_path.read_bytes())
    assert detect_kind(tiktoken_path) == ("tiktoken", tiktoken_path)
    assert detect_kind(renamed) == ("sentencepiece", renamed)
    assert detect_kind(hf_file.parent) == ("hf", hf_file)
    assert detect_kind(hf_file) == ("hf", hf_file)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds neither tokenizer.json nor tokenizer.model"):
        detect_kind(tmp_path / "empty")


# ------------------------------------------------------------------ Llama 3 (tiktoken)


def _meta_split(s: str, limit: int):
    """Meta's reference cut, written out character by character as its docs describe."""
    start, run, space = 0, 0, s[0].isspace() if s else False
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            run, space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def _reference_encode(ranks_path, text: str) -> list[int]:
    """Meta's Llama 3 tokenizer: tiktoken with its pattern and specials, as in its repo."""
    ranks = {}
    for line in ranks_path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    specials = {t: len(ranks) + i for i, t in enumerate(special_tokens())}
    enc = tiktoken.Encoding(
        "ref", pat_str=META_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    ids = []
    for i in range(0, len(text), 400_000):
        for part in _meta_split(text[i : i + 400_000], 25_000):
            ids += enc.encode(part, allowed_special=set(), disallowed_special=())
    return ids


def test_llama3_specials_vocab_and_ids(tiktoken_path):
    tok = load_tokenizer(tiktoken_path)
    base = tok.num_base_tokens
    assert tok.kind == "tiktoken" and tok.vocab_size == base + 256
    assert (tok.bos_id, tok.eos_id) == (base, base + 1)
    expected = {
        "<|begin_of_text|>": 0,
        "<|end_of_text|>": 1,
        "<|reserved_special_token_0|>": 2,
        "<|reserved_special_token_3|>": 5,
        "<|start_header_id|>": 6,
        "<|end_header_id|>": 7,
        "<|reserved_special_token_4|>": 8,
        "<|eot_id|>": 9,
        "<|reserved_special_token_5|>": 10,
        "<|reserved_special_token_250|>": 255,
    }
    for token, offset in expected.items():
        assert tok.token_id(token) == base + offset
    assert len(set(special_tokens())) == 256


def test_llama3_round_trip_and_no_special_injection(tiktoken_path):
    tok = load_tokenizer(tiktoken_path)
    for text in [*TRICKY, *sample_texts(5)]:
        ids = tok.encode(text)
        assert all(i < tok.num_base_tokens for i in ids), "specials never come from text"
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]
    assert tok.encode_batch(TRICKY, threads=2) == [tok.encode(t) for t in TRICKY]


def test_llama3_matches_meta_reference_on_long_inputs(tiktoken_path):
    tok = load_tokenizer(tiktoken_path)
    texts = [
        " " * 60_001 + "x",  # a whitespace run cut at 25,000 and 50,000
        "x" * 50_000 + " " * 25_000 + "y" * 25_001,  # exactly at and just over the limit
        "ab\n" * 140_000,  # over 400,000 characters: two pieces, cut mid-word
        ("word " * 30_000) + "\u3000" * 26_000 + "end",  # unicode whitespace counts too
        *sample_texts(3),
    ]
    packed = []
    for text in texts:
        reference = _reference_encode(tiktoken_path, text)
        assert tok.encode(text) == reference
        packed += [tok.bos_id, *reference, tok.eos_id]
    assert tok.encode_packed(texts, np.dtype("<u4")).tolist() == packed  # the shard path
    assert len(tok.encode(" " * 1_000_000)) > 0  # in one call tiktoken overflows its stack


def test_long_run_cuts_match_meta_on_random_text():
    rng = random.Random(0)
    for _ in range(8):
        parts = []
        while sum(map(len, parts)) < 120_000:
            kind = rng.choice([" ", "x", "\u3000", "\n", "ab cd "])
            parts.append(kind * rng.choice([1, 7, 12_499, 12_501, 24_999, 25_001, 40_000]))
        text = "".join(parts)
        assert list(split_for_encoding(text)) == list(_meta_split(text, 25_000))


SPLITS = {
    "'tis": ["'t", "is"],
    "it'sgood": ["it", "'s", "good"],
    "We'LL see": ["We", "'LL", " see"],
    "1234567 89": ["123", "456", "7", " ", "89"],
    "a   b": ["a", "  ", " b"],
    "x\n\n  y": ["x", "\n\n", " ", " y"],
    "end.  ": ["end", ".", "  "],
}


def test_the_llama3_split_pattern_is_metas():
    assert PATTERN == META_PATTERN
    for text, pieces in SPLITS.items():
        assert regex.findall(PATTERN, text) == pieces, text


def test_tiktoken_read_from_local_file_only(tiktoken_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tok = load_tokenizer(tiktoken_path)
    assert tok.encode("hello") and not cache.exists()  # nothing cached, nothing fetched


def test_tiktoken_file_errors(tiktoken_path, tmp_path):
    lines = tiktoken_path.read_text().splitlines()
    bad = tmp_path / "bad.model"
    bad.write_text("\n".join([*lines[:3], "!!notbase64 3", *lines[4:]]) + "\n")
    with pytest.raises(DataError, match=r"bad\.model:4: not a 'base64 rank' line"):
        load_tokenizer(bad)
    bad.write_text("\n".join(lines[1:]) + "\n")  # rank 0 missing
    with pytest.raises(DataError, match="ranks are not 0"):
        load_tokenizer(bad)


# ------------------------------------------------------------------ Hugging Face


def test_hf_bos_eos_from_config_map_or_flags(tmp_path):
    tok = load_tokenizer(write_hf(tmp_path / "a", config={"bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.kind == "hf"
    assert (tok.bos_id, tok.eos_id) == (tok.token_id("<s>"), tok.token_id("</s>"))
    assert tok.vocab_size == max(tok.backend.get_vocab(with_added_tokens=True).values()) + 1
    mapped = write_hf(
        tmp_path / "b",
        special_map={"bos_token": {"content": "</s>"}, "eos_token": {"content": "<s>"}},
    )
    tok = load_tokenizer(mapped.parent)  # a model directory works too
    assert (tok.bos_id, tok.eos_id) == (tok.token_id("</s>"), tok.token_id("<s>"))
    bare = write_hf(tmp_path / "c")
    with pytest.raises(DataError, match="defines no BOS token .* pass --bos-token"):
        load_tokenizer(bare)
    tok = load_tokenizer(bare, bos_token="<pad>", eos_token=str(tok.token_id("</s>")))
    assert (tok.bos_id, tok.eos_id) == (tok.token_id("<pad>"), tok.token_id("</s>"))
    assert load_tokenizer(bare, bos_token="<s>", eos_token="1").eos_id == 1  # digits: an id
    with pytest.raises(DataError, match=r"eos_token '<nope>' \(from --eos-token\) is not a token"):
        load_tokenizer(bare, bos_token="<s>", eos_token="<nope>")


def test_hf_round_trip_and_no_special_injection(tmp_path):
    tok = load_tokenizer(write_hf(tmp_path, config={"bos_token": "<s>", "eos_token": "</s>"}))
    specials = {tok.token_id(t) for t in ("<s>", "</s>", "<pad>")}
    for text in [*TRICKY, *sample_texts(5)]:
        ids = tok.encode(text)
        assert not specials & set(ids), "specials never come from text"
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert tok.encode_batch(TRICKY) == tok.encode_batch(TRICKY, threads=2)


def test_flags_only_for_tokenizer_json(sp_path, tiktoken_path):
    for path in (sp_path, tiktoken_path):
        with pytest.raises(DataError, match="apply to a Hugging Face tokenizer.json only"):
            load_tokenizer(path, bos_token="<s>")


# ------------------------------------------------------------------ sentencepiece


def test_sentencepiece_specials_not_injected(sp_path):
    tok = load_tokenizer(sp_path)
    assert tok.kind == "sentencepiece" and (tok.bos_id, tok.eos_id) == (1, 2)
    for text in TRICKY:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
    assert tok.token_id("<s>") == 1 and tok.token_id("no-such-piece") is None


# ------------------------------------------------------------------ data dirs and recipes


def _manifest_facts(tok) -> dict:
    return {
        "tokenizer_kind": tok.kind,
        "tokenizer_sha256": tok.sha256,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "vocab_size": tok.vocab_size,
    }


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "hf"])
def test_prepare_with_each_kind(kind, sp_path, tiktoken_path, tmp_path):
    corpus = tmp_path / "in.jsonl"
    texts = [*TRICKY[1:], *sample_texts(4, seed=3)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = {
        "sentencepiece": sp_path,
        "tiktoken": tiktoken_path,
        "hf": write_hf(tmp_path / "hf", special_map={"bos_token": "<s>", "eos_token": "</s>"}),
    }[kind]
    manifest = prepare_data(tmp_path / "out", [corpus], tokenizer=source, progress=False)
    tok = load_tokenizer(source)
    assert {k: manifest[k] for k in _manifest_facts(tok)} == _manifest_facts(tok)
    assert manifest["dtype"] == "uint16"
    shards = TokenShards.open(tmp_path / "out")
    stored = load_tokenizer(shards.tokenizer_path)  # the copy in the data dir: same tokenizer
    assert _manifest_facts(stored) == _manifest_facts(tok)
    stream = shards.read(0, shards.num_tokens).tolist()
    assert stream[0] == tok.bos_id and stream[-1] == tok.eos_id
    assert stream.count(tok.bos_id) == len(texts)
    exported = tmp_path / "hf-export"  # a data dir holds the tokenizer as a checkpoint does
    exported.mkdir()
    assert export_tokenizer(tmp_path / "out", exported) == (tok.bos_id, tok.eos_id)
    assert (exported / "tokenizer_config.json").is_file()
    recipe = load_recipe("recipes/tiny.yaml", [f"model.vocab_size={tok.vocab_size - 1}"])
    with pytest.raises(ConfigError, match=f"set model.vocab_size to at least {tok.vocab_size}"):
        check_vocab(recipe, shards.vocab_size)


# ------------------------------------------------------------------ export to Hugging Face


def test_tiktoken_export_encodes_like_tiktoken(tiktoken_path, tmp_path):
    tok = load_tokenizer(tiktoken_path)
    converted = tiktoken_to_hf(tok)
    for text in [t for t in TRICKY if "<|" not in t] + sample_texts(10, seed=5):
        ids = converted.encode(text).ids
        assert ids == [tok.bos_id, *tok.encode(text)]  # BOS from the post-processor
        assert converted.decode(ids, skip_special_tokens=True) == text
    write_hf_tokenizer(tok, tmp_path)
    reloaded = HFBackend.from_file(str(tmp_path / "tokenizer.json"))
    assert reloaded.token_to_id("<|eot_id|>") == tok.token_id("<|eot_id|>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "hf"])
def test_exported_tokenizer_loads_in_transformers(kind, sp_path, tiktoken_path, tmp_path):
    if os.environ.get("YATRAIN_TEST_REQUIRE_HF"):  # scripts/test.sh: CI must not skip this
        import transformers
    else:
        transformers = pytest.importorskip(
            "transformers", reason="pip install -e '.[hf]' to check the tokenizer export"
        )
    source = {
        "sentencepiece": sp_path,
        "tiktoken": tiktoken_path,
        "hf": write_hf(tmp_path / "hf", config={"bos_token": "<s>", "eos_token": "</s>"}),
    }[kind]
    tok = load_tokenizer(source)
    out = tmp_path / "export"
    out.mkdir()
    write_hf_tokenizer(tok, out)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (loaded.bos_token_id, loaded.eos_token_id) == (tok.bos_id, tok.eos_id)
    text = "Hello world: café 東京 12345\n    indented"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(text)
    assert loaded.decode(ids) == text
