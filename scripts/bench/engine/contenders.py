"""The engine benchmark's contenders, each built from the same model, weights and batches.

- yatrain: ``ShardedEngine.from_model`` + ``build_optimizer`` (fused AdamW over the flat
  shards), stepped by ``train_step`` with the plain loss (logits for every token, then
  cross-entropy), the loss every other contender uses: the engine alone is compared.
- yatrain-chunked: the same with the model's own loss (the output head fused with the
  cross-entropy, chunk by chunk), exactly what ``yatrain pretrain`` runs: the product.
- yatrain-pg: yatrain with ``force_process_group``: the buffered path (gathers,
  reduce-scatters, the communication stream) even with one rank.
- yatrain-pg-noclock: the same without the step clock ``yatrain pretrain`` always runs (the
  breakdown's timing pairs): the difference is what the clock costs.
- fsdp2: ``fully_shard`` on every decoder layer, then the root, ``MixedPrecisionPolicy``,
  foreach AdamW over the DTensor parameters; reduce-scatters every micro-batch.
- yatrain-compile, fsdp2-compile: the same two with every decoder layer compiled
  (``--compile-backend``, inductor by default), the plain loss, nothing else compiled.
  yatrain compiles each layer's forward function (``train.compile``); FSDP2 follows
  torchtitan's order: activation checkpointing, ``torch.compile`` of each block, then
  ``fully_shard`` of the compiled blocks and the root.
- yatrain-float8, fsdp2-float8: the compiled two with the decoder layers' projections in
  float8 (torchao, ``tensorwise``; GPUs of compute capability 8.9+ or CPU emulation).
  yatrain as ``train.float8: tensorwise`` runs (fp8 weight gathers, one amax all-reduce
  per step); FSDP2 as torchtitan runs it: torchao's float8 all-gather and its scales
  precomputed for all layers after each optimizer step. gloo cannot carry float8 bytes, so
  fsdp2-float8 runs on NCCL only.
- ddp: ``DistributedDataParallel`` of the whole model, ``no_sync`` on all but the last
  micro-batch, its all-reduce issued through ``torch.distributed`` so it is counted.
- bare (world 1): the plain single-process step (``bench.bare``).

Everything a contender needs is imported here, before ranks start, so that module import
does not land inside one contender's memory measurement and build time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from bench.bare import bare_adamw, bare_step, decay_groups
from yatrain.common import DTYPES
from yatrain.models.float8 import float8_projections, load_torchao
from yatrain.models.llama import Llama, materialize
from yatrain.models.loss import cross_entropy, logits_loss, model_loss
from yatrain.recipe.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    Recipe,
    ShardingConfig,
    TrainConfig,
)
from yatrain.runtime.process import Runtime
from yatrain.train.build import build_model_and_engine, meta_model
from yatrain.train.optim import build_optimizer
from yatrain.train.step import train_step
from yatrain.train.timing import StepClock

CONTENDERS = (
    "yatrain",
    "yatrain-chunked",
    "yatrain-pg",
    "yatrain-pg-noclock",
    "yatrain-compile",
    "fsdp2",
    "fsdp2-compile",
    "yatrain-float8",
    "fsdp2-float8",
    "ddp",
    "bare",
)
LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
OPTIM = OptimConfig(
    lr=LR, weight_decay=WEIGHT_DECAY, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_clip=CLIP
)


@dataclass
class Trainer:
    step: Callable  # step(micro_batches) -> detached mean loss tensor
    engine_bytes: Callable[[], int] | None = None  # the engine's own counter (yatrain)
    clock: StepClock | None = None  # yatrain: the loop's step-time breakdown (train/timing.py)
    extra: dict = field(default_factory=dict)


def model_config(o: dict) -> ModelConfig:
    return ModelConfig(
        dim=o["dim"],
        n_layers=o["n_layers"],
        n_heads=o["n_heads"],
        n_kv_heads=o["n_kv_heads"],
        ffn_dim=o["ffn_dim"],
        vocab_size=o["vocab"],
        max_seq_len=o["seq_len"],
    )


def contender_recipe(o: dict, force=False, compiled=False, float8: str | None = None) -> Recipe:
    """The benchmark's options as the recipe ``yatrain pretrain`` would run them: the model,
    dtypes, checkpointed layers, loss chunk, prefetch depth and seed every contender uses."""
    train = TrainConfig(
        steps=o["warmup"] + o["steps"],
        seed=o["seed"],
        dtype=o["dtype"],
        loss_chunk_tokens=o["loss_chunk_tokens"],
        compile=compiled,
        compile_backend=o["compile_backend"],
        float8=float8,
    )
    sharding = ShardingConfig(
        activation_checkpoint_layers=o["ac_layers"],
        reduce_dtype=o["reduce_dtype"],
        prefetch_depth=o["prefetch_depth"],
        reduce_staging_mib=o["reduce_staging_mib"],
        force_process_group=force,
    )
    data = DataConfig(seq_len=o["seq_len"], micro_batch_size=o["micro_batch"], global_batch_size=1)
    return Recipe(model=model_config(o), data=data, train=train, optim=OPTIM, sharding=sharding)


def _plain_model(o: dict, device: torch.device) -> Llama:
    """The contenders' model, materialised whole from the seed (every baseline's start)."""
    return materialize(meta_model(contender_recipe(o)), device, o["seed"])


def _opt_kind(opt: torch.optim.Optimizer) -> str:
    d = opt.defaults
    return "(fused)" if d.get("fused") else "(foreach)" if d.get("foreach") else ""


def build_yatrain(
    o: dict,
    device: torch.device,
    loss_fn=logits_loss,
    force=False,
    compiled=False,
    float8: str | None = None,
    timed=True,
) -> Trainer:
    recipe = contender_recipe(o, force, compiled, float8)
    model, engine = build_model_and_engine(recipe, Runtime.of_caller_group(device))
    opt = build_optimizer(engine.param_groups(WEIGHT_DECAY), OPTIM)

    clock = StepClock(engine, device) if timed else None

    def step(micros):
        return train_step(
            model, engine, opt, micros, grad_clip=CLIP, loss_fn=loss_fn, clock=clock
        ).loss

    extra = {"optimizer": type(opt).__name__ + _opt_kind(opt), "units": engine.n_units}
    return Trainer(step, engine_bytes=lambda: engine.bytes_sent, clock=clock, extra=extra)


def build_fsdp2(o: dict, device: torch.device, compiled=False, float8=False) -> Trainer:
    model = _plain_model(o, device)
    after_step = _fsdp2_float8(model) if float8 else lambda: None
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[o["dtype"]], reduce_dtype=DTYPES[o["reduce_dtype"]]
    )
    if compiled:  # the model checkpoints its first layers around each block's call
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer, backend=o["compile_backend"], fullgraph=True)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(
        decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, foreach=True
    )
    params = list(model.parameters())

    def step(micros):
        total = torch.zeros((), device=device)
        for x, y in micros:  # reduce-scatters every micro-batch, like the engine
            loss = cross_entropy(model(x), y)
            (loss / len(micros)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step()
        return total / len(micros)

    return Trainer(step, extra={"optimizer": "AdamW(foreach)"})


def _fsdp2_float8(model: torch.nn.Module) -> Callable[[], None]:
    """torchao float8 on the same projections, with its FSDP2 float8 all-gather; returns
    what runs after each optimizer step (every layer's scale in one batched pass)."""
    float8 = load_torchao()
    targets = {name for name, _ in float8_projections(model)}
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn in targets
    )
    return lambda: float8.precompute_float8_dynamic_scale_for_fsdp(model)


