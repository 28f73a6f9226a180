"""A run in words: the console line of a logged step and the end-of-run summary."""

from __future__ import annotations

from yatrain.common import format_bytes
from yatrain.output.record import MetricsRecord, largest_peak_memory, steady_means


def log_line(r: MetricsRecord) -> str:
    return (
        f"step {r.step:>6} | loss {known(r.loss, '.4f')}{val_text(r)} | lr {r.lr:.2e} | "
        f"gnorm {known(r.grad_norm, '.3f')} | "
        f"{r.step_time_s:.3f}s/step | {r.tokens_per_s_per_device:,.0f} tok/s/dev | "
        f"{r.tflops_per_device:.2f} TFLOP/s | MFU {r.mfu:.1%} | "
        f"mem {format_bytes(r.peak_memory_bytes, 'GiB')}{comm_text(r)}{breakdown_text(r)}"
    )


def known(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``n/a`` where it is unknown (a dry run's fake tensors)."""
    return "n/a" if value is None else format(value, spec)


# The step-time parts of a record (train.timing), with their short names on the console.
BREAKDOWN = {
    "compute_s": "compute",
    "comm_exposed_s": "comm",
    "data_wait_s": "data",
    "optimizer_s": "optim",
    "unattributed_s": "other",
}


def breakdown_text(r: MetricsRecord) -> str:
    """`` | compute 71% comm 18% data 1% optim 8% other 2%``, then the seconds spent
    saving and evaluating in the window (outside the step time) when there were any."""
    if r.compute_s is None:
        return ""
    shares = ((name, getattr(r, key) / r.step_time_s) for key, name in BREAKDOWN.items())
    parts = " ".join(f"{name} {share:.0%}" for name, share in shares)
    beside = [f"{what} {s:.2f}s" for what, s in (("ckpt", r.checkpoint_s), ("eval", r.eval_s)) if s]
    return f" | {parts}" + (f" (+ {', '.join(beside)})" if beside else "")


def comm_text(r: MetricsRecord) -> str:
    """Under hybrid sharding, what this rank has sent within its group and across groups."""
    if not r.comm_bytes_sent_cross:
        return ""
    intra, cross = r.comm_bytes_sent_intra, r.comm_bytes_sent_cross
    return f" | sent {format_bytes(intra)} in group, {format_bytes(cross)} across"


def val_text(r: MetricsRecord) -> str:
    """`` | val 3.2104 ppl 24.8 (web 3.1002, code 3.4020)`` at evaluation steps, else ''."""
    if r.val_loss is None:
        return ""
    ppl = f"{r.val_ppl:.1f}" if r.val_ppl is not None else "inf"
    sources = ", ".join(f"{name} {loss:.4f}" for name, loss in r.val_sources.items())
    return f" | val {r.val_loss:.4f} ppl {ppl}" + (f" ({sources})" if sources else "")


def val_summary(records: list[MetricsRecord]) -> dict:
    """The last evaluation's figures for the run summary (nothing when none ran)."""
    evaluated = [r for r in records if r.val_loss is not None]
    if not evaluated:
        return {}
    last = evaluated[-1]
    sources = {f"final_val_loss/{name}": loss for name, loss in last.val_sources.items()}
    return {
        "final_val_loss": last.val_loss,
        "final_val_ppl": last.val_ppl,
        "val_step": last.step,
        **sources,
    }


SUMMARY_MEANS = ("step_time_s", "tokens_per_s_per_device", "mfu", "data_wait_frac")


def run_summary(
    records: list[MetricsRecord], wall_s: float, run_dir, dtype: str, world_size: int
) -> dict:
    """Averages over the logged windows, leaving out step 1 (start-up) when there are others."""
    if not records:
        return {"run_dir": str(run_dir), "steps": 0}
    steady = [r for r in records if r.step > 1] or records
    first, last = records[0], records[-1]
    return {
        "run_dir": str(run_dir),
        "steps": last.step,
        "world_size": world_size,
        "first_loss": first.loss,
        "final_loss": last.loss,
        **val_summary(records),
        "tokens_seen": last.tokens_seen,
        "wall_time_s": wall_s,
        **steady_means(steady, SUMMARY_MEANS),
        "peak_memory_bytes": largest_peak_memory(records),
        "skipped_steps": last.skipped_steps,
        "dtype": dtype,
    }


def format_summary(summary: dict) -> str:
    """A two-column text table for the end of a run."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{k.ljust(width)} | {v}" for k, v in rows), rule])
