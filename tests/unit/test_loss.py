"""The fused, chunked output head + cross-entropy trains exactly like the plain loss.

The plain path (logits for every token, then ``F.cross_entropy(logits.float(), targets)``) is
the reference: the chunked loss must give the same loss and gradients within fp32 tolerance
in one process, and the same training run (every step's loss and gradient norm, the final
weights) through the sharding engine at world sizes 1 and 2, with and without activation
checkpointing. It must also hold less memory and add no collectives however many chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from engine_reference import (
    CFG,
    SEED,
    batches,
    engine_for,
    max_rel,
    optimizer_for,
    reference,
    untrained,
    update_error,
    weights_rel,
)

from yatrain.models.llama import build_model, materialize
from yatrain.models.loss import linear_cross_entropy
from yatrain.plan.memtrack import LiveTensorTracker
from yatrain.recipe.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def plain_loss(h, weight, targets):
    return F.cross_entropy(F.linear(h, weight).flatten(0, -2).float(), targets.flatten())


# ----------------------------------------------------------------------------- the function


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_loss_and_gradients_equal_plain_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 21, 32, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(97, 32, generator=gen)).requires_grad_()
    targets = torch.randint(0, 97, (3, 21), generator=gen)
    targets[0, :5] = -100  # ignored, as in F.cross_entropy
    scale = torch.tensor(0.37)  # an upstream gradient other than 1

    loss = linear_cross_entropy(h, weight, targets, chunk)
    (loss * scale).backward()
    got = loss.detach(), h.grad.clone(), weight.grad.clone()
    h.grad = weight.grad = None
    want = plain_loss(h, weight, targets)
    (want * scale).backward()
    torch.testing.assert_close(got[0], want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], h.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got[2], weight.grad, rtol=1e-5, atol=1e-8)
    with torch.no_grad():  # evaluation: the same loss, no gradients computed
        torch.testing.assert_close(linear_cross_entropy(h, weight, targets, chunk), want)


def test_bf16_matmuls_stay_in_bf16_and_match_the_plain_bf16_path():
    """Every matmul in the parameter dtype (what a bf16 nn.Linear does), loss in fp32."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(97, 32, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, 97, (64,), generator=gen)
    seen = []

    class Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_"):
                seen.append({a.dtype for a in args if torch.is_tensor(a)})
            return func(*args, **(kwargs or {}))

    with Matmuls():
        loss = linear_cross_entropy(h, weight, targets, 16)
        loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert len(seen) == 3 * 4 and all(s == {torch.bfloat16} for s in seen)
    got = loss.detach(), h.grad.float(), weight.grad.float()
    h.grad = weight.grad = None
    want = plain_loss(h, weight, targets)
    want.backward()
    torch.testing.assert_close(got[0], want.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], h.grad.float(), rtol=0, atol=0)
    # The head's gradient is summed over 4 chunks in bf16: one rounding per chunk.
    assert (got[2] - weight.grad.float()).norm() / weight.grad.float().norm() < 1e-2


