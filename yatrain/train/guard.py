"""Stop cleanly: on SIGTERM/SIGINT save a checkpoint and exit; never keep a non-finite state.

All ranks must agree on when to stop (a checkpoint is collective), so each step ends with
one tiny all-reduce of two flags: "a signal arrived here" and "this rank saw a non-finite
loss or gradient norm". It runs before the optimizer step, so such a step is never applied.

A finite gradient can still make the weights non-finite (a learning rate of 1e39 does).
``weights_finite`` checks after the update with one sum over each flat shard: a sum is
non-finite whenever any element is (inf and NaN propagate), at the cost of reading the
shard once (an element-wise ``isfinite().all()`` costs ~30x more here). A non-finite sum of
finite but huge weights is told apart by the element-wise check, run only then.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

_CTRL_C = "SIGINT (Ctrl-C)"
ANOTHER_RANK = "a signal on another rank"  # what a rank that got no signal itself says


class StepGuard:
    def __init__(self, device: torch.device, *, announces: bool = True) -> None:
        self.device = device
        self.announces = announces  # one rank (rank 0) says why the run stops
        self.signal_name: str | None = None
        self.run_dir_deleted_here = False  # set by rank 0, which holds the run dir's lock
        self.run_dir_deleted = False  # on any rank, agreed by the check
        self.saving: int | None = None  # the step whose checkpoint is being written
        self._announced = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Outside the main thread (embedded use) no handler can be installed: skip.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        """Note the first signal (Ctrl-C reaches a launched rank as SIGINT, then as the
        launcher's SIGTERM: the first is what the user did)."""
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a Ctrl-C after a signal: stop now, without a checkpoint
        if self.signal_name is not None:
            return
        self.signal_name = _CTRL_C if signum == signal.SIGINT else signal.Signals(signum).name
        if self.saving is not None:
            self._announce()

    @contextlib.contextmanager
    def during_save(self, step: int) -> Iterator[None]:
        """A checkpoint save: a signal that arrived before it or arrives during it is said
        at once, so a rank killed before the save ends (a launcher's short grace period)
        has still said why it was stopping."""
        self.saving = step
        if self.signal_name is not None:
            self._announce()
        try:
            yield
        finally:
            self.saving = None

    def _announce(self) -> None:
        if self._announced or not self.announces:
            return
        self._announced = True
        start = "\n" if os.isatty(2) else ""  # off a progress bar's line
        os.write(  # the one print that is safe wherever a signal interrupted
            2,
            f"{start}yatrain: {self.signal_name}: saving the checkpoint of step {self.saving}, "
            "then stopping\n".encode(),
        )

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(stop requested on any rank, non-finite on any rank), agreed by all ranks. A
        run directory deleted under the run stops it too (``run_dir_deleted``)."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        local = [self.signal_name is not None, self.run_dir_deleted_here]
        flags = torch.cat([torch.tensor(local, device=self.device), bad.reshape(1)])
        flags = flags.to(torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, deleted, nonfinite = flags.tolist()
        if stop and self.signal_name is None:
            self.signal_name = ANOTHER_RANK
        self.run_dir_deleted = bool(deleted)
        return bool(stop or deleted), bool(nonfinite)

    def stop_after_save(self) -> bool:
        """Whether a signal reached any rank during a save (collective, once per save):
        the run stops there, as the save announced, rather than after one more step."""
        flag = torch.tensor(float(self.signal_name is not None), device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal_name is None:
            self.signal_name = ANOTHER_RANK
        return bool(flag.item())

    def weights_finite(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every element of ``tensors`` (this rank's shards) is finite on every
        rank; collective."""
        bad = any(
            not torch.isfinite(t.detach().sum()) and not torch.isfinite(t.detach()).all()
            for t in tensors
        )
        flag = torch.tensor(float(bad), device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag.item())

    def restore(self, failing: bool = False) -> None:
        """Put the previous handlers back. A rank of a distributed run that is ending on an
        error ignores SIGTERM from then on: torchrun sends it to every rank once one exits,
        and it must not cut off this rank's one error line (torchrun's SIGKILL still comes
        after its grace period)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if failing and self._previous and dist.is_initialized() and dist.get_world_size() > 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
