"""recipes/llama3_1_8b_long.yaml: Llama 3.1 8B at 131,072 tokens on 8 x 80 GB fits on paper
(the planner, as the fit check asks it), and the recipe's own keys train on CPU when only
the sizes shrink (2 gloo ranks sharing each window, documents masked)."""

from __future__ import annotations

import json
import math

from conftest import ROOT
from distributed import run_ranks

from yatrain.common import GIB
from yatrain.plan import plan_for_layers, plan_memory
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

LONG = ROOT / "recipes/llama3_1_8b_long.yaml"
# Only sizes change: the model's, the window's and the batch's; the run is 2 steps; no
# published weights to start from on CPU. Every other key is the recipe's.
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.vocab_size=512",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "data.global_batch_size=2",
    "sharding.context_parallel=2",
    "train.steps=2",
    "train.init_from=null",
    "train.dtype=fp32",
    "eval.batches=1",
    "logging.wandb.mode=disabled",
]


def test_long_recipe_fits_8_gpus_of_80_gb_on_paper():
    recipe = load_recipe(LONG)
    assert recipe.data.seq_len == recipe.model.max_seq_len == 131_072
    assert recipe.sharding.context_parallel == 8 and recipe.data.document_mask
    assert recipe.sharding.activation_checkpoint_layers == "auto"
    plan = plan_memory(recipe, 8, 80 * GIB)
    assert plan.fits and plan.context_parallel == 8
    layers = plan.activation_checkpoint_layers  # what auto resolves to at 80 GB
    assert layers < recipe.model.n_layers
    assert plan_for_layers(recipe, 8, layers, 80 * GIB).fits  # the fit check's question
    assert plan.breakdown["attention_masks"] > 2 * GIB  # the dense mask is in the plan
    # one window per step on a rank, 4.2M tokens a step as the comments say
    assert recipe.data.global_batch_size * recipe.data.seq_len == 32 * 131_072


def _pretrain(rank, world, data, run_dir):
    recipe = load_recipe(LONG, [*TINY, f"data.path={data}"])
    pretrain(recipe, run_dir=run_dir, progress=False)
    return rank


def test_long_recipe_trains_on_cpu_at_a_tiny_size(small_data, tmp_path):
    run_ranks(2, _pretrain, small_data, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert any(math.isfinite(r.get("val_loss", math.nan)) for r in rows)  # eval at the end
