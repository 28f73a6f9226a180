"""Turn a logging window's measurements into the metrics record, log line and summary."""

from __future__ import annotations

import sys

from tqdm import tqdm


def metrics_record(
    *, step, loss, lr, grad_norm, tokens_per_step, window_s, window_steps, world_size,
    flops_per_token, peak_flops, peak_memory, data_wait_s, bytes_sent, skipped_steps,
) -> dict:  # fmt: skip
    tokens_per_s = window_steps * tokens_per_step / window_s
    per_device = tokens_per_s / world_size
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_seen": step * tokens_per_step,
        "step_time_s": window_s / window_steps,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "tflops_per_device": per_device * flops_per_token / 1e12,
        "mfu": per_device * flops_per_token / peak_flops,
        "peak_memory_bytes": peak_memory,
        "data_wait_frac": data_wait_s / window_s,
        "comm_bytes_sent": bytes_sent,
        "skipped_steps": skipped_steps,
    }


def log_line(r: dict) -> str:
    mem = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}GiB"
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
        f"gnorm {r['grad_norm']:.3f} | {r['step_time_s']:.3f}s/step | "
        f"{r['tokens_per_s_per_device']:,.0f} tok/s/dev | {r['tflops_per_device']:.2f} TFLOP/s | "
        f"MFU {r['mfu']:.1%} | mem {mem}"
    )


def run_summary(records: list[dict], wall_s: float, run_dir, dtype: str, world_size: int) -> dict:
    """Averages over the logged windows, leaving out step 1 (start-up) when there are others."""
    if not records:
        return {"run_dir": str(run_dir), "steps": 0}
    steady = [r for r in records if r["step"] > 1] or records
    mem = [r["peak_memory_bytes"] for r in records if r["peak_memory_bytes"] is not None]

    def mean(key: str) -> float:
        return sum(r[key] for r in steady) / len(steady)

    return {
        "run_dir": str(run_dir),
        "steps": records[-1]["step"],
        "world_size": world_size,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_seen": records[-1]["tokens_seen"],
        "wall_time_s": wall_s,
        "step_time_s": mean("step_time_s"),
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "mfu": mean("mfu"),
        "data_wait_frac": mean("data_wait_frac"),
        "peak_memory_bytes": max(mem) if mem else None,
        "skipped_steps": records[-1]["skipped_steps"],
        "dtype": dtype,
    }


def format_summary(summary: dict) -> str:
    """A two-column text table for the end of a run."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{k.ljust(width)} | {v}" for k, v in rows), rule])


def say(message: str, bar: tqdm | None = None) -> None:
    if bar is not None and not bar.disable:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)
