"""Context parallelism (sharding.context_parallel) equals one process: one sequence cut into
2 x CP chunks across ranks trains exactly like the whole sequence on one rank (gloo, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_ranks
from engine_reference import CFG, batches, engine_for, max_rel, reference, run_steps

from yatrain.context_parallel.group import ContextGroup
from yatrain.context_parallel.split import ContextParallel
from yatrain.models.llama import build_model
from yatrain.recipe.config import RopeScaling

CLIP, TOL = 1.0, 1e-5
# Llama 3.1's rotary scaling, reaching past an "original" context of 8 tokens: RoPE must
# see each token's place in the window
SCALED = dataclasses.replace(
    CFG, rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=8)
)


def documents(inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Document ids and restarted positions of windows in which every token divisible by 5
    starts a document (the walk's tokens: about one in five)."""
    starts = inputs % 5 == 0
    starts[:, 0] = True
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return {"document_ids": starts.cumsum(dim=1), "positions": index - first}


def _train_and_count(rank, world, data, micro, ckpt, cp, model_inputs, cfg=CFG):
    """Train, and the bytes this rank's K/V collectives sent over the run."""
    model = build_model(cfg, ckpt)
    engine = engine_for(model)
    context = ContextParallel(ContextGroup.build(cp, "cpu"))
    losses, norms = run_steps(model, engine, rank, world, data, micro, CLIP, context, model_inputs)
    return losses, norms, context.bytes_sent


def kv_bytes_per_run(data, world, micro, ckpt, cp) -> int:
    """What the K/V collectives must send over ``data``: per micro-batch and layer one
    all-gather (again in a checkpointed layer's recompute) and one reduce-scatter of the
    [2, micro, kv heads, T / CP, head dim] fp32 keys and values, (CP - 1) / CP of CP of them."""
    steps, global_batch, window = data.shape
    micro_batches = global_batch * cp // world // micro
    local = 2 * micro * CFG.n_kv_heads * (window - 1) // cp * CFG.head_dim * 4
    per_micro = (2 * CFG.n_layers + ckpt) * (cp - 1) * local
    return steps * micro_batches * per_micro


@pytest.mark.parametrize(
    ("world", "cp", "micro", "ckpt", "masked", "seq", "cfg"),
    [
        (2, 2, 2, 1, False, 12, CFG),  # CP 2, 4 micro-batches, one checkpointed layer
        (4, 2, 2, 1, True, 12, CFG),  # 2 data x 2 CP, 2 micro-batches, documents masked
        (4, 4, 4, 0, False, 16, SCALED),  # CP 4 with 2 KV heads (of 4), rope_scaling
    ],
)
def test_context_parallel_equals_one_process(world, cp, micro, ckpt, masked, seq, cfg):
    data = batches(8, seq=seq)
    inputs = documents if masked else None
    want_losses, want_norms, _ = reference(data, CLIP, cfg=cfg, model_inputs=inputs)
    results = run_ranks(world, _train_and_count, data, micro, ckpt, cp, inputs, cfg)
    for losses, norms, sent in results:
        assert max_rel(losses, want_losses) < TOL
        assert max_rel(norms, want_norms) < TOL
        assert sent == kv_bytes_per_run(data, world, micro, ckpt, cp)


def test_document_mask_changes_context_parallel_training():
    """The masked comparison above can fail: CP without the documents' mask is not the
    masked reference."""
    data = batches(8, steps=3)
    masked, _, _ = reference(data, CLIP, model_inputs=documents)
    results = run_ranks(2, _train_and_count, data, 2, 0, 2, None)
    assert max_rel(results[0][0], masked) > 1e-3
