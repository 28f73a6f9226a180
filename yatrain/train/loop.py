"""The training loop: recipe -> data -> model -> engine -> optimizer -> steps -> loggers.

Its contact with the model is narrow: build it on the meta device, hand it to the sharding
engine (which materialises each rank's shard), run forward/backward, step the optimizer.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from yatrain.config import Recipe, check_vocab, recipe_to_dict, validate_world_size
from yatrain.data import GlobalBatchLoader, Tokenizer, TokenShards
from yatrain.errors import ConfigError, DataError
from yatrain.models.llama import build_model, flops_per_token
from yatrain.sharding.engine import ShardedEngine
from yatrain.train.metrics import (
    MetricsFile,
    PeakMemory,
    format_summary,
    peak_flops,
    synchronize,
)
from yatrain.train.optim import build_optimizer, set_lr
from yatrain.train.runtime import Runtime, init_runtime
from yatrain.train.schedule import lr_at
from yatrain.train.wandb_logger import WandbLogger

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def pretrain(
    recipe: Recipe,
    *,
    recipe_name: str = "run",
    run_dir: Path | None = None,
    steps: int | None = None,
    progress: bool = True,
) -> dict:
    """Train from scratch as one process or one torchrun rank; returns the run summary."""
    if steps is not None:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=steps))
    runtime = init_runtime()
    try:
        return _train(recipe, runtime, recipe_name, run_dir, progress)
    finally:
        runtime.shutdown()


def _open_data(recipe: Recipe) -> TokenShards:
    shards = TokenShards.open(Path(recipe.data.path))
    check_vocab(recipe, shards.vocab_size)
    if recipe.data.tokenizer is not None:
        wanted = Tokenizer(Path(recipe.data.tokenizer))
        if wanted.sha256 != shards.tokenizer_sha256:
            raise DataError(
                f"data.tokenizer {recipe.data.tokenizer} is not the tokenizer the data at "
                f"{recipe.data.path} was prepared with: re-run prepare-data with it, or drop "
                "data.tokenizer"
            )
    return shards


def _make_run_dir(runtime: Runtime, recipe: Recipe, name: str, run_dir: Path | None) -> Path:
    if run_dir is None:
        run_dir = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(runtime.broadcast_object(str(run_dir)))
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run (metrics.jsonl): pass another "
            "--run-dir, or delete it"
        )
    runtime.barrier()  # every rank checked before rank 0 creates anything
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
        (run_dir / "config.yaml").write_text(text)
    return run_dir


def _train(recipe: Recipe, runtime: Runtime, name: str, run_dir: Path | None, progress: bool):
    cfg, device = recipe, runtime.device
    validate_world_size(cfg, runtime.world_size)
    loader = GlobalBatchLoader(
        _open_data(cfg),
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.data.global_batch_size,
        micro_batch_size=cfg.data.micro_batch_size,
        rank=runtime.rank,
        world_size=runtime.world_size,
        seed=cfg.train.seed,
    )
    run_dir = _make_run_dir(runtime, cfg, name, run_dir)

    model = build_model(cfg.model, cfg.sharding.activation_checkpoint_layers)
    seed = cfg.train.seed
    engine = ShardedEngine(
        model,
        model.units(),
        model.norm_modules(),
        init_unit=lambda index: model.init_unit_(index, seed),
        init_norms=model.init_norms_,
        device=device,
        param_dtype=DTYPES[cfg.train.dtype],
        reduce_dtype=DTYPES[cfg.sharding.reduce_dtype],
        prefetch_depth=cfg.sharding.prefetch_depth,
    )
    optimizer = build_optimizer(engine.param_groups(cfg.optim.weight_decay), cfg.optim)

    flops_token = flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = peak_flops(device, cfg.train.dtype)
    memory = PeakMemory(device)
    metrics_file = wandb = None
    if runtime.is_main:
        metrics_file = MetricsFile(run_dir / "metrics.jsonl")
        wandb = WandbLogger(cfg.logging.wandb, run_dir, recipe_to_dict(cfg), run_dir.name)
        _say(
            f"run dir {run_dir} | world size {runtime.world_size} | device {device} | "
            f"wandb {wandb.mode} | peak FLOP/s {peak / 1e12:.3g}T ({peak_source})"
        )

    total = cfg.train.steps
    bar = tqdm(
        total=total,
        disable=not (progress and runtime.is_main),
        desc="pretrain",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    records: list[dict] = []
    tokens_per_step = loader.tokens_per_step
    window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
    run_start = window_start
    for step in range(1, total + 1):
        lr = lr_at(
            step,
            lr=cfg.optim.lr,
            min_lr=cfg.optim.min_lr,
            warmup_steps=cfg.optim.warmup_steps,
            total_steps=total,
        )
        set_lr(optimizer, lr)
        t_data = time.perf_counter()
        micro_batches = loader.next_batch()
        data_wait += time.perf_counter() - t_data
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in micro_batches:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            loss_sum += loss.detach()
        engine.reduce_gradients()
        grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        engine.after_step()
        window_steps += 1
        bar.update(1)

        if step == 1 or step % cfg.train.log_every == 0 or step == total:
            loss_mean = loss_sum / len(micro_batches)
            if runtime.distributed:
                torch.distributed.all_reduce(loss_mean)
                loss_mean /= runtime.world_size
            synchronize(device)
            elapsed = time.perf_counter() - window_start
            tokens_per_s = window_steps * tokens_per_step / elapsed
            per_device = tokens_per_s / runtime.world_size
            record = {
                "step": step,
                "loss": loss_mean.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_seen": step * tokens_per_step,
                "step_time_s": elapsed / window_steps,
                "tokens_per_s": tokens_per_s,
                "tokens_per_s_per_device": per_device,
                "tflops_per_device": per_device * flops_token / 1e12,
                "mfu": per_device * flops_token / peak,
                "peak_memory_bytes": memory.read(),
                "data_wait_frac": data_wait / elapsed,
                "comm_bytes_sent": engine.bytes_sent,
            }
            records.append(record)
            if runtime.is_main:
                metrics_file.write(record)
                wandb.log(record, step=step)
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    tok_s=f"{tokens_per_s:,.0f}",
                    mfu=f"{record['mfu']:.1%}",
                )
                if not bar.disable:
                    bar.refresh()
                _say(_log_line(record), bar)
            window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
    bar.close()
    summary = _summary(records, time.perf_counter() - run_start, run_dir, cfg, runtime)
    if runtime.is_main:
        metrics_file.close()
        wandb.summary(summary)
        wandb.finish()
        _say(format_summary([(k, _fmt(v)) for k, v in summary.items()]))
    return summary


def _log_line(r: dict) -> str:
    mem = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}GiB"
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
        f"gnorm {r['grad_norm']:.3f} | {r['step_time_s']:.3f}s/step | "
        f"{r['tokens_per_s_per_device']:,.0f} tok/s/dev | {r['tflops_per_device']:.2f} TFLOP/s | "
        f"MFU {r['mfu']:.1%} | mem {mem}"
    )


def _summary(records, wall_s, run_dir, cfg, runtime) -> dict:
    steady = [r for r in records if r["step"] > 1] or records
    weights = [r["step_time_s"] for r in steady]
    mem = [r["peak_memory_bytes"] for r in records if r["peak_memory_bytes"] is not None]
    return {
        "run_dir": str(run_dir),
        "steps": records[-1]["step"],
        "world_size": runtime.world_size,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_seen": records[-1]["tokens_seen"],
        "wall_time_s": wall_s,
        "step_time_s": sum(weights) / len(weights),
        "tokens_per_s_per_device": sum(r["tokens_per_s_per_device"] for r in steady) / len(steady),
        "mfu": sum(r["mfu"] for r in steady) / len(steady),
        "peak_memory_bytes": max(mem) if mem else None,
        "dtype": cfg.train.dtype,
    }


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _say(message: str, bar: tqdm | None = None) -> None:
    if bar is not None and not bar.disable:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)
