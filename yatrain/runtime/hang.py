"""Hang reports that name the culprit: which ranks are behind, where, and which are gone.

When one rank of many hangs or dies, every other rank waits in a collective and each of
their watchdogs can only say "this rank is stuck". So every rank keeps a note of where it
is (``snapshot``: the step, the part of it, the engine's phase, unit and micro-batch, how
many collectives it has entered, what it waits on). When a watchdog fires or a peer is
lost, the rank sets ``requested`` in the job's key-value store (``Runtime.store``, not a
collective: it works while ranks are stuck) and publishes its note; every other rank's
watchdog sees the request at its next check and publishes its own. The first rank to ask
collects the notes for up to ``grace_s`` and prints one report: the ranks that are behind
(fewer collectives entered than the rest: the culprit of a hang), the ranks that sent
nothing (dead, or unable to run Python), and where the rest wait.

Each attempt of a run (a start, a restart by ``--resume auto`` or the launcher's
``--max-restarts``) keeps its evidence in a folder of its own, ``RUN_DIR/hang/attempt-N/``
(N chosen by rank 0 when it claims the run directory, ``use_attempt``), so a restart never
wipes the stacks of the hang that made it: each rank's Python stacks in
``stack-rankR.txt`` (``faulthandler``, armed for the watchdog's timeout, so they are written
even while a thread holds the GIL), the report in ``report.txt``, which names the stacks of
its own attempt; ``RUN_DIR/hang/report.txt`` is a copy of the newest report. A rank that
died without a word (SIGKILL) leaves no empty stack file beside the report. ``hang/`` and
its folders are never links (``run_paths.own_folder``). On GPUs Python only knows which
collectives were enqueued, not which finished: NCCL's flight recorder is on
(``runtime.nccl_flight_recorder``) and the report says where its dumps go.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from yatrain.errors import YatrainError
from yatrain.files import no_follow, write_whole
from yatrain.runtime.run_paths import check_folder, own_folder

POLL_S = 0.1  # how often the collecting rank looks for the notes still missing
REPORT = "report.txt"
_ATTEMPTS: dict[str, int] = {}  # run directory -> this process's attempt (use_attempt)


def hang_dir(run_dir: Path) -> Path:
    return run_dir / "hang"


def next_attempt(run_dir: Path) -> int:
    """The first N with no ``hang/attempt-N`` (rank 0, holding the run directory's lock);
    one line when ``hang`` is a link or not a directory."""
    check_folder(hang_dir(run_dir))
    number = 1
    while os.path.lexists(hang_dir(run_dir) / f"attempt-{number}"):
        number += 1
    return number


def use_attempt(run_dir: Path, number: int) -> None:
    """This process's ranks write their hang evidence for ``run_dir`` into attempt
    ``number`` (every rank gets rank 0's number with the run directory)."""
    _ATTEMPTS[str(run_dir)] = number


def attempt_dir(run_dir: Path) -> Path:
    """``RUN_DIR/hang/attempt-N`` of this attempt (a caller that claimed no run directory
    gets the next free one, kept for the rest of the process)."""
    number = _ATTEMPTS.setdefault(str(run_dir), next_attempt(run_dir))
    return hang_dir(run_dir) / f"attempt-{number}"


class StackFile:
    """``RUN_DIR/hang/attempt-N/stack-rankR.txt``: the Python stacks of every thread of
    this rank, written by ``faulthandler`` once a phase has lasted ``timeout_s`` (``arm``),
    or now (``dump``). Removed at a clean exit when nothing was written."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        folder = attempt_dir(run_dir)
        own_folder(folder.parent)
        own_folder(folder)
        self.path = folder / f"stack-rank{rank}.txt"
        self.file = open(self.path, "w", opener=no_follow)  # noqa: SIM115 -- closed in close()

    def arm(self, timeout_s: float | None) -> None:
        """Dump after ``timeout_s`` unless re-armed first (None: never)."""
        if timeout_s is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            faulthandler.dump_traceback_later(timeout_s, repeat=False, file=self.file)

    def dump(self) -> None:
        faulthandler.dump_traceback(self.file, all_threads=True)
        self.file.flush()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.file.close()
        if self.path.stat().st_size == 0:
            self.path.unlink()
            with contextlib.suppress(OSError):  # other ranks' files may still be there
                self.path.parent.rmdir()
                self.path.parent.parent.rmdir()


class HangReporter:
    """One rank's side of the hang report (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        run_dir: Path,
        key: str,
        snapshot: Callable[[], dict],
        grace_s: float,
        flight_recorder: str | None = None,
    ) -> None:
        self.store = dist.PrefixStore(f"hang/{key}", store)
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.snapshot, self.grace_s, self.flight_recorder = snapshot, grace_s, flight_recorder
        self.folder = attempt_dir(run_dir)  # this attempt's evidence
        self.published = False

    @property
    def report_path(self) -> Path:
        """Where this attempt's report is written."""
        return self.folder / REPORT

    def requested(self) -> bool:
        """Has some rank asked for a report? (polled by the watchdog)"""
        with contextlib.suppress(Exception):  # the store's host is gone: nothing to answer
            return self.store.check(["requested"])
        return False

    def publish(self, why: str) -> None:
        """Put this rank's note in the store."""
        note = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "why": why,
            **self.snapshot(),
        }
        with contextlib.suppress(Exception):
            self.store.set(f"note/{self.rank}", json.dumps(note))
            self.published = True

    def report(self, why: str) -> str | None:
        """Ask every rank for its note and publish this one's; the first rank to ask prints
        the report, the others wait (bounded) until it is out, so the store's host stays.
        Returns the report's headline (which ranks are behind or gone), when there is one."""
        try:
            self.store.set("requested", "1")
            self.publish(why)
            first = self.store.add("reporter", 1) == 1
        except Exception:  # no store to report through: the one-line exit still comes
            return None
        if not first:
            self._wait_for(lambda: self.store.check(["done"]), self.grace_s + 5)
            with contextlib.suppress(Exception):
                return self.store.get("headline").decode()
            return None
        notes = self._collect()
        self._drop_empty_stacks(notes)
        text = format_report(
            notes, self.world_size, self.folder, self.rank, why, self.flight_recorder
        )
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        with contextlib.suppress(OSError, YatrainError):  # the report is on stderr already
            write_whole(own_folder(self.folder) / REPORT, text + "\n")
            write_whole(hang_dir(self.run_dir) / REPORT, text + "\n")  # the newest
        headline = blame_headline(notes, self.world_size)[0]
        with contextlib.suppress(Exception):
            self.store.set("headline", headline)
            self.store.set("done", str(self.rank))
        return headline

    def _collect(self) -> dict[int, dict]:
        keys = [f"note/{r}" for r in range(self.world_size)]
        self._wait_for(lambda: self.store.check(keys), self.grace_s)
        notes = {}
        for rank, key in enumerate(keys):
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    notes[rank] = json.loads(self.store.get(key))
        return notes

    def _drop_empty_stacks(self, notes: dict[int, dict]) -> None:
        """Remove the still empty stack files of ranks that sent no note within the wait:
        killed (SIGKILL) before they could close them. A rank that is alive but cannot run
        Python has dumped its stacks by now (its timer fired with this one's)."""
        for rank in range(self.world_size):
            path = self.folder / f"stack-rank{rank}.txt"
            with contextlib.suppress(OSError):
                if rank not in notes and os.lstat(path).st_size == 0:
                    path.unlink()

    def stopped(self) -> None:
        """Say this rank has printed its line, then wait (bounded) for every other rank that
        sent a note to say the same: the first rank to exit makes torchrun stop the rest, and
        a rank stopped before its line would leave its log without one."""
        keys = [f"note/{r}" for r in range(self.world_size)]
        with contextlib.suppress(Exception):
            self.store.set(f"stopped/{self.rank}", "1")
            sent = [r for r, key in enumerate(keys) if self.store.check([key])]
            self._wait_for(lambda: self.store.check([f"stopped/{r}" for r in sent]), self.grace_s)

    @staticmethod
    def _wait_for(ready: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(POLL_S)


def format_report(
    notes: dict[int, dict],
    world_size: int,
    folder: Path,
    by: int,
    why: str,
    flight_recorder: str | None = None,
) -> str:
    """The report's text: a headline naming the culprits, then one line per group of ranks
    in the same place, and where the stacks of this attempt are (``folder``)."""
    headline, behind = blame_headline(notes, world_size)
    missing = [r for r in range(world_size) if r not in notes]
    lines = [f"yatrain: hang report (by rank {by}, {why}): {headline}"]
    groups: dict[str, list[int]] = {}
    for rank in sorted(notes):
        groups.setdefault(describe(notes[rank]), []).append(rank)
    for text, ranks in groups.items():
        tag = "  <- behind" if ranks[0] in behind else ""
        lines.append(f"  {ranks_text(ranks)}: {text}{tag}")
    if missing:
        lines.append(f"  {ranks_text(missing)}: no note within the report's wait")
    stacks = folder / "stack-rank*.txt"
    lines.append(f"  Python stacks of every rank that reached its timeout: {stacks}")
    if flight_recorder:
        lines.append(
            f"  NCCL flight recorder dumps: {flight_recorder}<rank> on each rank's "
            "host, when NCCL's own timeout fires (read them with torchfrtrace)"
        )
    return "\n".join(lines)


def blame_headline(notes: dict[int, dict], world_size: int) -> tuple[str, list[int]]:
    """The report's headline (the ranks behind, the ranks that sent nothing) and the ranks
    behind."""
    missing = [r for r in range(world_size) if r not in notes]
    most = max((n["collectives"] for n in notes.values()), default=0)
    # Behind: fewer collectives entered than the rest and not waiting in one (a rank that
    # waits is held up by another); without such a rank, any rank with fewer (a mismatch).
    fewer = sorted(r for r, n in notes.items() if n["collectives"] < most)
    behind = [r for r in fewer if not notes[r].get("waiting_on")] or (fewer if not missing else [])
    blame = [f"{ranks_text(behind)} {'is' if len(behind) == 1 else 'are'} behind"] if behind else []
    if missing:
        blame.append(f"{ranks_text(missing)} sent nothing (dead, or cannot run Python)")
    return "; ".join(blame) or "no rank is behind or missing (all wait in one collective)", behind


def describe(note: dict) -> str:
    """Where one rank is, in words (without its rank or timings, so equal places group)."""
    unit = f"unit {note['unit']}, " if note.get("unit") is not None else ""
    inside = f"{note['phase']} of {unit}micro-batch {note['micro_batch']}"
    if note.get("waiting_on"):
        where = f"waiting in an {note['waiting_on']} ({inside})"
    elif note.get("stage") == "data":
        where = "loading data (not in a collective)"
    elif note.get("phase") in ("forward", "backward"):
        where = f"computing ({inside}; not in a collective)"
    else:
        where = f"{note.get('stage') or 'between steps'} (not in a collective)"
    return f"{note.get('doing') or 'idle'}, {where}, {note['collectives']} collectives entered"


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
