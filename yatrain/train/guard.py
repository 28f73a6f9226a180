"""Stop cleanly: on SIGTERM/SIGINT save a checkpoint and exit; never keep a non-finite state;
and never make the host wait for the device to decide either.

All ranks must agree on when to stop (a checkpoint is collective). The host's own flags ("a
signal arrived here", "the run directory is gone") are all-reduced every step on a CPU
process group (``agree_on_stop``): host work, no device wait. Whether a step is finite is
decided on the device (``nonfinite``): the loss and gradient norm's flag, agreed with a MAX
all-reduce, is exactly 0.0 or 1.0 and is handed to the optimizer as ``found_inf`` (as
``GradScaler`` does), so a non-finite step changes no weight and no optimizer state, and
the device counts it.

A finite gradient can still make the weights non-finite (a learning rate of 1e39 does).
``note_weights`` checks after the update with each flat shard's smallest and largest
element (``aminmax``: one read of the shard; NaN and infinities propagate, and unlike a sum
nothing finite can overflow), the first step that did it recorded on the device.

The host reads these device records only where it reads anything (``settle``: at log
steps, evaluations and saves, through ``runtime.host_reads``): the weights first (non-finite
weights make every later step non-finite), then the steps skipped since the last read.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from yatrain.runtime.host_reads import device_values, host_read, on_host
from yatrain.sharding.comm import host_backend

_CTRL_C = "SIGINT (Ctrl-C)"
ANOTHER_RANK = "a signal on another rank"  # what a rank that got no signal itself says
_NONE = 2**62  # "no step yet" in a MIN all-reduce of step numbers


@dataclass(frozen=True)
class Settled:
    """What the device recorded since the last ``settle``, read by the host."""

    bad_weights_step: int | None  # the first step whose update made a weight non-finite
    skipped: int  # steps whose loss or gradient norm was not finite (not applied)
    first_skipped: int | None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def host_group() -> dist.ProcessGroup | None:
    """The process group for host flags: the default one when it moves CPU tensors (gloo,
    or a fake world's backend), else one of every rank on ``host_backend`` (the engine's
    rule for its own CPU groups; built collectively)."""
    if not _distributed():
        return None
    backend = host_backend()
    return None if backend == str(dist.get_backend()) else dist.new_group(backend=backend)


class StepGuard:
    def __init__(self, device: torch.device, *, announces: bool = True) -> None:
        self.announces = announces  # one rank (rank 0) says why the run stops
        self.signal_name: str | None = None
        self.run_dir_deleted_here = False  # set by rank 0, which holds the run dir's lock
        self.run_dir_deleted = False  # on any rank, agreed by the check
        self.saving: int | None = None  # the step whose checkpoint is being written
        self._announced = False
        self._previous = {}
        self.step_number = 0  # the step the loop is in: what the device records
        self._host_group = host_group()
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped, self._first_skipped, self._first_bad = zero, zero.clone(), zero.clone()
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

    def agree_on_stop(self) -> bool:
        """Whether a stop was requested on any rank (a signal, or the run directory deleted:
        ``run_dir_deleted``); host flags on the host group, read without the device."""
        stop, deleted = self._agreed([self.signal_name is not None, self.run_dir_deleted_here])
        self.run_dir_deleted = deleted
        return stop or deleted

    def nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The step's skip flag on the device: float32 exactly 1.0 where the loss or gradient
        norm is not finite on some rank, else 0.0 (MAX all-reduce); counted for ``settle``."""
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).to(torch.float32).reshape(())
        if _distributed():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        hit = bad > 0
        self._skipped += hit
        self._first_skipped = self._first(hit, self._first_skipped)
        return bad

    def note_weights(self, tensors: list[torch.Tensor]) -> None:
        """Record on the device whether this step's update made any of ``tensors`` (this
        rank's shards) non-finite; the first such step is kept for ``settle``."""
        extremes = torch.cat([torch.stack(torch.aminmax(t.detach())) for t in tensors if t.numel()])
        self._first_bad = self._first(~torch.isfinite(extremes).all(), self._first_bad)

    def _first(self, hit: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """``kept``, or this step's number where ``hit`` and none was kept (0): on the device."""
        return torch.where(hit & (kept == 0), self.step_number, kept)

    def settle(self) -> Settled:
        """Read what the device recorded since the last call (collective: every rank calls
        it at the same steps, the log steps, evaluations and saves)."""
        first_bad = torch.where(self._first_bad == 0, _NONE, self._first_bad)
        if _distributed():
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        known = device_values(first_bad, self._skipped, self._first_skipped)
        known = known if known[0] is not None else [_NONE, 0, 0]  # unknown: a dry run
        bad, skipped, first_skipped = (int(v) for v in known)
        self._skipped.zero_()
        self._first_skipped.zero_()
        return Settled(bad if bad != _NONE else None, skipped, first_skipped or None)

    def stop_after_save(self) -> bool:
        """Whether a signal reached any rank during a save (collective, once per save):
        the run stops there, as the save announced, rather than after one more step."""
        return self._agreed([self.signal_name is not None])[0]

    def _agreed(self, local: list[bool]) -> list[bool]:
        """Host flags OR-ed over every rank on the host group, read without the device; the
        first is "a signal arrived", which a rank that got none then names as another's."""
        flags = on_host(torch.tensor(local, dtype=torch.float32))
        if _distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._host_group)
        agreed = [bool(v) for v in host_read(flags.tolist) or local]  # fake flags: a dry run
        if agreed[0] and self.signal_name is None:
            self.signal_name = ANOTHER_RANK
        return agreed

    def restore(self, failing: bool = False) -> None:
        """Put the previous handlers back. A rank of a distributed run that is ending on an
        error ignores SIGTERM from then on: torchrun sends it to every rank once one exits,
        and it must not cut off this rank's one error line (torchrun's SIGKILL still comes
        after its grace period)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if failing and self._previous and dist.is_initialized() and dist.get_world_size() > 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
