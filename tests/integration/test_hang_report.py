"""When a rank hangs or dies, one rank prints one report that names it: a world-size-4
torchrun job with a fault injected into rank 2 (not rank 0, which hosts the store when
there is no agent), and a slow rank named as the straggler."""

from __future__ import annotations

import json
from pathlib import Path

from faults import DIE, HANG, at_step, inject
from test_failures import pretrain_args, rank_stderr, torchrun

from yatrain.runtime.hang import describe, format_report
from yatrain.runtime.stragglers import STRAGGLER_LOGS

WORLD = 4
TIMEOUT = "--set=train.collective_timeout_s=3"
WORLD_4 = "--set=data.global_batch_size=8"  # 2 sequences per rank per step


def _run_faulty(data: Path, env: dict, tmp_path: Path, fault: str) -> tuple[Path, list[str], str]:
    """Rank 2 runs ``fault`` before step 3; returns the run dir, every rank's stderr and
    torchrun's own (which worker failed first, which it had to stop: shown on a failure)."""
    env = inject(env, tmp_path / "inject", at_step(rank=2, step=3, action=fault))
    run_dir = tmp_path / "run"
    args = pretrain_args(data, run_dir, "--steps", "50", TIMEOUT, WORLD_4)
    result = torchrun(args, env, tmp_path / "logs", nproc=WORLD)
    assert result.returncode != 0
    return run_dir, [rank_stderr(tmp_path / "logs", r) for r in range(WORLD)], result.stderr


def _one_report(run_dir: Path, errs: list[str]) -> list[str]:
    """The single hang report among all ranks' output (its lines), also in the run dir."""
    heads = [
        (r, line)
        for r, err in enumerate(errs)
        for line in err.splitlines()
        if line.startswith("yatrain: hang report")
    ]
    assert len(heads) == 1, "\n".join(e[-2000:] for e in errs)
    lines = (run_dir / "hang/attempt-1/report.txt").read_text().splitlines()
    assert lines[0] == heads[0][1]
    assert (run_dir / "hang/report.txt").read_text().splitlines() == lines  # the newest
    assert lines[-1].endswith(f"{run_dir}/hang/attempt-1/stack-rank*.txt")  # its own stacks
    return lines


def _one_error_line(err: str, rank: int, agent: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("yatrain: error")]
    seen = f"{err[-3000:]}\n--- torchrun's own output:\n{agent[-2000:]}"
    assert len(errors) == 1 and errors[0].startswith(f"yatrain: error (rank {rank})"), seen
    assert "Traceback" not in err, seen
    return errors[0]


def test_a_rank_hung_in_compute_is_named_behind(small_data, isolated_env, tmp_path):
    run_dir, errs, agent = _run_faulty(small_data, isolated_env, tmp_path, HANG)
    report = _one_report(run_dir, errs)
    assert report[0].endswith("rank 2 is behind"), report
    (culprit,) = [line for line in report if line.endswith("<- behind")]
    assert culprit.startswith("  rank 2: step 3, loading data (not in a collective)"), report
    assert any(line.startswith("  ranks 0-1, 3: step 3, waiting in an all-") for line in report)
    for rank in (0, 1, 3):
        assert "step 3 has made no progress" in _one_error_line(errs[rank], rank, agent)
    stack = (run_dir / "hang/attempt-1/stack-rank2.txt").read_text()
    assert "_next_batch" in stack and "sitecustomize" in stack  # where it hangs


def test_a_killed_rank_is_named_missing(small_data, isolated_env, tmp_path):
    run_dir, errs, agent = _run_faulty(small_data, isolated_env, tmp_path, DIE)
    report = _one_report(run_dir, errs)
    assert report[0].endswith("rank 2 sent nothing (dead, or cannot run Python)"), report
    assert not any(line.endswith("<- behind") for line in report), report
    for rank in (0, 1, 3):
        _one_error_line(errs[rank], rank, agent)
        assert (run_dir / f"hang/attempt-1/stack-rank{rank}.txt").stat().st_size > 0
    assert not (run_dir / "hang/attempt-1/stack-rank2.txt").exists()  # dead: none, not empty


SLOW_RANK = """
import os, time
if os.environ.get("RANK") == "{rank}":
    import yatrain.train.step as _step
    _real = _step.forward_backward

    def _slow(*args, **kwargs):
        time.sleep({seconds})  # busy, as a slower device or a throttled CPU would be
        return _real(*args, **kwargs)

    _step.forward_backward = _slow
"""


def test_a_slow_rank_is_named_the_straggler(small_data, isolated_env, tmp_path):
    env = inject(isolated_env, tmp_path / "inject", SLOW_RANK.format(rank=3, seconds=0.3))
    run_dir = tmp_path / "run"
    args = pretrain_args(small_data, run_dir, "--steps", "6", WORLD_4)
    result = torchrun(args, env, tmp_path / "logs", nproc=WORLD)
    assert result.returncode == 0, result.stderr[-3000:]
    err = rank_stderr(tmp_path / "logs", 0)
    notes = [line for line in err.splitlines() if line.startswith("straggler:")]
    assert len(notes) == 6 - STRAGGLER_LOGS + 1, err[-3000:]  # from the 3rd log in a row
    assert all(n.startswith("straggler: rank 3 is ") for n in notes), notes
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["slowest_rank"] == 3 for r in records)
    assert all(r["slowest_busy_s"] > r["median_busy_s"] + 0.2 for r in records)


def test_the_report_groups_ranks_and_names_the_culprits():
    def note(collectives, waiting_on=None, stage="model", phase="forward", unit=1):
        return {
            "doing": "step 7",
            "stage": stage,
            "phase": phase,
            "unit": unit,
            "micro_batch": 1,
            "collectives": collectives,
            "waiting_on": waiting_on,
        }

    waiting = note(40, "all-gather")
    notes = {r: waiting for r in range(8) if r not in (5, 6)} | {5: note(38, phase="backward")}
    text = format_report(notes, 8, Path("/runs/x"), by=0, why="step 7 made no progress for 9 s")
    lines = text.splitlines()
    assert lines[0].endswith(
        "): rank 5 is behind; rank 6 sent nothing (dead, or cannot run Python)"
    )
    assert lines[1] == f"  ranks 0-4, 7: {describe(waiting)}"
    assert (
        lines[2] == "  rank 5: step 7, computing (backward of unit 1, micro-batch 1; not in a "
        "collective), 38 collectives entered  <- behind"
    )
    assert "waiting in an all-gather (forward of unit 1, micro-batch 1)" in lines[1]
    same = format_report({0: waiting, 1: waiting}, 2, Path("/r"), by=1, why="x")
    assert same.splitlines()[0].endswith(
        "no rank is behind or missing (all wait in one collective)"
    )
