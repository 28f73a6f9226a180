"""The QA probe of issue 22, prepare-data's findings (3, 4, 6, 11): bounded workers, signals
that end the workers and leave nothing behind, names that lie, and empty documents counted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_failures import one_line_error, yatrain

from yatrain.data.parallel import default_workers


def _prepare(out: Path, *args: str) -> list[str]:
    return ["prepare-data", "--output", str(out), "--no-progress", *args]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _default_sigint() -> None:
    """A job started in the background by a non-interactive shell (nohup, ``cmd &``) has
    SIGINT ignored, and its children inherit that: give the probe a real Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_3_workers_are_bounded_by_the_cpus(small_data, isolated_env, tmp_path):
    tokenizer, work = str(small_data / "tokenizer.model"), tmp_path / "work"
    work.mkdir()
    for workers in ("10000", "0"):
        out = work / f"out-{workers}"
        result = yatrain(
            *_prepare(out, "--tokenizer", tokenizer, "--workers", workers), env=isolated_env
        )
        one_line_error(result, f"--workers {workers}: pass 1 to {default_workers()}")
        assert list(work.iterdir()) == []


@pytest.mark.skipif(default_workers() < 2, reason="needs two CPUs for two workers")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_4_a_signal_ends_the_workers_and_removes_the_temporary_directory(
    small_data, isolated_env, tmp_path, signum
):
    work = tmp_path / "work"
    out = work / "out"
    (work / ".tmp-out-stale").mkdir(parents=True)  # a killed run's: its lock is free
    (work / ".tmp-out-stale" / ".prepare.lock").touch()
    (work / ".tmp-out-old").mkdir()  # no lock: named, not removed
    args = _prepare(out, "--tokenizer", str(small_data / "tokenizer.model"), "--workers", "2")
    process = subprocess.Popen(
        [sys.executable, "-m", "yatrain", *args],
        cwd=ROOT,
        env=isolated_env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        while len(workers := _children(process.pid)) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # tokenizing
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("yatrain:")]
    assert len(lines) == 1 and "prepare-data stopped; nothing was written" in lines[0], err
    assert "removed " in err and ".tmp-out-stale" in err and ".tmp-out-old" in err
    assert sorted(p.name for p in work.iterdir()) == [".tmp-out-old"]
    for _ in range(100):  # terminated and reaped by the parent before it exited
        if not any(_alive(pid) for pid in workers):
            break
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)


def test_6_a_name_that_lies_about_compression_is_one_line(small_data, isolated_env, tmp_path):
    plain = tmp_path / "docs.jsonl.gz"
    plain.write_text(json.dumps({"text": "hello world"}) + "\n")
    args = _prepare(tmp_path / "out", "--input", str(plain), "--vocab-size", "64")
    one_line_error(yatrain(*args, env=isolated_env), "is named .gz but is not gzip-compressed")
    assert not (tmp_path / "out").exists()


def test_11_empty_documents_are_counted(small_data, isolated_env, tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = ["a first document", "   ", "a second one", "\n\t\n", "the third"] * 40
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = _prepare(
        out,
        "--input",
        str(docs),
        "--tokenizer",
        str(small_data / "tokenizer.model"),
        "--val-fraction",
        "0",
        "--workers",
        "1",
    )
    result = yatrain(*args, env=isolated_env)
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_documents"] == 120 and manifest["empty_documents"] == 80
    assert "80 empty documents dropped" in result.stdout
    assert "dropped 80 empty (whitespace-only) document(s)" in result.stderr
