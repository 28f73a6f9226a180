"""How long a save stops training, synchronous vs asynchronous (``checkpoint.async``).

One process, a one-rank gloo group (what ``checkpoint.async`` makes at world 1), the
recipe's model with the training loop's own step (``train_step``) on random tokens, and the
same save code the loop uses (``save_checkpoint``, ``AsyncSaver.save``). Each block: two
warm-up steps, ``--after`` steps with no save (the block's baseline), the save, ``--after``
steps again. Blocks of the two kinds alternate (which goes first flips every repeat):

- sync: the step blocks for all of ``save_checkpoint`` (write, checksums, manifest, rename);
- async: the step blocks while the state is copied to host memory; the write runs during
  the following steps, on the same cores (the block then waits for it, untimed, and reports
  how long it still had to go).

Every block ends with ``os.sync()`` (untimed), so the kernel's write-back of one block's
files does not slow the next. Reported: the blocking time of each kind, and the throughput
of the steps after the save over that of the block's steps before it, and the time the save
cost the run (blocked, plus how much longer the steps after it took); medians over
repeats. The first asynchronous save, which allocates the host buffers, runs before the
repeats and is reported on its own.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from bench.measure import load_average, median, spread, table
from yatrain.checkpoint.background_save import AsyncSaver
from yatrain.checkpoint.optimizer_state import ensure_state
from yatrain.checkpoint.store import dcp_mesh, save_checkpoint
from yatrain.recipe.config import Recipe
from yatrain.runtime.device import synchronize
from yatrain.runtime.process import init_runtime
from yatrain.train.build import build_model_and_engine
from yatrain.train.optim import build_optimizer
from yatrain.train.step import train_step

KINDS = ("sync", "async")


def _per_kind() -> dict[str, list[float]]:
    return {kind: [] for kind in KINDS}


@dataclasses.dataclass
class Trial:
    """One run of the model's training step and the saves between them."""

    cfg: Recipe
    root: Path
    sequences: int  # sequences per step (one micro-batch)
    blocked: dict[str, list[float]] = dataclasses.field(default_factory=lambda: _per_kind())
    before: dict[str, list[float]] = dataclasses.field(default_factory=lambda: _per_kind())
    after: dict[str, list[float]] = dataclasses.field(default_factory=lambda: _per_kind())
    async_tail: list[float] = dataclasses.field(default_factory=list)  # write left after steps
    step: int = 0
    first_async: float = float("nan")  # seconds blocked by the first async save

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.runtime = init_runtime(single_rank_group=True)
        self.device = self.runtime.device
        self.model, self.engine = build_model_and_engine(cfg, self.runtime, say=print)
        self.optimizer = build_optimizer(self.engine.param_groups(0.1), cfg.optim)
        ensure_state(self.optimizer)
        self.mesh = dcp_mesh(self.runtime)
        self.saver = AsyncSaver(self.device, self.mesh, self.runtime.timeout_s)
        self.meta = {"model": dataclasses.asdict(cfg.model)}
        self.generator = torch.Generator().manual_seed(0)

    def close(self) -> None:
        self.saver.close()
        self.runtime.shutdown()

    def train(self, steps: int) -> float:
        """Seconds for ``steps`` training steps (device synchronised at both ends)."""
        seq, vocab = self.cfg.data.seq_len, self.cfg.model.vocab_size
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = torch.randint(0, vocab, (self.sequences, seq + 1), generator=self.generator)
            batch = [(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device))]
            train_step(self.model, self.engine, self.optimizer, batch, grad_clip=1.0)
        synchronize(self.device)
        return time.perf_counter() - start

    def save(self, kind: str) -> float:
        """Seconds the step is blocked by a save of this kind."""
        self.step += 1
        synchronize(self.device)
        start = time.perf_counter()
        if kind == "sync":
            save_checkpoint(
                self.root,
                self.step,
                self.engine,
                self.optimizer,
                self.mesh,
                self.meta,
                is_main=True,
                keep=1,
            )
        elif kind == "async":
            self.saver.save(
                self.root, self.step, self.engine, self.optimizer, self.meta, is_main=True, keep=1
            )
        return time.perf_counter() - start

    def block(self, kind: str, after: int) -> None:
        """Steps, a save, steps: tokens/s before and after, and the seconds blocked."""
        tokens = after * self.sequences * self.cfg.data.seq_len
        self.train(2)
        self.before[kind].append(tokens / self.train(after))
        self.blocked[kind].append(self.save(kind))
        self.after[kind].append(tokens / self.train(after))
        start = time.perf_counter()
        self.saver.wait()
        if kind == "async":
            self.async_tail.append(time.perf_counter() - start)
        os.sync()


def measure(cfg: Recipe, root: Path, *, repeats: int, after: int, sequences: int) -> Trial:
    """The first asynchronous save, then alternating blocks of both kinds, ``repeats``
    times each."""
    trial = Trial(cfg, root, sequences)
    try:
        trial.train(2)
        trial.first_async = trial.save("async")
        trial.saver.wait()
        os.sync()
        for repeat in range(repeats):
            for kind in KINDS if repeat % 2 == 0 else KINDS[::-1]:
                trial.block(kind, after)
    finally:
        trial.close()
    return trial


def report(trial: Trial, after: int) -> None:
    ratios = {
        kind: [a / b for a, b in zip(trial.after[kind], trial.before[kind], strict=True)]
        for kind in KINDS
    }
    tokens = after * trial.sequences * trial.cfg.data.seq_len
    lost = {  # blocked, plus how much longer the steps after the save took than those before
        kind: [
            s + tokens / a - tokens / b
            for s, a, b in zip(
                trial.blocked[kind], trial.after[kind], trial.before[kind], strict=True
            )
        ]
        for kind in KINDS
    }
    rows = [
        [
            kind,
            f"{median(trial.blocked[kind]):.3f} ({spread(trial.blocked[kind])})",
            f"{median(trial.before[kind]):,.1f}",
            f"{median(trial.after[kind]):,.1f}",
            f"{median(ratios[kind]):.3f} ({spread(ratios[kind])})",
            f"{median(lost[kind]):.2f} ({spread(lost[kind])})",
        ]
        for kind in KINDS
    ]
    sync, background = median(trial.blocked["sync"]), median(trial.blocked["async"])
    print(
        f"\nsave stall: {trial.sequences} x {trial.cfg.data.seq_len} tokens per step, "
        f"{after} steps before and after each save, medians of "
        f"{len(trial.blocked['sync'])} repeats, load {load_average()}"
    )
    headers = [
        "save",
        "step blocked, s (range)",
        f"tokens/s, {after} steps before",
        f"tokens/s, {after} steps after",
        "after / before (range)",
        "time lost, s (range)",
    ]
    print(table(headers, rows))
    print(
        f"async blocks {background / sync:.3f}x as long as sync; the first async save "
        f"(allocating the host buffers) blocked {trial.first_async:.3f} s; the background "
        f"write still ran {median(trial.async_tail):.2f} s after the {after} steps (median)"
    )
