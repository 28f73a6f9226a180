"""Muon under hybrid sharding: an owner per matrix in each replica (``optim.muon_hsdp:
repeat``) or one in the whole world (``split``), on 4 fork-started gloo ranks (2 x 2).

Both modes train the same bits (the owners assemble the same matrices); a checkpoint of one
resumes in the other, and ``--reset-optimizer`` starts a split Muon from an AdamW run (the
state is per shard: owners matter within a step only). The traffic counters see split's
all-to-all across the replicas, and so does the planner's ``step_traffic``;
``test_both_modes_measured_beside_the_replica_all_reduce`` prints what each mode sends and
how long its steps take (the equivalence with torch's Muon is ``tests/unit/test_muon.py``'s).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import pytest
import torch
from conftest import ROOT
from distributed import run_ranks
from engine_reference import CFG, batches, engine_for, planned_traffic
from test_checkpoint import full_state, losses, recipe

from yatrain.checkpoint import store as ckpt
from yatrain.errors import ConfigError
from yatrain.models.llama import DecoderLayer, build_model
from yatrain.recipe.config import OptimConfig
from yatrain.recipe.load import load_recipe
from yatrain.sharding.groups import hybrid_mesh
from yatrain.train.loop import pretrain
from yatrain.train.optim import run_optimizer
from yatrain.train.setup import Checks
from yatrain.train.step import train_step

HYBRID = ("sharding.shard_group_size=2", "checkpoint.every=2")
MUON = ("optim.name=muon",)
OPTIM = OptimConfig(lr=3e-3, name="muon")  # bf16 Newton-Schulz and exchange: the default


def _train(rank, world, data, run_dir, steps, extra, reset=False):
    checks = Checks(reset_optimizer=reset)
    pretrain(
        recipe(data, *HYBRID, *extra), run_dir=run_dir, steps=steps, progress=False, checks=checks
    )
    return rank


def _split(steps: int, data, run_dir, reset=False) -> None:
    run_ranks(4, _train, data, run_dir, steps, (*MUON, "optim.muon_hsdp=split"), reset)


def test_split_trains_the_bits_of_repeat_and_resumes_its_checkpoints(small_data, tmp_path):
    _split(6, small_data, tmp_path / "split")
    run_dir = tmp_path / "repeat-then-split"
    run_ranks(4, _train, small_data, run_dir, 4, (*MUON, "optim.muon_hsdp=repeat"))
    _split(6, small_data, run_dir)
    assert losses(run_dir) == losses(tmp_path / "split")  # bitwise: losses and norms


def test_reset_optimizer_starts_a_split_muon_from_an_adamw_checkpoint(small_data, tmp_path):
    run_dir = tmp_path / "run"
    run_ranks(4, _train, small_data, run_dir, 2, ())  # AdamW
    _split(4, small_data, run_dir, reset=True)
    _split(6, small_data, run_dir)  # and a split run's own checkpoint resumes
    assert list(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    step = run_dir / "checkpoints/step-6"
    assert json.loads((step / ckpt.MANIFEST).read_text())["optimizer"] == "muon"
    assert any(k.startswith("momentum_buffer.") for k in full_state(step, tmp_path))


def test_muon_hsdp_takes_repeat_or_split_in_one_line():
    tiny = ROOT / "recipes/tiny.yaml"
    assert load_recipe(tiny, ["optim.name=muon"]).optim.muon()["hsdp"] == "split"
    with pytest.raises(ConfigError, match="'optim.muon_hsdp' has invalid value") as bad:
        load_recipe(tiny, ["optim.name=muon", "optim.muon_hsdp=both"])
    assert "choose one of 'split', 'repeat'" in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="'optim.muon_hsdp' is a Muon key"):
        load_recipe(tiny, ["optim.muon_hsdp=split"])


def _steps(rank, world, mode, cfg, steps, seq=12):
    """``steps`` Muon steps at 2 x 2 in ``mode``: the bytes of the last one (within the
    group, across the replicas: all-to-all and the gradients' all-reduce), what the exchange
    says it sends, and the median time of a whole step and of the optimizer's."""
    model = build_model(cfg)
    engine = engine_for(model, mesh=hybrid_mesh("cpu", 2))
    opt = run_optimizer(engine, model, dataclasses.replace(OPTIM, muon_hsdp=mode))
    inner, spent = opt.step, []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        inner(*args, **kwargs)
        spent.append(time.perf_counter() - started)

    opt.step = timed
    tokens, took = batches(2 * world, steps=steps, seq=seq), []
    for step in tokens:
        before = {"within": engine.comm.traffic(), "across": engine.replica_comm.traffic()}
        started = time.perf_counter()
        mine = step[2 * rank : 2 * rank + 2]
        train_step(model, engine, opt, [(mine[:, :-1], mine[:, 1:])], grad_clip=1.0)
        took.append(time.perf_counter() - started)
    sent = {
        "within": engine.comm.traffic()["all_to_all"][1] - before["within"]["all_to_all"][1],
        "across": engine.replica_comm.traffic()["all_to_all"][1]
        - before["across"]["all_to_all"][1],
        "all_reduce": engine.replica_comm.traffic()["all_reduce"][1]
        - before["across"]["all_reduce"][1],
        "across_count": engine.replica_comm.traffic()["all_to_all"][0],
        "step_s": statistics.median(took[1:] or took),
        "optimizer_s": statistics.median(spent[1:] or spent),
        "cross_total": engine.bytes_sent_cross,
    }
    exchange = opt.exchange
    said = (exchange.bytes_sent(torch.bfloat16), exchange.bytes_across(torch.bfloat16))
    planned = planned_traffic(engine, exchanged=said[0], across=said[1])
    sent["planned_cross"] = planned.cross
    return sent, said, steps


def _matrix_elements(cfg) -> int:
    model = build_model(cfg)
    return sum(
        p.numel()
        for unit in model.units()
        if isinstance(unit, DecoderLayer)
        for p in unit.parameters()
        if p.ndim == 2
    )


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_traffic_counts_the_split_modes_bytes_across_replicas(mode):
    """split: each rank sends its block of results (its pieces of the matrices its replica
    owns) to the other replica, once a step, on the replicas' communicator, which counts
    exactly that: every matrix element crosses once, in bf16. repeat sends nothing across."""
    ranks = run_ranks(4, _steps, mode, CFG, 2)
    for sent, (within, across), steps in ranks:
        assert sent["within"] == within > 0  # the group's two all-to-alls, as before
        assert sent["across"] == across
        assert sent["across_count"] == (2 if mode == "split" else 0)
        assert sent["cross_total"] == steps * (sent["all_reduce"] + across)
        assert sent["planned_cross"] == sent["all_reduce"] + across  # the planner's formula
    total = sum(sent["across"] for sent, _, _ in ranks)
    assert total == (2 * _matrix_elements(CFG) if mode == "split" else 0)


# A model whose Newton-Schulz is not lost in the noise: 2 layers of 128 x 128 attention and
# 128 x 344 feed-forward matrices (360k of its 490k weights), 2 sequences of 64 a rank.
MEASURED = dataclasses.replace(
    CFG, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=344, vocab_size=512, max_seq_len=64
)


def test_both_modes_measured_beside_the_replica_all_reduce(capsys):
    """What each mode sends a step, a rank's mean, within its group and across the replicas
    (bf16), beside the replicas' gradient all-reduce (fp32), and the median step and
    optimizer times on gloo (4 ranks on this machine's cores: indicative only)."""
    lines = [f"{'mode':<7}{'within':>11}{'across':>11}{'all-reduce':>12}{'+%':>7}"
             f"{'step s':>9}{'optim s':>9}"]  # fmt: skip
    sent = {}
    for mode in ("repeat", "split"):
        ranks = run_ranks(4, _steps, mode, MEASURED, 3, 64)
        sent[mode] = [r[0] for r in ranks]
        mean = {k: sum(r[k] for r in sent[mode]) // 4 for k in ("within", "across", "all_reduce")}
        share = 100 * mean["across"] / mean["all_reduce"]
        timed = sent[mode][0]  # the ranks wait for each other: rank 0's times are the step's
        lines.append(
            f"{mode:<7}{mean['within']:>11,}{mean['across']:>11,}{mean['all_reduce']:>12,}"
            f"{share:>6.1f}%{timed['step_s']:>9.3f}{timed['optimizer_s']:>9.3f}"
        )
    with capsys.disabled():
        print("\nMuon at 2 x 2 on gloo, bytes a rank sends a step (mean):\n" + "\n".join(lines))
    assert all(r["across"] == 0 for r in sent["repeat"])
    assert all(r["across"] > 0 for r in sent["split"])
    assert sum(r["within"] for r in sent["split"]) < sum(r["within"] for r in sent["repeat"])
