"""``train.profile``: a torch.profiler trace of a few steps, written into the run directory.

``train.profile: N`` traces N steps, starting after the run's first two steps (warm-up:
the first steps allocate the optimizer state and warm the caches). Each rank writes
``RUN_DIR/profile/trace-rank{R}-steps{A}-{B}.json``, a Chrome trace that
``chrome://tracing``, Perfetto (ui.perfetto.dev) and TensorBoard open, with operator
shapes and memory events. On CUDA each rank also writes a memory snapshot,
``memory-rank{R}-steps{A}-{B}.pickle``, which https://pytorch.org/memory_viz draws (the
allocator's history over those steps, recorded with ``torch.cuda.memory``'s documented
``_record_memory_history`` / ``_dump_snapshot``, the calls torchtitan uses).

The profiler's C++ parts print notices of their own to stderr (kineto's ``USDT:`` start and
stop markers, the allocator's note on blocks allocated before tracing began), which no
setting turns off once torch is loaded: while tracing, stderr goes to a file and is replayed
without them when tracing ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

WARMUP_STEPS = 2
_NOISE = re.compile(r"^USDT:|CPUAllocator\.cpp.*allocated before the profiling started")
SNAPSHOT_ENTRIES = 100_000  # allocator events kept for the memory snapshot


class StepProfiler:
    """Traces steps ``first..last`` of a run (none when ``steps`` is 0)."""

    def __init__(
        self,
        steps: int,
        run_dir: Path,
        rank: int,
        device: torch.device,
        start_step: int,
        say: Callable[[str], None],
    ) -> None:
        self.first = start_step + WARMUP_STEPS + 1 if steps else -1
        self.last = self.first + steps - 1 if steps else -1
        self.out_dir, self.rank, self.device, self.say = run_dir / "profile", rank, device, say
        self.profiler: profile | None = None
        self.quiet: _QuietStderr | None = None
        self.current = self.first

    @contextlib.contextmanager
    def step(self, step_number: int) -> Iterator[None]:
        """Wrap one step: tracing starts before the first chosen step, ends after the last."""
        if step_number == self.first:
            self._start()
        if self.profiler is None:
            yield
            return
        try:
            with record_function(f"step {step_number}"):  # each step is one span
                yield
        finally:
            if step_number == self.last:
                self._finish()
            self.current = step_number

    def close(self) -> None:
        """A run that stops inside the window still writes what it traced."""
        if self.profiler is not None:
            self.last = self.current
            self._finish()

    def _start(self) -> None:
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.quiet = _QuietStderr()
        self.profiler.start()

    def _finish(self) -> None:
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()
        finally:
            if self.quiet is not None:
                self.quiet.restore()
                self.quiet = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}-steps{self.first}-{self.last}"
        trace = self.out_dir / f"trace-{name}.json"
        _write(trace, profiler.export_chrome_trace)
        written = [trace]
        if self.device.type == "cuda":
            snapshot = self.out_dir / f"memory-{name}.pickle"
            _write(snapshot, torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.say(f"profile of steps {self.first}-{self.last}: {', '.join(map(str, written))}")


def _write(path: Path, export: Callable[[str], None]) -> None:
    """Write through a temporary name: a crash leaves no half-written file."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.unlink(missing_ok=True)  # a link left there is removed, not written through
    export(str(tmp))
    os.replace(tmp, path)


class _QuietStderr:
    """File descriptor 2 into a temporary file until ``restore``, which writes its lines
    back to stderr, less the profiler's own notices (``_NOISE``)."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in restore()
        os.dup2(self.file.fileno(), 2)

    def restore(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        text = self.file.read().decode(errors="replace")
        self.file.close()
        kept = [line for line in text.splitlines(keepends=True) if not _NOISE.search(line)]
        sys.stderr.write("".join(kept))
        sys.stderr.flush()
