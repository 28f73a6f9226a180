"""Held-out evaluation: the validation split, the windows each rank reads, val_loss during
training (same at any world size, no effect on training), and ``yatrain eval``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, ROOT
from distributed import run_ranks

from yatrain.data import TokenShards, load_tokenizer, prepare_data
from yatrain.data.heldout import IGNORE_INDEX, EvalWindows, open_held_out
from yatrain.data.split import held_out
from yatrain.errors import ConfigError, DataError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.output.console import log_line, run_summary
from yatrain.output.record import MetricsRecord
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def _documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS, 12)) for i in range(count)]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _stream_documents(shards: TokenShards) -> list[tuple[int, ...]]:
    tokens = shards.read(0, shards.num_tokens).tolist()
    docs, current = [], []
    for token in tokens:
        if token == shards.bos_id:
            current = []
        elif token == shards.eos_id:
            docs.append(tuple(current))
        else:
            current.append(token)
    return docs


def test_split_is_chosen_by_content_and_disjoint(small_data, tmp_path):
    tokenizer = small_data / "tokenizer.model"
    first, second = _documents(150, seed=1), _documents(150, seed=2)
    a, b = _jsonl(tmp_path / "a.jsonl", first), _jsonl(tmp_path / "b.jsonl", second)
    one = prepare_data(
        tmp_path / "one", [a, b], tokenizer=tokenizer, workers=1, val_fraction=0.2, progress=False
    )
    # Other workers and the files in the other order: the same documents are held out.
    other = prepare_data(
        tmp_path / "other", [b, a], tokenizer=tokenizer, workers=2, val_fraction=0.2, progress=False
    )
    tok = load_tokenizer(tokenizer)
    expect_val = {tuple(tok.encode(d)) for d in first + second if held_out(d, 0.2)}
    expect_train = {tuple(tok.encode(d)) for d in first + second if not held_out(d, 0.2)}
    assert 40 <= len(expect_val) <= 80  # about a fifth of 300
    for out, manifest in [(tmp_path / "one", one), (tmp_path / "other", other)]:
        train = _stream_documents(TokenShards.open(out))
        val = _stream_documents(TokenShards.open(out, split="validation"))
        assert set(val) == expect_val and set(train) == expect_train  # disjoint, complete
        assert len(val) == manifest["validation"]["num_documents"] == len(expect_val)
        assert manifest["num_documents"] == 300 - len(expect_val)
        assert manifest["val_fraction"] == 0.2
        assert [f["name"] for f in manifest["validation"]["files"]] == ["val-00000.bin"]
    none = prepare_data(tmp_path / "none", [a], tokenizer=tokenizer, val_fraction=0, progress=False)
    assert none["validation"] is None and not list((tmp_path / "none").glob("val-*"))
    with pytest.raises(DataError, match="no held-out validation split"):
        TokenShards.open(tmp_path / "none", split="validation")
    for bad in (-0.1, 1.0):
        with pytest.raises(DataError, match="--val-fraction must be"):
            prepare_data(tmp_path / "bad", [a], tokenizer=tokenizer, val_fraction=bad)


@pytest.mark.parametrize("windows", [1, 7, 12])
def test_every_rank_runs_the_same_micro_batches(small_data, windows):
    """Ranks get contiguous slices of whole micro-batches, padded with ignored windows, so
    micro-batch k is windows [2k, 2k + 2) at any world size and no rank runs fewer."""
    held = open_held_out(small_data)
    stream = held.shards.read(0, windows * 32 + 1)
    for world in (1, 2, 3):
        slices = [EvalWindows(held, 32, windows, 2, rank, world) for rank in range(world)]
        batches = [list(s.micro_batches()) for s in slices]
        assert len({len(b) for b in batches}) == 1  # the same number of forward passes
        flat = [pair for rank_batches in batches for pair in rank_batches]
        for k, (inputs, targets, _) in enumerate(flat):
            for row in range(2):
                j = 2 * k + row
                if j < windows:
                    assert inputs[row].tolist() == stream[j * 32 : j * 32 + 32].tolist()
                    assert targets[row].tolist() == stream[j * 32 + 1 : j * 32 + 33].tolist()
                else:
                    assert (targets[row] == IGNORE_INDEX).all()
        assert sum(int((t != IGNORE_INDEX).sum()) for _, t, _ in flat) == windows * 32


def recipe(data: Path, *extra: str):
    return load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={data}", *extra])


def _train(rank, world, data, run_dir, extra):
    pretrain(recipe(data, "checkpoint.every=2", *extra), run_dir=run_dir, steps=4, progress=False)


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory) -> tuple[Path, Path]:
    """The same 4 steps on 2 gloo ranks, evaluated every 2 steps and never."""
    root = tmp_path_factory.mktemp("eval")
    run_ranks(2, _train, small_data, root / "with", ["eval.every=2", "eval.batches=3"])
    run_ranks(2, _train, small_data, root / "without", [])
    return root / "with", root / "without"


def test_evaluation_leaves_training_untouched_and_is_logged(runs):
    evaluated, plain = metrics(runs[0]), metrics(runs[1])
    assert sorted(evaluated) == sorted(plain) == [1, 2, 3, 4]
    for step, record in plain.items():  # bitwise: no RNG, data order or engine state touched
        assert (evaluated[step]["loss"], evaluated[step]["grad_norm"]) == (
            record["loss"],
            record["grad_norm"],
        )
        assert "val_loss" not in record
    for step in (2, 4):
        record = evaluated[step]
        assert record["val_tokens"] == 3 * 4 * 32
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
    assert "val_loss" not in evaluated[1] and "val_loss" not in evaluated[3]
    assert evaluated[4]["val_loss"] < evaluated[2]["val_loss"]  # it learns


def test_checkpoint_eval_reproduces_the_logged_value_at_any_world_size(runs):
    logged = metrics(runs[0])[4]["val_loss"]
    checkpoint = runs[0] / "checkpoints/step-4"
    one = evaluate_checkpoint(checkpoint)
    two = run_ranks(2, _evaluate, checkpoint, None)
    assert one["step"] == 4 and one["val_tokens"] == 3 * 4 * 32
    assert one["val_loss"] == pytest.approx(logged, rel=1e-6, abs=0)
    assert two[0]["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6, abs=0)
    assert two[0] == two[1] | {"seconds": two[0]["seconds"]}  # every rank has the result


def _evaluate(rank, world, checkpoint, data):
    return evaluate_checkpoint(checkpoint, data=data)


def test_a_short_directory_without_split_is_evaluated_whole(runs, small_data, tmp_path):
    """A few windows of a directory without a split, on 1 and 2 ranks (the second rank
    pads)."""
    text = _jsonl(tmp_path / "t.jsonl", _documents(3, seed=3))
    data = tmp_path / "short"
    prepare_data(
        data, [text], tokenizer=small_data / "tokenizer.model", val_fraction=0, progress=False
    )
    shards = TokenShards.open(data)
    windows = (shards.num_tokens - 1) // 32
    assert 1 <= windows < 12 and windows % 4  # short, and not whole micro-batches at world 2
    said = []
    one = evaluate_checkpoint(runs[0] / "checkpoints/step-2", data=data, say=said.append)
    two = run_ranks(2, _evaluate, runs[0] / "checkpoints/step-2", data)[0]
    assert one["val_tokens"] == two["val_tokens"] == windows * 32
    assert one["data"] == [f"{data} (whole: no split)"]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6, abs=0)
    assert sum("fewer than the 12 an evaluation asks for" in line for line in said) == 1


def test_start_up_refuses_what_it_cannot_evaluate(small_data, tmp_path):
    text = _jsonl(tmp_path / "t.jsonl", _documents(40, seed=4))
    bare = tmp_path / "bare"
    prepare_data(
        bare, [text], tokenizer=small_data / "tokenizer.model", val_fraction=0, progress=False
    )
    cases = [
        (["eval.every=5"], "data.path .* has no held-out validation split"),
        (["eval.at_end=true", f"data.val_path={bare}"], "is training data without a held-out"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            pretrain(recipe(bare, *extra), run_dir=tmp_path / "run", steps=1, progress=False)
    tiny = tmp_path / "tiny"
    prepare_data(
        tiny,
        [_jsonl(tmp_path / "one.jsonl", ["x"])],
        val_fraction=0,
        tokenizer=small_data / "tokenizer.model",
        progress=False,
    )
    with pytest.raises(DataError, match="fewer than one window of 32\\+1"):
        pretrain(
            recipe(small_data, "eval.every=1", f"data.val_path={tiny}"),
            run_dir=tmp_path / "run",
            steps=1,
            progress=False,
        )
    assert not (tmp_path / "run").exists()  # refused before any step, nothing written


def test_a_mixture_is_evaluated_source_by_source(small_data, tmp_path):
    prose = _jsonl(tmp_path / "p.jsonl", _documents(120, seed=5))
    second = tmp_path / "prose"
    prepare_data(
        second, [prose], tokenizer=small_data / "tokenizer.model", val_fraction=0.3, progress=False
    )
    listed = f"[{{path: {small_data}, weight: 3}}, {{path: {second}, weight: 1, name: words}}]"
    cfg = load_recipe(
        ROOT / "recipes/tiny.yaml",
        [
            *FAST,
            "data.path=null",
            f"data.sources={listed}",
            "data.document_mask=true",
            "eval.every=1",
            "eval.batches=1",
        ],
    )
    summary = pretrain(cfg, run_dir=tmp_path / "run", steps=2, progress=False)
    record = metrics(tmp_path / "run")[2]
    code, words = record["val_loss/stdlib-small"], record["val_loss/words"]
    assert record["val_loss"] == pytest.approx(0.75 * code + 0.25 * words)
    assert record["val_tokens"] == 2 * 4 * 32  # each source's first global batch
    assert summary["final_val_loss/words"] == words and summary["val_step"] == 2


def test_records_console_and_summary_carry_the_evaluation():
    base = dict(
        step=5,
        loss=2.0,
        lr=1e-3,
        grad_norm=1.0,
        tokens_seen=10,
        step_time_s=0.1,
        tokens_per_s=1.0,
        tokens_per_s_per_device=1.0,
        tflops_per_device=0.0,
        mfu=0.1,
        peak_memory_bytes=None,
        data_wait_frac=0.0,
        comm_bytes_sent=0,
        skipped_steps=0,
    )
    plain = MetricsRecord(**base)
    val = MetricsRecord(
        **base,
        val_loss=1.5,
        val_ppl=math.exp(1.5),
        val_tokens=64,
        val_sources={"web": 1.25, "code": 2.25},
    )
    as_json = val.to_json()
    assert as_json["val_loss/web"] == 1.25 and "val_sources" not in as_json
    assert "val_loss" not in plain.to_json()
    assert MetricsRecord.from_json(json.loads(json.dumps(as_json))) == val
    assert MetricsRecord.from_json(plain.to_json()) == plain
    assert "| val 1.5000 ppl 4.5 (web 1.2500, code 2.2500) |" in log_line(val)
    assert " val " not in log_line(plain)
    summary = run_summary([plain, val], 1.0, "run", "fp32", 1)
    assert summary["final_val_loss"] == 1.5 and summary["final_val_loss/code"] == 2.25
