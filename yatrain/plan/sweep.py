"""Measure throughput and memory across sequence lengths and checkpoint settings.

Each configuration is a short ``yatrain pretrain`` run in a fresh process (under torchrun when
asked), so an out-of-memory configuration is a row in the table, not the end of the sweep. Its
result is appended to ``results.jsonl`` as soon as it is known; a sweep restarted with the same
``--output`` skips configurations that already finished. Figures average the logged steps after
the warm-up; the planner's predicted peak is shown beside the measured one.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from yatrain.config import Recipe, load_recipe
from yatrain.errors import ConfigError
from yatrain.plan.memory import plan_for_layers, resolve_auto_checkpoint_layers

COLUMNS = [
    "name", "seq_len", "checkpoint", "activation_checkpoint_layers", "global_batch_size",
    "micro_batch_size", "status", "tokens_per_s_per_device", "tflops_per_device", "mfu",
    "step_time_s", "peak_memory_bytes", "predicted_peak_bytes", "measured_steps", "error",
]  # fmt: skip


@dataclass
class SweepConfig:
    """One run of the sweep: its name, its recipe overrides and what the planner expects."""

    name: str
    seq_len: int
    checkpoint: str  # as given: "0", "4", "auto"
    layers: int  # the number of checkpointed layers (auto resolved by the planner)
    global_batch_size: int
    micro_batch_size: int
    overrides: list[str]
    predicted_peak_bytes: int


def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what}: give a comma-separated list, e.g. 2048,4096")
    return items


def base_recipe(recipe_path: Path, overrides: list[str]) -> tuple[Recipe, int]:
    """The recipe the sweep starts from, and its own ``model.max_seq_len``. Its data.seq_len
    may exceed that context (it is replaced per configuration), so it is read with the
    context raised; everything else is validated as usual."""
    probe = load_recipe(recipe_path, [*overrides, "data.seq_len=1"])
    raised = f"model.max_seq_len={2**40}"  # any length passes; configs set their own
    return load_recipe(recipe_path, [*overrides, raised]), probe.model.max_seq_len


def _batch_for(seq: int, base_seq: int, gbs: int, micro: int, world: int, keep_seqs: bool):
    """(global batch, micro-batch) in sequences for ``seq``: same tokens per step as the recipe
    unless ``keep_seqs``; the micro-batch shrinks only when the batch no longer holds it."""
    if not keep_seqs:
        tokens = gbs * base_seq
        if tokens % seq:
            raise ConfigError(
                f"--seq-len {seq}: the recipe's {tokens} tokens per global batch are not a "
                "multiple of it; choose lengths that divide it or pass --keep-batch-sequences"
            )
        gbs = tokens // seq
    if gbs % world:
        raise ConfigError(
            f"--seq-len {seq}: {gbs} sequences per global batch do not split over {world} "
            "processes; choose other lengths or pass --keep-batch-sequences"
        )
    micro = min(micro, gbs // world)
    while gbs % (micro * world):
        micro -= 1
    return gbs, micro


def expand_configs(
    recipe_path: Path, overrides: list[str], seq_lens: list[int], checkpoints: list[str],
    steps: int, world: int, keep_seqs: bool,
) -> list[SweepConfig]:  # fmt: skip
    """Every (sequence length, checkpoint setting) pair, validated before anything runs."""
    base, max_seq_len = base_recipe(recipe_path, overrides)
    n_layers = base.model.n_layers
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    configs = []
    for seq in seq_lens:
        gbs, micro = _batch_for(
            seq, base.data.seq_len, base.data.global_batch_size, base.data.micro_batch_size,
            world, keep_seqs,
        )  # fmt: skip
        for setting in checkpoints:
            if setting != "auto" and not (setting.isdigit() and int(setting) <= n_layers):
                raise ConfigError(
                    f"--activation-checkpoint-layers: '{setting}' is not 'auto' or a layer "
                    f"count in 0..{n_layers}"
                )
            sets = [
                *overrides, f"data.seq_len={seq}", f"data.global_batch_size={gbs}",
                f"data.micro_batch_size={micro}",
                f"sharding.activation_checkpoint_layers={setting}", f"train.steps={steps}",
                "train.log_every=1", "checkpoint.dir=checkpoints",
                "checkpoint.enabled=false",
            ]  # fmt: skip
            if seq > max_seq_len:  # rotary positions: no learned table to outgrow
                sets.append(f"model.max_seq_len={seq}")
            recipe = load_recipe(recipe_path, sets)
            layers = (
                resolve_auto_checkpoint_layers(recipe, world, device)[0]
                if setting == "auto"
                else int(setting)
            )
            plan = plan_for_layers(recipe, world, layers)
            name = f"seq{seq}-ckpt{setting}"
            configs.append(
                SweepConfig(name, seq, setting, layers, gbs, micro, sets, plan.tensor_peak_bytes)
            )
    return configs


def config_command(recipe_path: Path, config: SweepConfig, run_dir: Path, nproc: int) -> list[str]:
    """The command line that runs one configuration."""
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(nproc), "-m", "yatrain"]
    else:
        launcher = [sys.executable, "-m", "yatrain"]
    sets = [f"--set={s}" for s in config.overrides]
    return [
        *launcher,
        "pretrain",
        str(recipe_path),
        *sets,
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]


def launch(command: list[str], log_path: Path) -> tuple[int, str]:
    """Run one configuration; its output goes to ``log_path``. Returns (exit code, stderr)."""
    with log_path.open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    return proc.returncode, log_path.read_text(errors="replace")


def classify_failure(code: int, output: str) -> tuple[str, str]:
    """("oom" | "failed", one line): an out-of-memory error, or the last line of output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    lowered = output.lower()
    if "outofmemoryerror" in lowered or "out of memory" in lowered:
        hits = [line for line in lines if "out of memory" in line.lower() or "OutOfMemory" in line]
        return "oom", hits[-1][:300]
    if code in (-9, 137):
        return "oom", "killed by SIGKILL (most likely the kernel's out-of-memory killer)"
    return "failed", (lines[-1] if lines else f"exit status {code}")[:300]