def _ddp_allreduce_hook(state, bucket):
    """DDP's default averaging all-reduce, issued through torch.distributed so it is counted."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    work = dist.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _replicated_trainer(model, run, device: torch.device, dtype: str, no_sync=None) -> Trainer:
    """Step of a replicated model (bare or DDP): ``bare_step`` with the same AdamW."""
    opt = bare_adamw(decay_groups(model, WEIGHT_DECAY), LR, betas=BETAS, eps=EPS)
    params, compute = list(model.parameters()), DTYPES[dtype]

    def step(micros):
        return bare_step(
            run, params, opt, micros, device=device, dtype=compute, clip=CLIP, no_sync=no_sync
        )[0]

    return Trainer(step, extra={"optimizer": "AdamW" + _opt_kind(opt)})


def build_ddp(o: dict, device: torch.device) -> Trainer:
    model = _plain_model(o, device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    ddp.register_comm_hook(None, _ddp_allreduce_hook)
    return _replicated_trainer(model, ddp, device, o["dtype"], no_sync=ddp.no_sync)


def build_bare(o: dict, device: torch.device) -> Trainer:
    model = _plain_model(o, device)
    return _replicated_trainer(model, model, device, o["dtype"])


# The yatrain contenders: build_yatrain's options for each (the planner's table reads them too).
YATRAIN_VARIANTS: dict[str, dict] = {
    "yatrain": {},
    "yatrain-chunked": {"loss_fn": model_loss},
    "yatrain-pg": {"force": True},
    "yatrain-pg-noclock": {"force": True, "timed": False},
    "yatrain-compile": {"compiled": True},
    "yatrain-float8": {"compiled": True, "float8": "tensorwise"},
}

BUILDERS = {
    **{name: partial(build_yatrain, **options) for name, options in YATRAIN_VARIANTS.items()},
    "fsdp2": build_fsdp2,
    "fsdp2-compile": lambda o, device: build_fsdp2(o, device, compiled=True),
    "fsdp2-float8": lambda o, device: build_fsdp2(o, device, compiled=True, float8=True),
    "ddp": build_ddp,
    "bare": build_bare,
}
