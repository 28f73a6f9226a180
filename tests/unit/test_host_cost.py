"""Host work per step scales with units, not parameters (``bench.host_cost``).

Counted on two fork-started gloo ranks over a small model: collectives by kind, the ATen ops
the engine dispatches (in every thread), and, on the CUDA path over fake streams, the events
recorded and the stream waits. A per-parameter or per-piece regression changes these counts.
"""

from __future__ import annotations

import pytest
from bench.engine.cli import parse_args
from bench.host_cost import measure, report
from distributed import run_ranks
from engine_reference import CFG, SEED, batches, optimizer_for

from yatrain.models.llama import build_model
from yatrain.sharding import ShardedEngine
from yatrain.sharding.groups import hybrid_mesh
from yatrain.train.step import train_step

ACCUM, LAYERS = 2, 2
UNITS = LAYERS + 2  # embedding, the layers, output head


def _options(dim: int, staging_mib: str = "auto", ac_layers: int = 1) -> dict:
    args = parse_args(
        [
            *("--dim", str(dim), "--n-layers", str(LAYERS), "--n-heads", "4"),
            *("--n-kv-heads", "2", "--ffn-dim", str(3 * dim), "--vocab", "256"),
            *("--seq-len", "16", "--accum", str(ACCUM), "--ac-layers", str(ac_layers)),
            *("--steps", "1", "--warmup", "1", "--reduce-staging-mib", staging_mib),
        ]
    )
    return vars(args)


@pytest.fixture(scope="module")
def counts() -> dict[str, dict]:
    """dim 64 and 128 with the default budget; dim 128 with a budget of 8 KiB (a layer's
    fp32 gradient of about 200 KiB per rank then goes in about 13 pieces)."""
    return {
        "64": measure(_options(64), ["yatrain", "fsdp2"], 2),
        "128": measure(_options(128), ["yatrain"], 2)["yatrain"],
        "128 pieces": measure(_options(128, staging_mib=str(8 / 1024)), ["yatrain"], 2)["yatrain"],
    }


def test_one_reduce_scatter_per_unit_and_micro_batch(counts):
    mine = counts["64"]["yatrain"]
    assert mine["units"] == UNITS
    assert mine["reduce-scatters"] == ACCUM * UNITS + 1  # + the norm group, once a step
    # Each unit gathered for its forward and once more for its backward, but the ones still
    # resident (the last layer and the head) and the embedding, whose backward reads no
    # weights; the norm group once a step.
    assert mine["all-gathers"] <= ACCUM * 2 * UNITS
    assert mine["all-reduces"] == 1  # the gradient norm


def test_host_work_does_not_grow_with_the_parameters(counts):
    """Twice the width (4x the weights a layer): the same collectives, ops, events, waits."""
    small, large = counts["64"]["yatrain"], counts["128"]
    for key in ("reduce-scatters", "all-gathers", "engine ops", "events recorded", "stream waits"):
        assert small[key] == large[key], key


def test_cuda_events_and_waits_do_not_grow_with_the_pieces(counts):
    """A small staging budget cuts every unit into many pieces: more reduce-scatters (gloo
    issues them one by one), but on the CUDA path the same events and stream waits."""
    whole, pieces = counts["128"], counts["128 pieces"]
    assert pieces["reduce-scatters"] > 4 * whole["reduce-scatters"]
    assert pieces["events recorded"] == whole["events recorded"]
    assert pieces["stream waits"] == whole["stream waits"]
    # At most 2 events and 2 waits per reduction (a unit and micro-batch, plus the norm
    # group's), the rest being the gathers' own (2 each).
    reductions, gathers = whole["reduce-scatters"], whole["all-gathers"]
    assert whole["events recorded"] <= 2 * (reductions + gathers)
    assert whole["stream waits"] <= 2 * (reductions + gathers)


def test_engine_ops_stay_below_fsdp2(counts):
    found = counts["64"]
    assert found["yatrain"]["engine ops"] <= found["fsdp2"]["engine ops"]
    lines = report(found, ACCUM)
    assert all(line.endswith("ok") for line in lines if ": " in line and "<=" in line), lines


def _replica_all_reduces(rank: int, world: int) -> list[int]:
    """Hybrid sharding 2 x 2: the replicas' all-reduces of each step (2 micro-batches)."""
    model = build_model(CFG, 1)
    engine = ShardedEngine.from_model(model, device="cpu", seed=SEED, mesh=hybrid_mesh("cpu", 2))
    opt = optimizer_for(engine.param_groups(0.1))
    counts = []
    for step in batches(2 * world, steps=2):
        mine = step[2 * rank : 2 * rank + 2]
        micros = [(mine[i : i + 1, :-1], mine[i : i + 1, 1:]) for i in range(2)]
        before = engine.replica_comm.entered
        train_step(model, engine, opt, micros, grad_clip=0.5)
        counts.append(engine.replica_comm.entered - before)
    return counts


def test_hybrid_sharding_all_reduces_each_shard_once_a_step():
    """A guard: across replicas, one all-reduce per unit's shard and one for the norm group,
    per step (not per micro-batch, not per piece)."""
    units = CFG.n_layers + 2
    for counts in run_ranks(4, _replica_all_reduces):
        assert counts == [units + 1, units + 1]
