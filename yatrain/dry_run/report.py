"""A dry run in words: the tracked peak beside the plan (in total and by category), whether
it fits, the collectives."""

from __future__ import annotations

from yatrain.common import GIB
from yatrain.dry_run.run import DryRun


def format_dry_run(run: DryRun) -> str:
    """The report ``yatrain plan --dry-run`` prints (every number measured or planned)."""
    plan = run.plan
    diff = run.tracked_peak_bytes - run.planned_peak_bytes
    share = diff / run.planned_peak_bytes if run.planned_peak_bytes else 0.0
    limit = plan.gpu_memory_bytes
    fits = "no limit given" if run.fits is None else ("fits" if run.fits else "does NOT fit")
    lines = [
        f"{run.recipe}: dry run as rank {run.rank} of {run.world_size} (fake process group, "
        f"fake tensors), {run.steps} steps in {run.seconds:.1f}s, first "
        f"{plan.activation_checkpoint_layers} of {plan.n_layers} layers checkpointed",
        f"measured with the engine's CUDA path, layers eager (no compilation), attention "
        f"kernel {run.attention}",
        f"tensor peak of step {run.steps}:",
        f"  {'tracked (live tensors)':28}{run.tracked_peak_bytes / GIB:10.3f} GiB",
        f"  {f'planned (at {plan.peak_moment})':28}{run.planned_peak_bytes / GIB:10.3f} GiB",
        f"  {'difference':28}{diff / GIB:+10.3f} GiB ({share:+.2%}, {diff:+,} bytes)",
        f"  {'runtime allowance':28}{run.allowance / GIB:10.3f} GiB",
        *category_lines(run),
    ]
    if limit is not None:
        total = (run.tracked_peak_bytes + run.allowance) / GIB
        lines.append(f"tracked + allowance {total:.3f} GiB of {limit / GIB:.2f} GiB: {fits}")
    lines.append("the engine's collectives in one step (this rank):")
    for kind, numbers in run.collectives.items():
        lines.append(
            f"  {kind.replace('_', '-'):15} {numbers['count']:6d} x, "
            f"{numbers['bytes'] / GIB:10.4f} GiB sent"
        )
    return "\n".join(lines)


def category_lines(run: DryRun) -> list[str]:
    """The peak category by category (``dry_run.categories``), tracked beside planned: where
    a difference in the total comes from, and whether both peaks are at the same moment."""
    tracked_at, planned_at = run.tracked.moment, run.plan.peak_moment
    lines = [f"by category: tracked peak at {tracked_at}, planned at {planned_at}"]
    if tracked_at.split(",")[0] != planned_at:
        lines.append("  (not the same moment: categories differ by what each moment holds)")
    lines.append(f"  {'(GiB)':28}{'tracked':>12}{'planned':>11}{'difference':>12}")
    for name, numbers in run.categories().items():
        tracked, planned, diff = (
            numbers["tracked_bytes"],
            numbers["planned_bytes"],
            numbers["difference_bytes"],
        )
        share = f"{diff / planned:+8.2%}" if planned else ("      --" if diff else f"{0:+8.2%}")
        lines.append(
            f"  {name:28}{tracked / GIB:12.4f}{planned / GIB:11.4f}{diff / GIB:+12.4f} {share}"
        )
    return lines
