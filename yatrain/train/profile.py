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
setting turns off once torch is loaded: while tracing and writing the trace, stderr (file
descriptor 2) goes to a file, and is written back as it was, less those notices, when it
ends; a progress bar redrawn meanwhile is written back too, without a notice inside it.
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

from yatrain.runtime.run_paths import check_folder, own_folder

WARMUP_STEPS = 2
# The profiler's notices, wherever they start: a progress bar drawn without a newline may
# come before one on the same line (tqdm redraws with "\r").
_NOISE = re.compile(
    rb"USDT:[^\n]*\n?|\[[A-Z][^\n\r\]]*CPUAllocator\.cpp[^\n]*before the profiling started[^\n]*\n?"
)
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
        if steps:
            check_folder(self.out_dir)  # a link or a file there: one line before step 1
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
        """Stop tracing and write the files; the profiler's own notices stay quiet until
        they are written (kineto's ``profiler_stop`` marker comes while exporting)."""
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()
            written = self._export(profiler)
        finally:
            if self.quiet is not None:
                self.quiet.restore()
                self.quiet = None
        self.say(f"profile of steps {self.first}-{self.last}: {', '.join(map(str, written))}")

    def _export(self, profiler: profile) -> list[Path]:
        own_folder(self.out_dir)  # never through a link (runtime/run_paths.py)
        name = f"rank{self.rank}-steps{self.first}-{self.last}"
        trace = self.out_dir / f"trace-{name}.json"
        _write(trace, profiler.export_chrome_trace)
        written = [trace]
        if self.device.type == "cuda":
            snapshot = self.out_dir / f"memory-{name}.pickle"
            _write(snapshot, torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        return written


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
        """fd 2 back, and what was written meanwhile onto it as it was (a progress bar's
        redraws included), less the profiler's notices."""
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        kept = _NOISE.sub(b"", self.file.read())
        self.file.close()
        with contextlib.suppress(OSError):
            while kept:
                kept = kept[os.write(2, kept) :]
