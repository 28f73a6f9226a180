"""Context parallelism with the engine's other features: hybrid sharding, tied embeddings,
float8 and compiled layers each train under CP as without it (gloo, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo.utils
from distributed import run_ranks
from engine_reference import CFG, batches, max_rel, reference, train_sharded, weights_rel

CLIP, TOL = 1.0, 1e-5


def _hybrid(rank, world, data):
    from yatrain.sharding import hybrid_mesh

    mesh = hybrid_mesh("cpu", 2)  # 2 replicas of shard groups of 2; CP groups inside them
    return train_sharded(rank, world, data, 2, CLIP, 1, cp=2, mesh=mesh)


def test_hybrid_sharding():
    data = batches(8)
    want_losses, want_norms, _ = reference(data, CLIP)
    for losses, norms, _ in run_ranks(4, _hybrid, data):
        assert max_rel(losses, want_losses) < TOL
        assert max_rel(norms, want_norms) < TOL


def test_tied_embeddings():
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    data = batches(8)
    want_losses, want_norms, _ = reference(data, CLIP, cfg=tied)
    args = (data, 2, CLIP, 1, "fp32", "fp32", 1, None, None, tied, 2)
    for losses, norms, _ in run_ranks(2, train_sharded, *args):
        assert max_rel(losses, want_losses) < TOL
        assert max_rel(norms, want_norms) < TOL


# How far 10 steps of float8 on a CP group of 2 drift from one process on the same
# micro-batches. Measured (`python tests/float8_drift.py 12 context`: 12 seeds of weights and
# batches, 2026-12-05). Rowwise scales are per token in the forward, so step 1's loss agrees
# (within 2.1e-7); the weight gradients' scales span the tokens a rank holds, so gradient
# norms move by float8's rounding (2.2e-5). Tensorwise scales an activation by its amax over
# the rank's own tokens, which differ from one process's: step 1 differs by float8's
# rounding (losses 3.2e-4, norms 1.6e-3), and every step after it quantizes differently.
# Over 10 steps: losses 8.2e-3 / 2.2e-3 apart (tensorwise / rowwise), gradient norms
# 5.4e-2 / 1.8e-2, final weights 0.139 / 0.038 (relative norm of the worst tensor): what
# float8 itself moves the weights from fp32 on the same batches (0.10-0.14, seeds 0-3).
# Bounds: 4x the largest drift measured; the weights within 1.5x float8's own distance
# from fp32 in this test's run.
FLOAT8_CP_DRIFT = {
    "tensorwise": {"step-1 loss": 1.5e-3, "step-1 norm": 7e-3, "loss": 3.5e-2, "norm": 0.22},
    "rowwise": {"step-1 loss": 1e-6, "step-1 norm": 1e-4, "loss": 9e-3, "norm": 7.5e-2},
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8(recipe):
    """CP 2 in float8 trains as one process in float8 on the same micro-batches does,
    within the drift above: it adds no more error than float8 itself."""
    data = batches(8)
    want = reference(data, CLIP, 0, recipe, piece=2)
    fp32 = reference(data, CLIP, 0, None, piece=2)
    args = (data, 2, CLIP, 0, "fp32", "fp32", 1, None, recipe, CFG, 2)
    bounds = FLOAT8_CP_DRIFT[recipe]
    for losses, norms, weights in run_ranks(2, train_sharded, *args):
        assert max_rel(losses[:1], want[0][:1]) < bounds["step-1 loss"]
        assert max_rel(norms[:1], want[1][:1]) < bounds["step-1 norm"]
        assert max_rel(losses, want[0]) < bounds["loss"]
        assert max_rel(norms, want[1]) < bounds["norm"]
        assert weights_rel(weights, want[2]) < 1.5 * weights_rel(want[2], fp32[2])
        assert losses[-1] < want[0][0] - 0.5  # it trained


def _compiled(rank, world, data, backend):
    torch.compiler.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses, norms, _ = train_sharded(rank, world, data, 2, CLIP, 1, compile=backend, cp=2)
    return losses, norms, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def test_compiled_layers():
    """Under CP each layer's norms and feed-forward are compiled (aot_eager: dynamo's
    tracing and autograd graphs, eager kernels) and its attention, with the K/V collectives,
    runs eagerly between them: the losses of eager CP and of one process."""
    data = batches(8, steps=4)
    want_losses, want_norms, _ = reference(data, CLIP, ckpt=1)
    eager = run_ranks(2, _compiled, data, None)
    compiled = run_ranks(2, _compiled, data, "aot_eager")
    for (e_losses, e_norms, _), (c_losses, c_norms, graphs) in zip(eager, compiled, strict=True):
        assert graphs == 2  # RMSNorm.forward and FeedForward.forward, shared by every layer
        assert max_rel(c_losses, e_losses) < TOL  # aot_eager: measured 1.2e-7
        assert max_rel(c_norms, e_norms) < TOL
        assert max_rel(c_losses, want_losses) < TOL
        assert max_rel(c_norms, want_norms) < TOL


def test_bf16_weights():
    """bf16 weights and activations (fp32 reduction): CP 2 trains as the sharded run
    without CP does, within bf16's rounding (the additive masks are bf16 too; measured
    over 5 steps: losses 2.4e-4, gradient norms 2.0e-3 apart)."""
    data = batches(8, steps=5)
    args = (data, 2, CLIP, 1, "bf16")
    plain = run_ranks(2, train_sharded, *args)[0]
    cut = run_ranks(2, _bf16_cp, *args)[0]
    assert max_rel(cut[0], plain[0]) < 5e-3
    assert max_rel(cut[1], plain[1]) < 2e-2
    assert cut[0][-1] < cut[0][0] - 0.5  # it trained


def _bf16_cp(rank, world, *args):
    return train_sharded(rank, world, *args, cp=2)