def summarize_metrics(metrics_path: Path, warmup: int) -> dict:
    """Means over the logged steps after ``warmup``, and the largest peak memory among them."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    steady = [r for r in records if r["step"] > warmup]
    if not steady:
        raise ConfigError(f"{metrics_path}: no logged step after the {warmup} warm-up steps")

    def mean(key: str) -> float:
        return sum(r[key] for r in steady) / len(steady)

    memory = [r["peak_memory_bytes"] for r in steady if r.get("peak_memory_bytes") is not None]
    return {
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "tflops_per_device": mean("tflops_per_device"),
        "mfu": mean("mfu"),
        "step_time_s": mean("step_time_s"),
        "peak_memory_bytes": max(memory) if memory else None,
        "measured_steps": len(steady),
    }


def run_config(
    recipe_path: Path, config: SweepConfig, out_dir: Path, nproc: int, warmup: int
) -> dict:
    """Run one configuration to completion and return its table row."""
    run_dir = out_dir / "configs" / config.name
    if run_dir.exists():  # an interrupted attempt: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    code, output = launch(
        config_command(recipe_path, config, run_dir, nproc), run_dir / "output.log"
    )
    row = {
        "name": config.name, "seq_len": config.seq_len, "checkpoint": config.checkpoint,
        "activation_checkpoint_layers": config.layers,
        "global_batch_size": config.global_batch_size, "micro_batch_size": config.micro_batch_size,
        "predicted_peak_bytes": config.predicted_peak_bytes, "run_dir": str(run_dir),
    }  # fmt: skip
    if code != 0:
        status, error = classify_failure(code, output)
        return {**row, "status": status, "error": error}
    return {
        **row,
        "status": "ok",
        "error": "",
        **summarize_metrics(run_dir / "metrics.jsonl", warmup),
    }


def load_done(out_dir: Path) -> dict[str, dict]:
    """Results recorded by earlier attempts of this sweep, by configuration name."""
    path = out_dir / "results.jsonl"
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            done[record["row"]["name"]] = record
    return done


def _measured(overrides: list[str]) -> list[str]:
    """The overrides that can change a measurement (logging settings cannot)."""
    return [item for item in overrides if not item.startswith("logging.")]


def run_sweep(
    recipe_path: Path, configs: list[SweepConfig], out_dir: Path, *, nproc: int, warmup: int,
    echo: Callable[[str], None] = print,
) -> list[dict]:  # fmt: skip
    """Run every configuration not finished before; returns the rows in sweep order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = load_done(out_dir)
    rows = []
    for index, config in enumerate(configs, 1):
        tag = f"[{index}/{len(configs)}] {config.name}"
        earlier = done.get(config.name)
        same = earlier and _measured(earlier["overrides"]) == _measured(config.overrides)
        if same and earlier["row"]["status"] != "failed":
            echo(f"{tag}: already {earlier['row']['status']} in {out_dir}, skipped")
            rows.append(earlier["row"])
            continue
        echo(f"{tag}: running ({config.layers} checkpointed layers)")
        row = run_config(recipe_path, config, out_dir, nproc, warmup)
        with (out_dir / "results.jsonl").open("a") as results:
            results.write(json.dumps({"overrides": config.overrides, "row": row}) + "\n")
        echo(f"{tag}: {describe(row)}")
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status'].upper()}: {row['error']}"
    return (
        f"{row['tokens_per_s_per_device']:,.0f} tok/s/device, MFU {row['mfu']:.1%}, "
        f"peak {_size(row['peak_memory_bytes'])} (planned {_size(row['predicted_peak_bytes'])})"
    )


