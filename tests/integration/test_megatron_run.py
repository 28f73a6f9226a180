"""A Megatron-LM ``.bin``/``.idx`` pair trains and evaluates like the prepared directory it
was written from: the same stream, so the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from megatron_files import write_megatron

from yatrain.data import TokenShards
from yatrain.errors import ConfigError
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain


def _documents(shards: TokenShards) -> list[list[list[int]]]:
    """The stream's documents without their BOS; every other one keeps its EOS (as
    Megatron's --append-eod writes it), the rest lose it; odd ones in two sequences."""
    tokens = shards.read(0, shards.num_tokens).tolist()
    starts = [
        i
        for i, t in enumerate(tokens)
        if t == shards.bos_id and (i == 0 or tokens[i - 1] == shards.eos_id)
    ]
    documents = []
    for n, (a, b) in enumerate(zip(starts, [*starts[1:], len(tokens)], strict=True)):
        body = tokens[a + 1 : b] if n % 2 else tokens[a + 1 : b - 1]
        documents.append([body[:3], body[3:]] if n % 3 == 1 else [body])
    return documents


def _run(tmp: Path, name: str, *extra: str) -> dict[int, dict]:
    overrides = [*FAST, "data.document_mask=true", "eval.every=2", "eval.batches=1", *extra]
    pretrain(
        load_recipe(ROOT / "recipes/tiny.yaml", overrides),
        run_dir=tmp / name,
        steps=4,
        progress=False,
    )
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_a_megatron_pair_trains_and_evaluates_as_its_source(small_data, tmp_path):
    train = write_megatron(tmp_path / "web_text_document", _documents(TokenShards.open(small_data)))
    held = TokenShards.open(small_data, split="validation")
    val = write_megatron(tmp_path / "web_val_document", _documents(held))
    tokenizer = small_data / "tokenizer.model"
    ours = _run(tmp_path, "prepared", f"data.path={small_data}")
    theirs = _run(
        tmp_path,
        "megatron",
        f"data.path={train}",
        f"data.val_path={val}",
        f"data.tokenizer={tokenizer}",
    )
    assert [ours[s]["loss"] for s in (1, 2, 3, 4)] == [theirs[s]["loss"] for s in (1, 2, 3, 4)]
    assert ours[4]["val_loss"] == theirs[4]["val_loss"] and "val_loss" in theirs[2]
    assert any((tmp_path / "megatron").glob("**/tokenizer.model"))  # checkpoints keep it


def test_a_megatron_pair_needs_its_tokenizer_and_held_out_prefix(small_data, tmp_path):
    train = write_megatron(tmp_path / "web", _documents(TokenShards.open(small_data)))
    tokenizer = f"data.tokenizer={small_data / 'tokenizer.model'}"
    for extra, says in [
        ([], "Megatron-LM indexed dataset, which does not record its tokenizer"),
        ([tokenizer, "eval.at_end=true"], "holds no held-out split: point data.val_path"),
    ]:
        with pytest.raises(ConfigError, match=says):
            pretrain(
                load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={train}", *extra]),
                run_dir=tmp_path / "run",
                steps=1,
                progress=False,
            )
