"""A Megatron-LM ``.bin``/``.idx`` pair trains and evaluates like the prepared directory it
was written from: the same stream, so the same losses."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from megatron_files import write_megatron

from yatrain.data import TokenShards, megatron
from yatrain.errors import ConfigError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.recipe.load import load_recipe
from yatrain.train.checkpointer import Checkpointer
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


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory) -> dict:
    """The same stream as a prepared directory and as Megatron pairs (train and held-out
    prefixes), each trained 4 steps; the Megatron run's data.tokenizer is then deleted."""
    tmp = tmp_path_factory.mktemp("megatron")
    train = write_megatron(tmp / "web_text_document", _documents(TokenShards.open(small_data)))
    held = TokenShards.open(small_data, split="validation")
    val = write_megatron(tmp / "web_val_document", _documents(held))
    (tmp / "tok").mkdir()
    tokenizer = shutil.copy(small_data / "tokenizer.model", tmp / "tok/tokenizer.model")
    ours = _run(tmp, "prepared", f"data.path={small_data}")
    theirs = _run(
        tmp,
        "megatron",
        f"data.path={train}",
        f"data.val_path={val}",
        f"data.tokenizer={tokenizer}",
    )
    shutil.rmtree(tmp / "tok")  # the checkpoints carry their tokenizer: eval needs no other
    return {"tmp": tmp, "ours": ours, "theirs": theirs, "val": val}


def test_a_megatron_pair_trains_and_evaluates_as_its_source(runs):
    ours, theirs = runs["ours"], runs["theirs"]
    assert [ours[s]["loss"] for s in (1, 2, 3, 4)] == [theirs[s]["loss"] for s in (1, 2, 3, 4)]
    assert ours[4]["val_loss"] == theirs[4]["val_loss"] and "val_loss" in theirs[2]
    assert any((runs["tmp"] / "megatron").glob("**/tokenizer.model"))  # checkpoints keep it


def test_eval_of_a_megatron_run_reads_its_held_out_prefix_with_the_checkpoint_tokenizer(runs):
    """The recipe's held-out data is a prefix (no directory) and its data.tokenizer is gone."""
    result = evaluate_checkpoint(runs["tmp"] / "megatron/checkpoints/step-4")
    assert result["val_loss"] == pytest.approx(runs["theirs"][4]["val_loss"], abs=1e-6)
    assert result["data"] == [f"{runs['val']} (whole: no split)"]


def test_eval_data_of_a_megatron_prefix_needs_no_tokenizer_setting(runs):
    """``eval --data PREFIX`` reads it with the checkpoint's own tokenizer."""
    checkpoint = runs["tmp"] / "prepared/checkpoints/step-4"
    result = evaluate_checkpoint(checkpoint, data=runs["val"])
    assert result["val_loss"] == pytest.approx(runs["ours"][4]["val_loss"], abs=1e-6)


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


def test_a_megatron_run_saves_its_tokenizer_after_the_temporary_directory_is_emptied(
    runs, small_data, tmp_path, monkeypatch
):
    """The docs say to delete the private cache's ``tmp`` (every command's TMPDIR) to reclaim
    space: deleting it mid-run must not cost the next checkpoint its tokenizer."""
    temporary = tmp_path / "cache-tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(megatron, "_SAVED", {})  # as a fresh process: nothing kept yet
    save = Checkpointer.save

    def emptied_first(self, *args, **kwargs):
        shutil.rmtree(temporary, ignore_errors=True)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", emptied_first)
    tokenizer = small_data / "tokenizer.model"
    overrides = [*FAST, f"data.path={runs['tmp'] / 'web_text_document'}", "eval.every=0"]
    overrides += [f"data.tokenizer={tokenizer}", "eval.at_end=false", "checkpoint.every=1"]
    run = tmp_path / "run"
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    pretrain(recipe, run_dir=run, steps=2, progress=False)
    for step in (1, 2):
        assert (run / f"checkpoints/step-{step}/tokenizer.model").read_bytes() == (
            tokenizer.read_bytes()
        )