def test_rejects_bad_arguments():
    h, weight = torch.zeros(2, 3, 8), torch.zeros(5, 8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, weight, torch.zeros(2, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(h, weight, torch.zeros(2, 4, dtype=torch.long), 8)


def test_holds_far_less_memory_than_full_logits():
    """Live tensors above the model during forward+backward, vocab 4096 x 512 tokens: the
    plain loss holds bf16-or-fp32 logits plus fp32 copies for every token at once."""
    cfg = ModelConfig(
        dim=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        vocab_size=4096,
        max_seq_len=128,
    )
    tokens = torch.randint(0, cfg.vocab_size, (4, 129), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for chunk in (None, 64):
        model = materialize(build_model(cfg, loss_chunk_tokens=chunk or 1), "cpu", SEED)
        with LiveTensorTracker() as mem:
            mem.reset_peak()
            if chunk is None:
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            else:
                loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
            peaks[chunk] = mem.peak
    n_logits = 4 * 128 * cfg.vocab_size
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert peaks[None] > 3 * 4 * n_logits  # logits, log-softmax, its gradient: fp32 each
    # chunked: the parameter gradients plus one chunk's logits and small activations
    assert peaks[64] < weights + 3 * 4 * 64 * cfg.vocab_size + 4 * n_logits // 8


@pytest.mark.parametrize("ckpt", [0, CFG.n_layers])
def test_model_loss_and_gradients_equal_plain_path(ckpt):
    tokens = batches(3, steps=1)[0]
    grads = {}
    for fused in (False, True):
        model = materialize(build_model(CFG, ckpt, loss_chunk_tokens=5), "cpu", SEED)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if fused:
            loss = model(inputs, targets=targets)
        else:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grads[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=1e-6, atol=0)
    for name, want in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][name], want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- through the engine


def train_fused(rank, world, data, micro, clip, ckpt, chunk, dtype="fp32"):
    """The engine as the training loop drives it, with the chunked loss."""
    model = build_model(CFG, ckpt, loss_chunk_tokens=chunk)
    engine = engine_for(model, param_dtype=DTYPES[dtype])
    opt = optimizer_for(engine.param_groups(0.1))
    per_rank = data.shape[1] // world
    losses, norms = [], []
    for step in data:
        mine = step[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        for start in range(0, per_rank, micro):
            tokens = mine[start : start + micro]
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
            total += loss.detach()
        engine.reduce_gradients()
        norms.append(engine.clip_grad_norm_(clip).item())
        opt.step()
        engine.after_step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / (world * per_rank // micro))
    return losses, norms, engine.full_state_dict()


@pytest.mark.parametrize(
    "world,global_batch,micro,ckpt",
    [
        (1, 4, 2, 0),  # direct path, 2 micro-batches of 24 tokens in 5 chunks each
        (1, 4, 4, 1),
        (2, 4, 1, 0),  # 2 micro-batches per rank, 3 chunks each
        (2, 4, 2, CFG.n_layers),  # every layer checkpointed
    ],
)
def test_fused_loss_trains_like_the_plain_reference(world, global_batch, micro, ckpt):
    data = batches(global_batch)
    want_losses, want_norms, want_weights = reference(data, 0.5, ckpt)
    args = (data, micro, 0.5, ckpt, 5)
    got = [train_fused(0, 1, *args)] if world == 1 else run_ranks(world, train_fused, *args)
    got_losses, got_norms, got_weights = got[0]
    assert max_rel(got_losses, want_losses) < 1e-5
    assert max_rel(got_norms, want_norms) < 1e-5
    assert weights_rel(got_weights, want_weights) < 1e-5


def test_fused_bf16_stays_close_to_fp32_reference():
    """Same tolerances as the plain bf16 engine test (tests/unit/test_engine.py)."""
    data = batches(4)
    want_losses, want_norms, want_weights = reference(data, clip=1.0)
    _, start = untrained(data)
    got_losses, got_norms, got_weights = run_ranks(2, train_fused, data, 1, 1.0, 1, 5, "bf16")[0]
    assert max_rel(got_losses, want_losses) < 5e-3
    assert max_rel(got_norms, want_norms) < 2e-2
    assert update_error(got_weights, want_weights, start) < 0.25


def _collectives_per_step(rank, world, chunk):
    """Collective calls of one training step (second step: steady state)."""
    calls = {}
    originals = {}
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        originals[name] = getattr(dist, name)

        def counted(*args, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return originals[_name](*args, **kwargs)

        setattr(dist, name, counted)
    try:
        model = build_model(CFG, 0, loss_chunk_tokens=chunk or 1)
        engine = engine_for(model)
        for index, step in enumerate(batches(2 * world, steps=2)):
            if index == 1:
                calls.clear()
            for micro in step[rank * 2 : rank * 2 + 2].split(1):
                if chunk is None:  # the plain path
                    logits = model(micro[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten())
                else:
                    loss = model(micro[:, :-1], targets=micro[:, 1:])
                loss.backward()
            engine.reduce_gradients()
            engine.clip_grad_norm_(1.0)
            engine.after_step()
        return dict(calls)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def test_head_is_gathered_and_reduced_once_per_micro_batch_however_many_chunks():
    """The chunk loop runs inside the head's one forward call: 12 chunks of 1 token or one
    chunk of 12 make the same collectives as the plain loss."""
    plain = run_ranks(2, _collectives_per_step, None)[0]
    assert run_ranks(2, _collectives_per_step, 1)[0] == plain
    assert run_ranks(2, _collectives_per_step, 64)[0] == plain
