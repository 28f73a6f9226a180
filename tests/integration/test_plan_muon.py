"""The planner's Muon terms: the optimizer step's updates, exchange buffers and Newton-Schulz
workspace after the backward, in ``yatrain plan``'s report and in ``auto``'s choice; the
exchange's bytes in the traffic table; a dry run of a Muon step agrees with them."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from test_failures import yatrain

from yatrain.common import DTYPES
from yatrain.plan import memory as memory_module
from yatrain.plan import plan_memory
from yatrain.plan.muon import exchange_plan
from yatrain.plan.report import format_plan
from yatrain.plan.traffic import traffic_table
from yatrain.recipe.load import load_recipe

GIB = 2**30
LLAMA3_8B = ROOT / "recipes" / "llama3_8b.yaml"
SHORT = ["data.seq_len=1024", "data.global_batch_size=64"]  # small activations


def _recipe(optimizer: str, *more: str):
    return load_recipe(LLAMA3_8B, [f"optim.name={optimizer}", *SHORT, *more])


def test_plan_shows_muons_step_and_adamw_has_none():
    muon = plan_memory(_recipe("muon"), 8, 80 * GIB)
    adamw = plan_memory(_recipe("adamw"), 8, 80 * GIB)
    assert muon.optimizer_step_bytes > 0 and adamw.optimizer_step_bytes == 0
    report = format_plan(muon, _recipe("muon"), LLAMA3_8B, "--gpu-memory")
    assert "Muon step (after the backward" in report
    assert "optimizer state (Muon: 1, AdamW: 2 x fp32)" in report
    assert "Muon" not in format_plan(adamw, _recipe("adamw"), LLAMA3_8B, "--gpu-memory")


def test_auto_refuses_what_only_the_newton_schulz_workspace_breaks(monkeypatch):
    """21 GiB of tensors: AdamW fits with some layers checkpointed; Muon's optimizer step
    (every gradient shard, the updates, the exchange and its workspace) does not fit at any
    checkpointing, and the planner says so at that moment. Without the term, auto would
    have chosen a checkpointing that fits."""
    limit = 21 * GIB
    adamw = plan_memory(_recipe("adamw"), 8, limit, 0)
    muon = plan_memory(_recipe("muon"), 8, limit, 0)
    assert adamw.fits and muon.fits is False
    assert muon.peak_moment == "optimizer step"
    assert muon.breakdown["optimizer_workspace"] == muon.optimizer_step_bytes
    monkeypatch.setattr(memory_module, "muon_step_bytes", lambda *args: 0)
    unaware = plan_memory(_recipe("muon"), 8, limit, 0)
    assert unaware.fits and unaware.activation_checkpoint_layers < muon.n_layers


@pytest.mark.parametrize("hsdp", ["split", "repeat"])
def test_the_traffic_table_counts_the_exchange(hsdp):
    """Muon adds its all-to-alls within the group (``bytes_sent``) and, split over the
    replicas, its results across them (``bytes_across``)."""
    world, group = 16, 4
    muon = _recipe("muon", "sharding.shard_group_size=4", f"optim.muon_hsdp={hsdp}")
    adamw = _recipe("adamw", "sharding.shard_group_size=4")
    plan, _ = exchange_plan(muon, world, group)
    bf16 = DTYPES["bf16"]
    more = {
        key: traffic_table(muon, world, group)["hybrid"][key]
        - traffic_table(adamw, world, group)["hybrid"][key]
        for key in ("intra", "cross")
    }
    assert more == {"intra": plan.bytes_sent(bf16), "cross": plan.bytes_across(bf16)}
    assert (more["cross"] > 0) == (hsdp == "split")


def test_a_dry_run_of_a_muon_step_agrees_with_the_plan(isolated_env):
    """Every layer checkpointed and short windows: the optimizer step is the peak, planned
    and tracked, within 1%."""
    sets = [
        "optim.name=muon",
        "sharding.activation_checkpoint_layers=4",
        "data.seq_len=64",
        "optim.muon_bucket_mib=0.01",  # several buckets, two live at once
    ]
    args = ["plan", str(ROOT / "recipes" / "tiny.yaml"), "--gpus", "2", "--dry-run", "--json"]
    result = yatrain(*args, *(x for s in sets for x in ("--set", s)), env=isolated_env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["planned_peak_moment"] == out["tracked_peak_moment"] == "optimizer step"
    diff = out["tracked_peak_bytes"] - out["planned_peak_bytes"]
    assert abs(diff) <= 0.01 * out["planned_peak_bytes"], diff
    assert out["collectives"]["all_to_all"]["count"] > 2  # one pair per bucket
