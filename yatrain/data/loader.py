"""Deterministic batches, defined on the global batch so that resuming is layout-independent.

The token stream is cut into windows of ``seq_len + 1`` tokens; window ``j`` starts at token
``j * seq_len``, so consecutive windows share one boundary token and no token is a target
twice. Each epoch is a seeded permutation of all windows (``data/order.py``: evaluated per
index, never materialised), consumed ``global_batch_size`` at a time (the remainder is
dropped for that epoch). Global step ``k`` is therefore one fixed,
ordered list of windows; ranks take contiguous slices of it and cut their slice into
micro-batches. Changing the world size or micro-batch size changes who computes what, never
which sequences make up step ``k`` -- so a run can resume on a different cluster shape.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from yatrain.data.batch import MicroBatch
from yatrain.data.documents import document_layout
from yatrain.data.order import FEISTEL, LEGACY, ORDERS, WindowOrder
from yatrain.data.shards import TokenShards
from yatrain.errors import DataError


def check_batching(
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
) -> None:
    """The batch shape and rank are usable (one line naming the key otherwise)."""
    for name, value in [
        ("data.seq_len", seq_len),
        ("data.global_batch_size", global_batch_size),
        ("data.micro_batch_size", micro_batch_size),
        ("world size", world_size),
    ]:
        if value < 1:
            raise DataError(f"{name} must be a positive integer, got {value}")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}")
    if seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed}")
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise DataError(
            f"data.global_batch_size {global_batch_size} is not a multiple of "
            f"data.micro_batch_size x world size = {micro_batch_size} x {world_size}: "
            "change one of them"
        )


class BatchLoader:
    """What the training loop uses of a loader: one step's micro-batches at a time, the
    position as state, and the document structure of a batch when attention is masked."""

    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int
    step: int
    tokenizer_files: list[Path]
    tokenizer_sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int
    document_mask: bool = False
    restart_positions: bool = False

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def tokens_per_step(self) -> int:
        """Target tokens in one global batch, over all ranks."""
        return self.global_batch_size * self.seq_len

    def attention_inputs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra model inputs for ``inputs`` [B, T]: document ids (and restarted positions)
        when ``document_mask`` is on, else nothing (the model's plain causal path)."""
        if not self.document_mask:
            return {}
        return document_layout(inputs, self.bos_id, self.eos_id, self.restart_positions)

    def describe(self, steps: int) -> str:
        """One line for the run's log: what the first ``steps`` steps read."""
        raise NotImplementedError

    def _micro_batches(self, windows: np.ndarray) -> list[MicroBatch]:
        """Cut this rank's [per_rank, seq_len + 1] token windows into micro-batches, each
        with its model inputs."""
        tokens = torch.from_numpy(windows)
        m = self.micro_batch_size
        batches = []
        for i in range(0, len(tokens), m):
            inputs = tokens[i : i + m, :-1].contiguous()
            targets = tokens[i : i + m, 1:].contiguous()
            batches.append(MicroBatch(inputs, targets, self.attention_inputs(inputs)))
        return batches


class GlobalBatchLoader(BatchLoader):
    """Yields this rank's micro-batches of (inputs, targets) for one optimizer step at a time."""

    def __init__(
        self,
        shards: TokenShards,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        *,
        document_mask: bool = False,
        restart_positions: bool = False,
    ):
        check_batching(seq_len, global_batch_size, micro_batch_size, rank, world_size, seed)
        self.num_windows = shards.windows(seq_len)
        if self.num_windows < global_batch_size:
            raise DataError(
                f"corpus has {self.num_windows} windows of {seq_len}+1 tokens, fewer than one "
                f"global batch of {global_batch_size} sequences: add data or lower "
                "data.global_batch_size / data.seq_len"
            )
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = self.num_windows // global_batch_size
        self.step = 0
        self.window_order = WindowOrder(FEISTEL, self.num_windows)
        self.tokenizer_files, self.vocab_size = shards.tokenizer_files, shards.vocab_size
        self.tokenizer_sha256 = shards.tokenizer_sha256
        self.bos_id, self.eos_id = shards.bos_id, shards.eos_id
        self.document_mask, self.restart_positions = document_mask, restart_positions

    @property
    def epoch(self) -> int:
        """The (0-based) epoch the next batch comes from."""
        return self.step // self.batches_per_epoch

    def describe(self, steps: int) -> str:
        epochs = steps * self.global_batch_size / self.num_windows
        return (
            f"data {self.shards.path}: {self.num_windows:,} windows of {self.seq_len}+1 tokens, "
            f"{epochs:.2f} epochs over {steps:,} steps"
        )

    def global_batch(self, step: int) -> np.ndarray:
        """Window indices of global step ``step``, in order (the same for every rank)."""
        epoch, index = divmod(step, self.batches_per_epoch)
        size = self.global_batch_size
        positions = np.arange(index * size, (index + 1) * size, dtype=np.int64)
        return self.window_order.at([self.seed, epoch], positions)

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``accumulation_steps`` micro-batches of int64 [micro, seq_len] (x, y)."""
        per_rank = self.global_batch_size // self.world_size
        windows = self.global_batch(self.step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        span = self.seq_len + 1
        tokens = np.stack([self.shards.read(int(j) * self.seq_len, span) for j in windows])
        self.step += 1
        return self._micro_batches(tokens)

    def state_dict(self) -> dict:
        """The position in the global sample order, plus what it is only valid for."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_windows": self.num_windows,
            "order": self.window_order.order,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; world size and micro-batch size are free to differ."""
        for key in ("seed", "seq_len", "global_batch_size", "num_windows"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"checkpoint data loader has {key}={state.get(key)}, this run has "
                    f"{getattr(self, key)}: resume with the same data, seed, data.seq_len and "
                    "data.global_batch_size"
                )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"checkpoint data loader step {step!r} is invalid: use another one")
        self.window_order = WindowOrder(resumed_order(state), self.num_windows)
        self.step = step


def resumed_order(state: dict) -> str:
    """The sample order a checkpoint's loader state was written with: a run resumes in the
    order it started (a state from before orders were named is ``LEGACY``)."""
    order = state.get("order", LEGACY)
    if order not in ORDERS:
        raise DataError(
            f"checkpoint data loader has sample order {order!r}, which this yatrain does not "
            f"know (it knows {', '.join(ORDERS)}): resume with the yatrain that wrote it"
        )
    return order
