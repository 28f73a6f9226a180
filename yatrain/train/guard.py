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
import signal

import torch
import torch.distributed as dist


class StepGuard:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signal_name: str | None = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Outside the main thread (embedded use) no handler can be installed: skip.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal_name = signal.Signals(signum).name

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(stop requested on any rank, non-finite on any rank), agreed by all ranks."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        flags = torch.stack([torch.tensor(self.signal_name is not None, device=self.device), bad])
        flags = flags.to(torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, nonfinite = flags.tolist()
        if stop and self.signal_name is None:
            self.signal_name = "a signal on another rank"
        return bool(stop), bool(nonfinite)

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
