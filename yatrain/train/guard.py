"""Stop cleanly: on SIGTERM/SIGINT save a checkpoint and exit; never step on a non-finite state.

All ranks must agree on when to stop (a checkpoint is collective), so each step ends with
one tiny all-reduce of two flags: "a signal arrived here" and "this rank saw a non-finite
loss or gradient norm". It runs before the optimizer step, so a bad step is never applied.
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

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
