"""``train.init_from`` where shard boundaries fall awkwardly: inside a head of ``wq``/``wk``
(whose rows the rotary permutation scatters over the head, so a rank's rows are read as
several runs), and a yatrain checkpoint loaded by 2 and 4 ranks (each copying its own rows,
not the first ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from distributed import run_ranks
from test_continue import SCALING, recipe, save_published
from test_hf_import import save_hf_model

from yatrain.checkpoint.hf_source import HFSource
from yatrain.checkpoint.init_from import init_from_source
from yatrain.checkpoint.manifest import open_checkpoint
from yatrain.checkpoint.store import iter_full_weights
from yatrain.models.llama import build_model
from yatrain.recipe.load import load_recipe
from yatrain.sharding import InitHooks, ShardedEngine
from yatrain.train.loop import pretrain

ROTATED = ("attention.wq.weight", "attention.wk.weight")


def _load(rank: int, world: int, cfg, source: Path) -> tuple[dict, list]:
    """This rank's engine from ``source``: the gathered weights, and the row ranges of
    ``wq``/``wk`` this rank was asked to fill (name, first, end, rows per head)."""
    model = build_model(cfg.model)
    hooks = init_from_source(source, cfg.model, model)
    asked = []

    def unit(index: int, kept) -> None:
        for name, (lo, hi) in (kept or {}).items():
            if name.endswith(ROTATED):
                row = model.get_parameter(name)[0].numel()
                asked.append((name, lo // row, -(-hi // row), cfg.model.head_dim))
        hooks.unit(index, kept)

    init = InitHooks(unit, hooks.norms, hooks.report)
    group = torch.distributed.group.WORLD if world > 1 else None
    engine = ShardedEngine.from_model(model, device="cpu", init=init, group=group)
    return engine.full_state_dict(), asked


def _inside_a_head(asked: list) -> bool:
    """Whether some rank's rows of wq/wk start or end inside a head."""
    return any(first % per_head or end % per_head for _, first, end, per_head in asked)


@pytest.mark.parametrize("world", [3, 4])
def test_hf_init_with_a_shard_boundary_inside_wq_and_wk(tmp_path, world):
    """A small feed-forward makes attention most of a layer: at 3 ranks a boundary falls
    inside a head of wk, at 4 inside one of wq."""
    cfg = recipe("llama3_1", "data.path=unused", "model.ffn_dim=8")
    save_hf_model(cfg, tmp_path / "hf", rope_scaling={"rope_type": "llama3", **SCALING})
    want, _ = _load(0, 1, cfg, tmp_path / "hf")
    results = run_ranks(world, _load, cfg, tmp_path / "hf")
    assert _inside_a_head([row for _, asked in results for row in asked])
    for weights, _ in results:
        assert all(torch.equal(weights[k], want[k]) for k in want)


def test_hf_rows_that_split_a_head_read_as_the_whole_tensor_does(tmp_path):
    """Every start and end inside the heads of wq and wk, one rank's fill at a time."""
    cfg, model = save_published("llama3_1", tmp_path / "hf", dtype=torch.bfloat16)
    source = HFSource(tmp_path / "hf", cfg.model)
    ours = build_model(cfg.model)
    per_head = cfg.model.head_dim
    for name in (f"layers.0.{suffix}" for suffix in ROTATED):
        param = torch.empty(ours.get_parameter(name).shape)  # the model is on the meta device
        whole = torch.empty_like(param)
        source.fill(name, None, whole)
        for first, end in [(1, per_head + 3), (per_head // 2, 2 * per_head - 1), (3, 5)]:
            part = torch.zeros_like(param)
            source.fill(name, (first, end), part)
            assert torch.equal(part[first:end], whole[first:end]), (name, first, end)


@pytest.fixture(scope="module")
def checkpoint(small_data, tmp_path_factory) -> tuple:
    """A yatrain checkpoint of a trained tiny model, and its recipe."""
    run_dir = tmp_path_factory.mktemp("source") / "run"
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}"])
    pretrain(recipe, run_dir=run_dir, steps=2, progress=False)
    return run_dir / "checkpoints/step-2", recipe


@pytest.mark.parametrize("world", [2, 4])
def test_init_from_a_yatrain_checkpoint_at_several_ranks(checkpoint, world):
    path, recipe = checkpoint
    saved = dict(iter_full_weights(open_checkpoint(path)))
    for weights, _ in run_ranks(world, _load, recipe, path):
        assert weights.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(weights[name].float(), tensor), name
