"""The training loop: ``pretrain`` = set up the run, then step it to the end.

Read top to bottom: ``pretrain`` joins the process group and builds the run
(``setup.setup``: data, model, engine, optimizer, resume point, loggers); ``train`` runs the
steps, each ``step`` being learning rate, data, ``train_step``, then evaluation, logging
and checkpointing when their components say they are due; a watchdog ends a step stuck in a
collective, and a lost peer or an exhausted allocator ends the run in one line
(``failures.explain``). Checkpoints capture everything the
next step depends on (weights, AdamW state, the global data position; no random state is
drawn during training), so a resumed run continues bit for bit at the same world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from yatrain.errors import Interrupted, TrainingError, YatrainError
from yatrain.recipe.config import Recipe
from yatrain.runtime.determinism import set_deterministic
from yatrain.runtime.failures import explain, lost_peer
from yatrain.runtime.process import init_runtime
from yatrain.train.evaluate import Evaluation
from yatrain.train.guard import ANOTHER_RANK, StepGuard
from yatrain.train.optim import set_lr
from yatrain.train.run import Run
from yatrain.train.schedule import lr_at
from yatrain.train.setup import Checks, setup
from yatrain.train.step import StepOutcome, train_step

BACKSTOP_S = 60.0  # the process group's timeout, after the watchdog's (watchdog.py)


def pretrain(
    recipe: Recipe,
    *,
    recipe_name: str = "run",
    run_dir: Path | None = None,
    steps: int | None = None,
    resume: str = "auto",
    progress: bool = True,
    checks: Checks = Checks(),
) -> dict:
    """Train as one process or one torchrun rank; returns the run summary. ``checks``:
    the fit check and checksum verification (both on), the step whose live tensors are
    counted on CPU (none)."""
    if steps is not None:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=steps))
    set_deterministic(recipe.train.deterministic)  # before CUDA starts (cuBLAS reads it then)
    runtime = init_runtime(
        recipe.train.collective_timeout_s + BACKSTOP_S,
        single_rank_group=recipe.sharding.force_process_group or recipe.checkpoint.background,
    )
    run = None
    try:
        run = setup(
            recipe,
            runtime,
            recipe_name=recipe_name,
            run_dir=run_dir,
            resume=resume,
            progress=progress,
            checks=checks,
        )
        return train(run)
    except (RuntimeError, dist.DistError) as error:  # the machine failed, not the input
        where = f"at step {run.step_number}" if run is not None else "while starting"
        report = _report_lost_peer(run, error, where)
        if (explained := explain(error, where, report)) is None:
            raise
        raise explained from None
    finally:
        if run is not None:
            run.close()
        runtime.shutdown()


def _report_lost_peer(run: Run | None, error: BaseException, where: str) -> Path | None:
    """A lost peer: stop watching (this rank is not stuck) and take part in the hang report,
    which names the rank that is gone; returns where the report is written."""
    reporter = run.watchdog.reporter if run is not None else None
    if reporter is None or not lost_peer(error):
        return None
    if run.watchdog.stopping.is_set():  # the watchdog is ending this rank: one line only
        run.watchdog.wait_for_exit()
    run.watchdog.stand_down()
    run.watchdog.stacks.dump()
    # torchrun stops the other ranks with SIGTERM once one has died: not during the report
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        reporter.report(f"lost contact with a peer {where}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return reporter.report_path  # this attempt's own report (hang/attempt-N/)


def train(run: Run) -> dict:
    """Step the run from where it starts to ``train.steps``; returns the run summary."""
    total = run.recipe.train.steps
    if run.start_step >= total:
        run.loggers.say(f"nothing to do: the run is already at step {run.start_step} of {total}")
        return {"run_dir": str(run.run_dir), "steps": run.start_step}
    guard = StepGuard(run.runtime.device, announces=run.runtime.is_main)
    run.loggers.start_progress(total, run.start_step)
    run.meter.start(first_step=run.start_step + 1)
    evaluated, failing = False, False
    try:
        for step_number in range(run.start_step + 1, total + 1):
            run.step_number = guard.step_number = step_number
            run.watchdog.phase(f"step {step_number}")
            first_step = step_number == run.start_step + 1
            guard.run_dir_deleted_here = run.lock is not None and run.lock.deleted()
            with run.profiler.step(step_number), warming_up(run, first_step):
                outcome, lr = step(run, step_number, guard)
            if first_step and run.compiler is not None:
                run.loggers.say(run.compiler.describe())
            evaluating = run.evaluator.due(step_number, outcome.stop)
            saving = run.checkpointer.due(step_number, outcome.stop)
            if evaluating or saving or run.meter.due(step_number):
                settle(run, guard)  # the host reads device values here, the guard's first
            evaluation = None
            if evaluating:
                run.watchdog.phase(f"the evaluation after step {step_number}")
                with warming_up(run, not evaluated):
                    evaluation = evaluate(run)
                evaluated = True
            if run.meter.due(step_number) or evaluation is not None:
                log(run, step_number, outcome, lr, evaluation)
            if saving:
                run.watchdog.phase(f"the checkpoint save after step {step_number}")
                with guard.during_save(step_number):
                    save(run, step_number, final=outcome.stop or step_number == total)
                if not outcome.stop and step_number < total and guard.stop_after_save():
                    run.checkpointer.wait()  # a background save: whole before the run stops
                    raise _stopped(run, guard, step_number)
            elif (written := run.checkpointer.written()) is not None:
                run.loggers.say(f"saved {written} (written in the background)")
            if outcome.stop:
                raise _stopped(run, guard, step_number)
        run.watchdog.phase(None)
        summary = run.meter.summary(run.run_dir)
        if run.compiler is not None:
            summary |= run.compiler.summary()
        run.loggers.summary(summary)
        return summary
    except BaseException:
        failing = True
        raise
    finally:
        run.profiler.close()
        guard.restore(failing)


def step(run: Run, step_number: int, guard: StepGuard) -> tuple[StepOutcome, float]:
    """One optimizer step: learning rate, this rank's batches, ``train_step`` (a non-finite
    step is skipped on the device; ``settle`` applies the policy where the host reads).
    Returns the outcome and the LR used."""
    optim = run.recipe.optim
    lr = lr_at(step_number, optim, run.recipe.train.steps)
    set_lr(run.optimizer, lr)
    with run.meter.waiting_for_data():
        micro_batches = run.loader.next_batch()
    with run.meter.watching_tensors(step_number):
        outcome = train_step(
            run.model,
            run.engine,
            run.optimizer,
            micro_batches,
            grad_clip=optim.grad_clip,
            guard=guard,
            clock=run.meter.clock,
            context=run.context,
        )
    if guard.run_dir_deleted:  # saving would make a directory no run owns: stop unsaved
        raise TrainingError(
            f"the run directory {run.run_dir} was deleted (or moved) during the run, before "
            f"step {step_number}; nothing more is written there: start again with a new --run-dir"
        )
    if run.compiler is not None:  # compile time is reported once, not as step time
        run.meter.exclude(run.compiler.take_seconds(), "compile")
    run.meter.step_done()
    run.loggers.step_done()
    return outcome, lr


def settle(run: Run, guard: StepGuard) -> None:
    """Where the host reads device values (a log, an evaluation, a save; collective), what
    the guard recorded on the device since the last read, first: an update that made
    weights non-finite stops the run (nothing of it may be saved); steps skipped for a
    non-finite loss or gradient norm stop it too, or with ``train.skip_nonfinite_steps``
    are counted and said."""
    found = guard.settle()
    if found.bad_weights_step is not None:  # applied: no skipping it, nothing of it saved
        raise TrainingError(
            f"the update at step {found.bad_weights_step} made weights non-finite (its loss "
            "and gradient norm were finite); an applied update cannot be undone without a copy "
            f"of the state, so the run stops without saving it; the last good checkpoint is "
            f"{_last_good(run)}: lower optim.lr"
        )
    if not found.skipped:
        return
    if not run.recipe.train.skip_nonfinite_steps:
        raise TrainingError(
            f"non-finite loss or gradient norm at step {found.first_skipped}; the update was "
            f"not applied and the last good checkpoint is {_last_good(run)}: lower optim.lr, "
            "or set train.skip_nonfinite_steps: true to skip such steps"
        )
    run.skipped_steps += found.skipped
    if found.skipped == 1:
        what = f"step {found.first_skipped} skipped"
    else:
        what = f"{found.skipped} steps skipped from step {found.first_skipped} on"
    run.loggers.say(f"warning: {what} (non-finite loss or gradient norm)")


@contextlib.contextmanager
def warming_up(run: Run, warm_up: bool) -> Iterator[None]:
    """With train.compile: graphs compiled inside (the first step's, the first evaluation's)
    are expected; any later one is a recompile (``CompileWatch``)."""
    if run.compiler is None or not warm_up:
        yield
        return
    with run.compiler.warming_up():
        yield


def evaluate(run: Run) -> Evaluation:
    """The held-out loss after this step (collective); its time is left out of the
    step-time window."""
    evaluation = run.evaluator.evaluate(run.model)
    run.meter.exclude(evaluation.seconds, "eval")
    if run.compiler is not None:
        run.compiler.take_seconds()  # inside the evaluation's time, excluded already
    return evaluation


def log(
    run: Run, step_number: int, outcome: StepOutcome, lr: float, evaluation: Evaluation | None
) -> None:
    """Close the metrics window at this step (collective), log its record (with the
    evaluation's figures at an evaluation step), open the next."""
    val = evaluation.record_fields() if evaluation is not None else None
    kv = run.context.bytes_sent if run.context is not None else 0  # within a shard group
    sent = (run.engine.bytes_sent_intra + kv, run.engine.bytes_sent_cross)
    record = run.meter.record(
        step_number, outcome.loss, outcome.grad_norm, lr, sent, run.skipped_steps, val
    )
    run.loggers.log(record)
    if run.meter.straggler_note is not None:
        run.loggers.say(run.meter.straggler_note)
    run.meter.open_window()  # logging is not step time


def save(run: Run, step_number: int, final: bool) -> None:
    """A checkpoint after this step; the time it blocks the run is left out of the step-time
    window. With ``checkpoint.async`` that is waiting for the previous save and copying the
    state to host memory, unless this is the run's last save (``final``): that one is also
    written before the run goes on to exit."""
    start = time.perf_counter()
    previous = run.checkpointer.writing
    path = run.checkpointer.save(step_number, run.skipped_steps, wait=final)
    seconds = time.perf_counter() - start
    run.meter.exclude(seconds, "checkpoint")
    if previous is not None:  # waited for at the start of this save
        run.loggers.say(
            f"saved {run.checkpointer.root / f'step-{previous}'} (written in the background)"
        )
    if path is None:
        run.loggers.say(
            f"saving step-{step_number} in the background (the run waited {seconds:.2f}s)"
        )
    else:
        run.loggers.say(f"saved {path} in {seconds:.1f}s")


def _last_good(run: Run) -> str:
    """The newest complete checkpoint, once a background save of an earlier, good step has
    finished (collective: called where every rank stops)."""
    with contextlib.suppress(YatrainError):  # failed: the save before it is the last good one
        run.checkpointer.wait()
    return str(run.checkpointer.last or "none")


def _stopped(run: Run, guard: StepGuard, step_number: int) -> Interrupted:
    saved = (
        f"checkpoint saved in {run.checkpointer.last}"
        if run.recipe.checkpoint.enabled
        else "no checkpoint (checkpoint.enabled is false)"
    )
    return Interrupted(
        f"stopped by {guard.signal_name} at step {step_number}; {saved}: continue with "
        f"--run-dir {run.run_dir} (--resume auto)",
        by_another=guard.signal_name == ANOTHER_RANK,
    )
