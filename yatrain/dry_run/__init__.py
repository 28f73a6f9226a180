"""``yatrain plan --dry-run``: one process as rank R of a fake world of N runs the real
engine and training loop on fake tensors, and holds the memory it tracked against the
planner's figure (``run``: the run; ``report``: its words and JSON)."""

from yatrain.dry_run.report import format_dry_run
from yatrain.dry_run.run import DryRun, dry_run

__all__ = ["DryRun", "dry_run", "format_dry_run"]
