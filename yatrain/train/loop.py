"""The training loop: recipe -> data -> model -> engine -> optimizer -> steps -> loggers.

Its contact with the model is narrow: build it on the meta device, hand it to the sharding
engine (which materialises each rank's shard), run forward/backward, step the optimizer.
Checkpoints capture everything the next step depends on (weights, AdamW state, the global
data position; no random state is drawn during training), so a resumed run continues bit for
bit at the same world size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from yatrain.config import Recipe, check_vocab, recipe_to_dict, validate_world_size
from yatrain.data import build_loader
from yatrain.errors import Interrupted, TrainingError
from yatrain.models.llama import build_model, flops_per_token
from yatrain.sharding.engine import ShardedEngine
from yatrain.train import checkpoint as ckpt
from yatrain.train.guard import StepGuard
from yatrain.train.metrics import MetricsFile, PeakMemory, peak_flops, synchronize
from yatrain.train.optim import build_optimizer, set_lr
from yatrain.train.report import format_summary, log_line, metrics_record, run_summary, say
from yatrain.train.resume import check_fresh_start_allowed, run_dir_for, truncate_metrics
from yatrain.train.runtime import Runtime, init_runtime
from yatrain.train.schedule import lr_at
from yatrain.train.wandb_logger import WandbLogger
from yatrain.train.weights import init_from_source

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def pretrain(
    recipe: Recipe,
    *,
    recipe_name: str = "run",
    run_dir: Path | None = None,
    steps: int | None = None,
    resume: str = "auto",
    progress: bool = True,
) -> dict:
    """Train as one process or one torchrun rank; returns the run summary."""
    if steps is not None:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=steps))
    runtime = init_runtime()
    try:
        return _train(recipe, runtime, recipe_name, run_dir, resume, progress)
    except dist.DistBackendError as error:
        first = str(error).strip().splitlines()[0][:200]
        raise TrainingError(
            f"lost contact with another rank ({first}): it failed or was killed; "
            "its own output above says why"
        ) from None
    finally:
        runtime.shutdown()


def _checkpoint_layers(cfg: Recipe, runtime: Runtime) -> int:
    """The recipe's number, or the memory planner's choice for ``auto`` (logged)."""
    layers = cfg.sharding.activation_checkpoint_layers
    if layers != "auto":
        return layers
    from yatrain.plan.memory import resolve_auto_checkpoint_layers

    layers, why = resolve_auto_checkpoint_layers(cfg, runtime.world_size, runtime.device)
    if runtime.is_main:
        say(f"sharding.activation_checkpoint_layers auto -> {layers}: {why}")
    return layers


def _build_engine(cfg: Recipe, runtime: Runtime):
    device = runtime.device
    model = build_model(cfg.model, _checkpoint_layers(cfg, runtime))
    seed = cfg.train.seed
    init_unit, init_norms = (lambda index: model.init_unit_(index, seed)), model.init_norms_
    if cfg.train.init_from is not None:
        init_unit, init_norms = init_from_source(Path(cfg.train.init_from), cfg.model, model)
    engine = ShardedEngine(
        model,
        model.units(),
        model.norm_modules(),
        init_unit=init_unit,
        init_norms=init_norms,
        device=device,
        param_dtype=DTYPES[cfg.train.dtype],
        reduce_dtype=DTYPES[cfg.sharding.reduce_dtype],
        prefetch_depth=cfg.sharding.prefetch_depth,
    )
    return model, engine


def _device_mesh(runtime: Runtime):
    if not runtime.distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(runtime.device.type, (runtime.world_size,))


def _find_resume(runtime, resume: str, root: Path, cfg: Recipe, engine) -> tuple[Path, dict] | None:
    """Rank 0 inspects the files and decides; every rank gets the same answer or error."""
    numels = engine.unit_numels
    answer: object = None
    if runtime.is_main and resume != "never":
        try:
            if resume == "auto":
                answer = ckpt.find_resume_checkpoint(root, cfg.model, numels, say)
            else:
                path = Path(resume)
                answer = (path, ckpt.validate_checkpoint(path, cfg.model, numels))
        except ckpt.CheckpointError as error:
            answer = str(error)
    answer = runtime.broadcast_object(answer)
    if isinstance(answer, str):
        raise ckpt.CheckpointError(answer)
    return answer


def _train(recipe, runtime: Runtime, name: str, run_dir, resume: str, progress: bool) -> dict:
    cfg, device = recipe, runtime.device
    validate_world_size(cfg, runtime.world_size)
    # Mid-run notices (a mixture source starting a new epoch) go above the progress bar.
    notice = (lambda message: tqdm.write(message, file=sys.stderr)) if runtime.is_main else None
    loader = build_loader(
        cfg.data, seed=cfg.train.seed, rank=runtime.rank, world_size=runtime.world_size,
        notice=notice,
    )  # fmt: skip
    check_vocab(cfg, loader.vocab_size)
    run_dir = Path(
        runtime.broadcast_object(str(run_dir_for(resume, run_dir, name, cfg.checkpoint.dir)))
    )
    check_fresh_start_allowed(run_dir, resume)
    ckpt_root = run_dir / cfg.checkpoint.dir

    model, engine = _build_engine(cfg, runtime)
    optimizer = build_optimizer(engine.param_groups(cfg.optim.weight_decay), cfg.optim)
    mesh = _device_mesh(runtime)
    start_step, skipped, last_ckpt = 0, 0, None
    found = _find_resume(runtime, resume, ckpt_root, cfg, engine)
    if found is not None:
        last_ckpt, manifest = found
        ckpt.load_checkpoint(last_ckpt, engine, optimizer, mesh)
        loader.load_state_dict(manifest["loader"])
        start_step, skipped = manifest["step"], manifest.get("skipped_steps", 0)

    total = cfg.train.steps
    recipe_dict = recipe_to_dict(cfg)
    recipe_text = yaml.safe_dump(recipe_dict, sort_keys=False)
    metrics_file = wandb = None
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(recipe_text)
        moved = truncate_metrics(run_dir / "metrics.jsonl", start_step)
        if moved is not None:
            say(f"{run_dir} had metrics but no checkpoint: kept them as {moved.name}")
        metrics_file = MetricsFile(run_dir / "metrics.jsonl")
        wandb = WandbLogger(cfg.logging.wandb, run_dir, recipe_dict, run_dir.name)
    peak, peak_source = peak_flops(device, cfg.train.dtype)
    if runtime.is_main:
        where = f"resumed from {last_ckpt} (step {start_step})" if last_ckpt else "fresh start"
        say(
            f"run dir {run_dir} | {where} | world size {runtime.world_size} | device {device} | "
            f"wandb {wandb.mode} | peak FLOP/s {peak / 1e12:.3g}T ({peak_source})"
        )
        say(loader.describe(total))
    if start_step >= total:
        say(f"nothing to do: the run is already at step {start_step} of {total}")
        return {"run_dir": str(run_dir), "steps": start_step}

    def save(step: int) -> Path:
        meta = {
            "model": dataclasses.asdict(cfg.model),
            "recipe_sha256": hashlib.sha256(recipe_text.encode()).hexdigest(),
            "loader": loader.state_dict(),
            "tokens_seen": step * loader.tokens_per_step,
            "skipped_steps": skipped,
            "dtype": cfg.train.dtype,
        }
        return ckpt.save_checkpoint(
            ckpt_root,
            step,
            engine,
            optimizer,
            mesh,
            meta,
            is_main=runtime.is_main,
            keep=cfg.checkpoint.keep,
            tokenizer_files=loader.tokenizer_files,
        )

    flops_token = flops_per_token(cfg.model, cfg.data.seq_len)
    memory = PeakMemory(device)
    guard = StepGuard(device)
    bar = tqdm(
        total=total,
        initial=start_step,
        disable=not (progress and runtime.is_main),
        desc="pretrain",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    records: list[dict] = []
    run_start = window_start = time.perf_counter()
    window_steps, data_wait = 0, 0.0
    try:
        for step in range(start_step + 1, total + 1):
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
                logits = model(inputs, **loader.attention_inputs(inputs))
                targets = targets.to(device, non_blocking=True)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss.backward()
                loss_sum += loss.detach()
            engine.reduce_gradients()
            grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
            stop, nonfinite = guard.check(loss_sum, grad_norm)
            if nonfinite and not cfg.train.skip_nonfinite_steps:
                raise TrainingError(
                    f"non-finite loss or gradient norm at step {step}; the update was not "
                    f"applied and the last good checkpoint is {last_ckpt or 'none'}: lower "
                    "optim.lr, or set train.skip_nonfinite_steps: true to skip such steps"
                )
            if nonfinite:
                skipped += 1
                say(f"warning: step {step} skipped (non-finite loss or gradient norm)", bar)
            else:
                optimizer.step()
            engine.after_step()
            window_steps += 1
            bar.update(1)

            if step == start_step + 1 or step % cfg.train.log_every == 0 or step == total:
                loss_mean = loss_sum / len(micro_batches)
                if runtime.distributed:
                    dist.all_reduce(loss_mean)
                    loss_mean /= runtime.world_size
                synchronize(device)
                record = metrics_record(
                    step=step, loss=loss_mean.item(), lr=lr, grad_norm=grad_norm.item(),
                    tokens_per_step=loader.tokens_per_step,
                    window_s=time.perf_counter() - window_start, window_steps=window_steps,
                    world_size=runtime.world_size, flops_per_token=flops_token,
                    peak_flops=peak, peak_memory=memory.read(), data_wait_s=data_wait,
                    bytes_sent=engine.bytes_sent, skipped_steps=skipped,
                )  # fmt: skip
                records.append(record)
                if runtime.is_main:
                    metrics_file.write(record)
                    wandb.log(record, step=step)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", mfu=f"{record['mfu']:.1%}")
                    say(log_line(record), bar)
                window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0

            every = cfg.checkpoint.every
            due = (every and step % every == 0) or step == total or stop
            if due and cfg.checkpoint.enabled:
                saving = time.perf_counter()
                last_ckpt = save(step)
                window_start += time.perf_counter() - saving  # saves are not step time
                if runtime.is_main:
                    say(f"saved {last_ckpt} in {time.perf_counter() - saving:.1f}s", bar)
            if stop:
                saved = (
                    f"checkpoint saved in {last_ckpt}"
                    if cfg.checkpoint.enabled
                    else ("no checkpoint (checkpoint.enabled is false)")
                )
                raise Interrupted(
                    f"stopped by {guard.signal_name} at step {step}; {saved}: continue with "
                    f"--run-dir {run_dir} (--resume auto)"
                )
        summary = run_summary(
            records, time.perf_counter() - run_start, run_dir, cfg.train.dtype, runtime.world_size
        )
        if runtime.is_main:
            wandb.summary(summary)
            say(format_summary(summary), bar)
        return summary
    finally:
        guard.restore()
        bar.close()
        if runtime.is_main:
            metrics_file.close()
            wandb.finish()
