"""The reference the engine tests compare with, and the sharded run they compare.

A small Llama trained on fixed, learnable batches: ``reference`` in one plain process on the
whole global batch, ``train_sharded`` through the engine on one rank of a gloo group, the
way the training loop drives it. Engine, float8, hybrid and compile tests share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yatrain.common import DTYPES
from yatrain.context_parallel.group import ContextGroup
from yatrain.context_parallel.split import ContextParallel
from yatrain.data.batch import MicroBatch
from yatrain.models.float8 import apply_float8
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.config import ModelConfig
from yatrain.runtime.compile import compile_layers
from yatrain.sharding import ShardedEngine
from yatrain.sharding.traffic import StepTraffic, step_traffic
from yatrain.train.optim import run_optimizer, set_lr
from yatrain.train.schedule import lr_at
from yatrain.train.step import train_step

CFG = ModelConfig(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=80,
    vocab_size=61,
    rope_theta=1e4,
    norm_eps=1e-5,
    max_seq_len=16,
)
SEQ, STEPS, SEED = 12, 10, 7


def batches(global_batch: int, steps: int = STEPS, seq: int = SEQ) -> torch.Tensor:
    """[steps, global_batch, seq + 1] tokens. Each sequence walks through the vocabulary in
    random strides of 1-3 from a random start: learnable (the best loss is ln 3), so ten steps
    of training take the loss far below an untrained model's on the same batches."""
    gen = torch.Generator().manual_seed(1234)
    start = torch.randint(0, CFG.vocab_size, (steps, global_batch, 1), generator=gen)
    strides = torch.randint(1, 4, (steps, global_batch, seq), generator=gen)
    return torch.cat([start, start + strides.cumsum(-1)], dim=-1) % CFG.vocab_size


def loss_of(model, tokens: torch.Tensor, model_inputs=None) -> torch.Tensor:
    """The plain loss of whole windows; ``model_inputs``: extra model arguments (document
    ids, positions) computed from the inputs."""
    extra = model_inputs(tokens[:, :-1]) if model_inputs is not None else {}
    logits = model(tokens[:, :-1], **extra)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def optimizer_for(groups) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def reference(
    data: torch.Tensor,
    clip: float,
    ckpt: int = 0,
    float8: str | None = None,
    piece: int = 0,
    cfg: ModelConfig = CFG,
    model_inputs=None,
):
    """Plain model, whole global batch per step: the ground truth.

    Returns each step's loss, each step's gradient norm as ``clip_grad_norm_`` reports it
    (before clipping; with clipping off it is measured with an infinite limit, which
    scales by exactly 1) and the final weights. ``float8``: its projections in float8;
    ``piece``: accumulate the gradient over pieces of this many sequences, the ones the
    ranks' micro-batches see (float8's dynamic scales depend on what one matmul sees);
    ``cfg``: another model (a tied head); ``model_inputs``: see ``loss_of``."""
    torch.manual_seed(0)
    model = build_model(cfg, ckpt)
    apply_float8(model, float8)
    model = materialize(model, "cpu", SEED)
    params = list(model.parameters())
    opt = optimizer_for(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    )
    losses, norms = [], []
    for step in data:
        pieces = step.split(piece or len(step))
        loss = sum(loss_of(model, part, model_inputs) / len(pieces) for part in pieces)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip or float("inf")).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def untrained(data: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The initial model's loss on every batch, and its weights: what "no training" gives."""
    model = materialize(build_model(CFG), "cpu", SEED)
    losses = [loss_of(model, step).item() for step in data]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_sharded(
    rank,
    world,
    data,
    micro,
    clip,
    ckpt,
    dtype="fp32",
    reduce="fp32",
    depth=1,
    compile=None,
    float8=None,
    cfg=CFG,
    cp=1,
    model_inputs=None,
    optim=None,
    **options,
):
    """The engine as the training loop drives it; returns losses, gradient norms, weights.
    ``compile``: a torch.compile backend for the decoder layers (train.compile); ``float8``:
    train.float8; ``cfg``: another model; ``cp``: context-parallel ranks per window;
    ``model_inputs``: see ``loss_of``; ``optim``: the run's optimizer of this
    ``OptimConfig`` and its schedule (default: ``optimizer_for``, a constant rate);
    ``options`` go to the engine."""
    model = build_model(cfg, ckpt)
    engine = engine_for(
        model,
        param_dtype=DTYPES[dtype],
        reduce_dtype=DTYPES[reduce],
        prefetch_depth=depth,
        float8=apply_float8(model, float8),
        **options,
    )
    context = ContextParallel(ContextGroup.build(cp, "cpu")) if cp > 1 else None
    if compile is not None:
        compile_layers(model.layers, compile, eager_attention=context is not None)
    steps = run_steps(model, engine, rank, world, data, micro, clip, context, model_inputs, optim)
    return *steps, engine.full_state_dict()


def run_steps(
    model, engine, rank, world, data, micro, clip, context=None, model_inputs=None, optim=None
) -> tuple[list[float], list[float]]:
    """Train ``engine`` on this rank's share of every global batch in ``data``, ``micro``
    sequences per micro-batch; each step's global loss and gradient norm. Under
    ``context`` parallelism a data rank's CP group shares its share; ``optim``: see
    ``train_sharded``."""
    if optim is None:
        opt = optimizer_for(engine.param_groups(0.1))
    else:
        opt = run_optimizer(engine, model, optim)
    cp = context.size if context is not None else 1
    per_rank = data.shape[1] * cp // world
    losses, norms = [], []
    for number, step in enumerate(data, start=1):
        if optim is not None:
            set_lr(opt, lr_at(number, optim, len(data)))
        first = rank // cp * per_rank
        mine = step[first : first + per_rank]
        micros = []
        for start in range(0, per_rank, micro):
            inputs, targets = mine[start : start + micro, :-1], mine[start : start + micro, 1:]
            extra = model_inputs(inputs) if model_inputs is not None else {}
            micros.append(MicroBatch(inputs, targets, extra))
        outcome = train_step(model, engine, opt, micros, grad_clip=clip, context=context)
        norms.append(outcome.grad_norm.item())
        loss = outcome.loss
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses, norms


def engine_for(model, **kwargs) -> ShardedEngine:
    """The engine over a meta-device Llama, initialised from SEED, on the CPU."""
    return ShardedEngine.from_model(model, device="cpu", seed=SEED, **kwargs)


def planned_traffic(engine: ShardedEngine, **extra: int) -> StepTraffic:
    """What the planner's formula says one fp32 step of ``engine`` (one micro-batch) sends;
    ``extra``: ``step_traffic``'s optimizer terms."""
    return step_traffic(
        [layout.numel for layout in engine.layouts],
        engine.reads_weights,
        engine.small.numel,
        shard_size=engine.shard_size,
        replicas=engine.replicas,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        micro_batches=1,
        **extra,
    )


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def weights_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def update_error(got: dict, want: dict, start: dict) -> float:
    """Per tensor, how far ``got`` is from ``want`` as a share of how far training moved
    ``want`` from ``start``; the worst tensor. An untrained model scores 1."""
    assert got.keys() == want.keys() == start.keys()
    return max(((got[k] - want[k]).norm() / (want[k] - start[k]).norm()).item() for k in want)


# A trained model's last loss must beat the untrained model's loss on the same batch by this
# much (nats). Measured: 1.5-1.7 nats after 10 steps on these batches (4.63 -> 3.09).
TRAINED_MARGIN = 1.0
