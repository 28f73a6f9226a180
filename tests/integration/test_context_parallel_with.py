"""Context parallelism with the engine's other features: hybrid sharding, tied embeddings,
float8 and compiled layers each train under CP as without it (gloo, fp32)."""

from __future__ import annotations

import dataclasses

import torch
import torch._dynamo.utils
from distributed import run_ranks
from engine_reference import CFG, batches, max_rel, reference, train_sharded

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


def test_float8_rowwise():
    """Rowwise scales are per token in the forward, so a rank that holds half of each
    window's tokens computes what one process computes on the same micro-batches: the first
    step's loss agrees within 1e-5 (measured 1.0e-7). The weight gradients' scales span the
    tokens a rank holds, so the gradient norm moves by float8's rounding (step 1: 7.1e-6),
    and from step 2 on a last-bit difference in a weight can flip a float8 rounding:
    measured over these 4 steps, losses within 7.3e-4 and gradient norms within 2.0e-3
    (over 10 steps 1.1e-3 and 1.2e-2; sharded float8 without CP against one process:
    norms within 2e-3, test_float8)."""
    data = batches(8, steps=4)
    want_losses, want_norms, _ = reference(data, CLIP, 0, "rowwise", piece=2)
    args = (data, 2, CLIP, 0, "fp32", "fp32", 1, None, "rowwise", CFG, 2)
    for losses, norms, _ in run_ranks(2, train_sharded, *args):
        assert max_rel(losses[:1], want_losses[:1]) < TOL
        assert max_rel(norms[:1], want_norms[:1]) < 1e-4
        assert max_rel(losses, want_losses) < 3e-3
        assert max_rel(norms, want_norms) < 1e-2
        assert losses[-1] < want_losses[0] - 0.5  # it trained


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