def _size(n: float | None, unit: str | None = None) -> str:
    """Bytes in ``unit`` (a bare number), or with the unit that suits them (MiB below 1 GiB:
    tiny models on a CPU)."""
    if n is None:
        return "n/a"
    shown = unit or ("GiB" if n >= 2**30 else "MiB")
    text = f"{n / (2**30 if shown == 'GiB' else 2**20):.2f}"
    return text if unit else f"{text} {shown}"


def format_table(rows: list[dict]) -> str:
    """A plain-text table, one row per configuration."""
    sizes = [r.get(k) or 0 for r in rows for k in ("peak_memory_bytes", "predicted_peak_bytes")]
    unit = "GiB" if max(sizes, default=0) >= 2**30 else "MiB"
    head = ["config", "seq", "ckpt", "tok/s/dev", "TFLOP/s", "MFU", "step s", f"peak {unit}",
            f"plan {unit}", "status"]  # fmt: skip
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        body.append([
            r["name"], str(r["seq_len"]),
            f"{r['activation_checkpoint_layers']} ({r['checkpoint']})",
            f"{r['tokens_per_s_per_device']:,.0f}" if ok else "-",
            f"{r['tflops_per_device']:.3g}" if ok else "-",
            f"{r['mfu']:.1%}" if ok else "-",
            f"{r['step_time_s']:.3f}" if ok else "-",
            _size(r.get("peak_memory_bytes"), unit) if ok else "-",
            _size(r["predicted_peak_bytes"], unit),
            r["status"] if ok else r["status"].upper(),
        ])  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        " | ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *body]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_tables(rows: list[dict], out_dir: Path, meta: dict) -> tuple[Path, Path]:
    """``sweep.csv`` and ``sweep.json`` (the rows plus how the sweep was run)."""
    csv_path, json_path = out_dir / "sweep.csv", out_dir / "sweep.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return csv_path, json_path


