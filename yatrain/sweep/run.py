"""Running a sweep: each configuration a short ``yatrain pretrain`` in a fresh process.

A fresh process per configuration (under torchrun when asked) makes an out-of-memory
configuration a row in the table, not the end of the sweep. Each result is appended to
``results.jsonl`` as soon as it is known; a sweep restarted with the same output directory
skips configurations that already finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from yatrain.common import dumps_json
from yatrain.errors import ConfigError, Interrupted
from yatrain.files import RecordFile, cut_torn_tail, make_directory, no_follow, touch
from yatrain.output.record import (
    largest_peak_memory,
    largest_tensor_peak,
    read_metrics,
    steady_means,
)
from yatrain.runtime.launcher_link import tie_to_this_process
from yatrain.sweep.configs import SweepConfig
from yatrain.sweep.report import describe
from yatrain.train.rundir import LOCK_FILE

RESULTS = "results.jsonl"
SWEEP_MARK = ".yatrain-sweep"  # a directory a sweep made: only its files are replaced
MEASURED = ("tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_s")


def config_command(
    recipe_path: Path, config: SweepConfig, run_dir: Path, nproc: int, warmup: int = 2
) -> list[str]:
    """The command line that runs one configuration. On CPU its live tensors are counted
    during a warm-up step (``--tensor-peak-step``: that step runs slower, and its figures
    are left out), the second one at the earliest: the first creates the AdamW state."""
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(nproc), "-m", "yatrain"]
    else:
        launcher = [sys.executable, "-m", "yatrain"]
    sets = [f"--set={s}" for s in config.overrides]
    watched = max(2, warmup)
    return [
        *launcher,
        "pretrain",
        str(recipe_path),
        *sets,
        "--run-dir",
        str(run_dir),
        f"--tensor-peak-step={watched}",
        "--no-progress",
    ]


def launch(command: list[str], log_path: Path) -> tuple[int, str]:
    """Run one configuration; its output goes to ``log_path``. Returns (exit code, output).

    The configuration lives no longer than the sweep: it dies with it (SIGKILL included),
    and a SIGTERM or Ctrl-C to the sweep is passed on as SIGTERM (it saves and stops, as a
    launcher's rank does), then the sweep stops too (``Interrupted``)."""
    with open(log_path, "w", opener=no_follow) as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            preexec_fn=tie_to_this_process(),  # noqa: PLW1509 -- only os and prctl run there
        )
        with _passing_stops_to(proc) as stop:
            code = proc.wait()
    if stop.signal_name is not None:
        raise Interrupted(
            f"sweep stopped by {stop.signal_name} during {log_path.parent.name}: rerun the "
            f"same command (--output {log_path.parent.parent.parent}) to go on; finished "
            "configurations are kept"
        )
    return code, log_path.read_text(errors="replace")


class _Stop:
    """The first SIGTERM or SIGINT to the sweep, passed on to its configuration."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.signal_name = proc, None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self.proc.kill()  # a second Ctrl-C: now, without its checkpoint
            raise KeyboardInterrupt
        self.signal_name = self.signal_name or signal.Signals(signum).name
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)


@contextlib.contextmanager
def _passing_stops_to(proc: subprocess.Popen) -> Iterator[_Stop]:
    stop, previous = _Stop(proc), {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):  # not the main thread: no handler to install
            previous[sig] = signal.signal(sig, stop)
    try:
        yield stop
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    records = read_metrics(metrics_path)
    steady = [r for r in records if r.step > warmup]
    if not steady:
        raise ConfigError(f"{metrics_path}: no logged step after the {warmup} warm-up steps")
    return {
        **steady_means(steady, MEASURED),
        "peak_memory_bytes": largest_peak_memory(steady),
        "peak_tensor_bytes": largest_tensor_peak(records),  # a warm-up step on CPU
        "measured_steps": len(steady),
    }


def run_config(
    recipe_path: Path, config: SweepConfig, out_dir: Path, nproc: int, warmup: int
) -> dict:
    """Run one configuration to completion and return its table row."""
    run_dir = out_dir / "configs" / config.name
    if (run_dir / LOCK_FILE).is_file():  # an interrupted attempt: start it again from scratch
        shutil.rmtree(run_dir)
    elif run_dir.exists():
        raise ConfigError(
            f"{run_dir} is not a run this sweep started (no {LOCK_FILE}): move it away, or "
            "pass another --output"
        )
    run_dir.mkdir(parents=True)
    touch(run_dir / LOCK_FILE)  # a run directory (pretrain refuses other non-empty ones)
    code, output = launch(
        config_command(recipe_path, config, run_dir, nproc, warmup), run_dir / "output.log"
    )
    row = {
        "name": config.name,
        "seq_len": config.seq_len,
        "context_parallel": config.context_parallel,
        "checkpoint": config.checkpoint,
        "activation_checkpoint_layers": config.layers,
        "global_batch_size": config.global_batch_size,
        "micro_batch_size": config.micro_batch_size,
        "predicted_peak_bytes": config.predicted_peak_bytes,
        "run_dir": str(run_dir),
    }
    if code != 0:
        status, error = classify_failure(code, output)
        return {**row, "status": status, "error": error}
    return {
        **row,
        "status": "ok",
        "error": "",
        **summarize_metrics(run_dir / "metrics.jsonl", warmup),
    }


def claim_output(out_dir: Path) -> None:
    """Make ``out_dir`` this sweep's, refusing a directory that holds anything else: a
    sweep replaces only files it wrote (its mark, or an earlier sweep's ``results.jsonl``)."""
    ours = (out_dir / SWEEP_MARK).is_file() or (out_dir / RESULTS).is_file()
    if out_dir.is_dir() and not ours and any(out_dir.iterdir()):
        raise ConfigError(
            f"--output {out_dir} is not empty and is not a yatrain sweep directory (no "
            f"{SWEEP_MARK}): pass a new or empty directory"
        )
    make_directory(out_dir, "--output")
    touch(out_dir / SWEEP_MARK)


def load_done(out_dir: Path) -> dict[str, dict]:
    """Results recorded by earlier attempts of this sweep, by configuration name (a line a
    killed sweep left half-written is cut)."""
    path = out_dir / RESULTS
    cut_torn_tail(path)
    if not path.exists():
        return {}
    done = {}
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            done[record["row"]["name"]] = record
        except (ValueError, TypeError, KeyError, RecursionError):
            raise ConfigError(
                f"{path} line {number} is not a sweep result: remove that line, or pass "
                "another --output"
            ) from None
    return done


def _measured(overrides: list[str]) -> list[str]:
    """The overrides that can change a measurement (logging settings cannot)."""
    return [item for item in overrides if not item.startswith("logging.")]


def run_configs(
    recipe_path: Path,
    configs: list[SweepConfig],
    out_dir: Path,
    *,
    nproc: int,
    warmup: int,
    echo: Callable[[str], None] = print,
) -> list[dict]:
    """Run every configuration not finished before; returns the rows in sweep order."""
    claim_output(out_dir)
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
        results = RecordFile(out_dir / RESULTS)
        try:
            results.append(dumps_json({"overrides": config.overrides, "row": row}))
        finally:
            results.close()
        echo(f"{tag}: {describe(row)}")
        rows.append(row)
    return rows
