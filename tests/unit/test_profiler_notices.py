"""While ``train.profile`` traces, the profiler's own notices (kineto's ``USDT:`` markers,
the allocator's note) are dropped from stderr even when a progress bar, drawn without a
newline, comes before one on its line; everything else written meanwhile comes back as it
was."""

from __future__ import annotations

import os

from yatrain.train.profile import _QuietStderr

BAR = b"\rpretrain:  75%|#######   | 3/4 [00:04<00:01,  1.23s/step]"
STOP = b"USDT:2026-12-06 19:06:04 14858:14858 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
ALLOCATOR = (
    b"[W1206 19:06:04.350 14858 CPUAllocator.cpp:249] Memory block of unknown size was "
    b"allocated before the profiling started, profiler results will not include the "
    b"deallocation event\n"
)


def test_a_notice_after_the_progress_bar_is_dropped_and_the_rest_kept(capfd):
    quiet = _QuietStderr()
    os.write(2, BAR + STOP)  # as captured: the bar's redraw, then kineto's marker
    os.write(2, b"\r" + b" " * 20 + b"\rsaved step-3\n" + ALLOCATOR + BAR)
    quiet.restore()
    err = capfd.readouterr().err
    assert "USDT" not in err and "CPUAllocator" not in err
    assert err == (BAR + b"\r" + b" " * 20 + b"\rsaved step-3\n" + BAR).decode()