def _panel(ax, kind: str, rows: list[dict], unit: str) -> None:
    """One plot against sequence length (log 2 axis), one colour per checkpoint setting."""
    from matplotlib.ticker import ScalarFormatter

    scale = 2**30 if unit == "GiB" else 2**20
    for i, setting in enumerate(dict.fromkeys(r["checkpoint"] for r in rows)):
        color, label = f"C{i}", f"checkpoint {setting}"
        mine = sorted((r for r in rows if r["checkpoint"] == setting), key=lambda r: r["seq_len"])
        ok = [r for r in mine if r["status"] == "ok"]
        oom = [r for r in mine if r["status"] == "oom"]
        if kind == "throughput":
            ax.plot([r["seq_len"] for r in ok], [r["tokens_per_s_per_device"] for r in ok],
                    "o-", color=color, label=label)  # fmt: skip
            continue
        seen = [r for r in ok if r.get("peak_memory_bytes") is not None]
        ax.plot([r["seq_len"] for r in seen], [r["peak_memory_bytes"] / scale for r in seen],
                "o-", color=color, label=f"{label}: measured")  # fmt: skip
        ax.plot([r["seq_len"] for r in mine], [r["predicted_peak_bytes"] / scale for r in mine],
                "--", color=color, alpha=0.7, label=f"{label}: planner")  # fmt: skip
        if oom:
            ax.plot([r["seq_len"] for r in oom], [r["predicted_peak_bytes"] / scale for r in oom],
                    "x", color="red", markersize=10, label=f"{label}: OOM")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["seq_len"] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens/s per device" if kind == "throughput" else f"peak memory ({unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def draw_plots(rows: list[dict], out_dir: Path, title: str, note: str = "") -> list[Path]:
    """``throughput.png`` and ``memory.png`` (measured solid, planner dashed, OOM as x), and
    both side by side in ``sweep.png``; ``note`` goes under the figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.get(k) or 0 for r in rows for k in ("peak_memory_bytes", "predicted_peak_bytes")]
    unit = "GiB" if max(sizes, default=0) >= 2**30 else "MiB"
    paths = []
    for name, kinds in (("throughput", ["throughput"]), ("memory", ["memory"]),
                        ("sweep", ["throughput", "memory"])):  # fmt: skip
        fig, axes = plt.subplots(1, len(kinds), figsize=(6.4 * len(kinds), 4.4), dpi=100)
        for ax, kind in zip(list(getattr(axes, "flat", [axes])), kinds, strict=True):
            _panel(ax, kind, rows, unit)
            ax.set_title(f"{title}: {kind}")
        if note:
            fig.text(0.01, 0.01, note, fontsize=7, alpha=0.8)
        fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def log_to_wandb(recipe_path: Path, overrides: list[str], out_dir: Path, rows, plots, meta):
    """The table and plots as one W&B run (mode from the recipe's logging.wandb.mode)."""
    from yatrain.train.wandb_logger import WandbLogger

    recipe, _ = base_recipe(recipe_path, overrides)
    logger = WandbLogger(recipe.logging.wandb, out_dir, meta, out_dir.name)
    if logger.run is None:
        return logger.mode
    import wandb

    table = wandb.Table(columns=COLUMNS, data=[[r.get(c) for c in COLUMNS] for r in rows])
    images = {f"sweep/{p.stem}": wandb.Image(str(p)) for p in plots}
    results = out_dir / "results.jsonl"  # its length only grows: a resumed sweep continues
    step = len(results.read_text().splitlines()) if results.exists() else 0  # its W&B run
    logger.log({"sweep/results": table, **images}, step=step)
    logger.finish()
    return logger.mode


def memory_note(nproc: int) -> str:
    """How to read measured against planned memory on this machine."""
    ranks = f", per rank of {nproc}" if nproc > 1 else ""
    if torch.cuda.is_available():
        return f"measured: CUDA max_memory_allocated{ranks}; planner: tensor peak, no allowance"
    return (
        f"measured: process high-water mark (VmHWM, interpreter and libraries included){ranks}; "
        "planner: tensors only"
    )


def sweep_dir_name(recipe_path: Path, stamp: str) -> Path:
    return Path("runs") / f"sweep-{recipe_path.stem}-{stamp}"
