"""Every file is written whole or not at all (a full disk injected with ``faults.FullDisk``),
a torn ``metrics.jsonl`` is cut back or left out with a note, and a sweep never replaces
files or folders it did not write."""

from __future__ import annotations

import errno
import shutil
import sys

import pytest
from conftest import FAST, ROOT
from faults import FullDisk
from torch.distributed.checkpoint.api import CheckpointException

from yatrain.checkpoint.manifest import CheckpointError
from yatrain.checkpoint.store import PendingSave, save_failure
from yatrain.cli import main
from yatrain.errors import ConfigError
from yatrain.output.html_report import MARKER, write_report
from yatrain.output.record import MetricsFile, read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.sweep import plan_sweep, run_sweep
from yatrain.sweep import run as sweep_run
from yatrain.train.loop import pretrain

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]


@pytest.fixture(scope="module")
def logged_run(small_data, tmp_path_factory):
    """A 4-step run with a checkpoint at step 2 and 4 logged records."""
    run_dir = tmp_path_factory.mktemp("logged") / "run"
    overrides = [*FAST, f"data.path={small_data}", "checkpoint.every=2"]
    pretrain(
        load_recipe(ROOT / "recipes/tiny.yaml", overrides), run_dir=run_dir, steps=4, progress=False
    )
    return run_dir, overrides


# ------------------------------------------------------------------ 1. foreign files


def sweep(out_dir, data, monkeypatch):
    """``yatrain sweep`` of one configuration whose run must never start."""
    monkeypatch.setattr(sweep_run, "launch", lambda *a: pytest.fail("a configuration ran"))
    return run_sweep(
        ROOT / "recipes/tiny.yaml",
        [32],
        ["0"],
        steps=3,
        output=out_dir,
        overrides=[*TINY, f"data.path={data}", "logging.wandb.mode=disabled"],
        echo=lambda _: None,
    )


def test_sweep_output_holding_a_users_files_is_refused(small_data, tmp_path, monkeypatch):
    out_dir = tmp_path / "mine"
    out_dir.mkdir()
    (out_dir / "sweep.csv").write_text("my,own,table\n")
    with pytest.raises(ConfigError, match="is not empty and is not a yatrain sweep directory"):
        sweep(out_dir, small_data, monkeypatch)
    assert (out_dir / "sweep.csv").read_text() == "my,own,table\n"
    assert sorted(p.name for p in out_dir.iterdir()) == ["sweep.csv"]


def test_sweep_never_removes_a_folder_it_did_not_make(small_data, tmp_path, monkeypatch):
    out_dir = tmp_path / "sweep"
    (out_dir / "configs/seq32-ckpt0").mkdir(parents=True)
    (out_dir / "configs/seq32-ckpt0/notes.txt").write_text("mine")
    (out_dir / sweep_run.SWEEP_MARK).touch()  # a sweep directory, but not a run of it
    with pytest.raises(ConfigError, match="is not a run this sweep started"):
        sweep(out_dir, small_data, monkeypatch)
    assert (out_dir / "configs/seq32-ckpt0/notes.txt").read_text() == "mine"


def test_sweep_output_a_file_and_garbage_results_are_one_line(small_data, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    for output in (tmp_path / "file", tmp_path / "file/below"):
        with pytest.raises(ConfigError, match="is a file, not a directory"):
            sweep(output, small_data, monkeypatch)
    out_dir = tmp_path / "garbage"
    out_dir.mkdir()
    (out_dir / "results.jsonl").write_text('{"row": {"name": "a"}}\n[1, 2]\n')
    with pytest.raises(ConfigError, match="results.jsonl line 2 is not a sweep result"):
        sweep(out_dir, small_data, monkeypatch)


def plan_only(out_dir):
    """``yatrain sweep --plan-only`` of the tiny model (nothing trains)."""
    return plan_sweep(ROOT / "recipes/tiny.yaml", [32], [1], 1, output=out_dir, overrides=TINY)


def test_plan_only_sweep_never_writes_over_or_through_a_users_files(tmp_path):
    """It wrote over a user's plan.csv and through a link at plan.png."""
    users = tmp_path / "mine"
    users.mkdir()
    (users / "plan.csv").write_text("my,own,plan\n")
    with pytest.raises(ConfigError, match="is not empty and is not a yatrain sweep directory"):
        plan_only(users)
    assert [(p.name, p.read_text()) for p in users.iterdir()] == [("plan.csv", "my,own,plan\n")]
    with pytest.raises(ConfigError, match="plan.csv is a file, not a directory"):
        plan_only(users / "plan.csv/below")
    out_dir = tmp_path / "plan"
    plan_only(out_dir)
    (tmp_path / "picture.png").write_bytes(b"mine")
    (out_dir / "plan.png").unlink()
    (out_dir / "plan.png").symlink_to(tmp_path / "picture.png")
    plan_only(out_dir)  # its own directory: the link is replaced, not followed
    assert (tmp_path / "picture.png").read_bytes() == b"mine"
    assert not (out_dir / "plan.png").is_symlink()
    assert (out_dir / "plan.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ 2. a full disk


def test_report_on_a_full_disk_leaves_no_report_html_cut_short(logged_run, tmp_path, monkeypatch):
    run_dir, _ = logged_run
    out_dir = tmp_path / "rep"
    earlier = write_report([run_dir], out_dir).read_bytes()
    pngs = sum(p.stat().st_size for p in out_dir.glob("*.png"))
    FullDisk(monkeypatch, out_dir, room=pngs + 4096)  # the PNGs fit, the page does not
    with pytest.raises(OSError) as failed:
        write_report([run_dir], out_dir)
    assert failed.value.errno == errno.ENOSPC
    assert (out_dir / "report.html").read_bytes() == earlier  # the earlier page, whole
    hidden = [p for p in out_dir.iterdir() if p.name.startswith(".") and p.name != MARKER]
    assert not hidden  # no temporary left (the report's own list of its files is no temporary)


def test_metrics_records_are_appended_whole_on_a_full_disk(logged_run, tmp_path, monkeypatch):
    records = read_metrics(logged_run[0] / "metrics.jsonl")
    path = tmp_path / "metrics.jsonl"
    file = MetricsFile(path)
    file.write(records[0])
    before = path.read_bytes()
    FullDisk(monkeypatch, tmp_path, room=50)  # a record is a few hundred bytes
    with pytest.raises(OSError, match="No space left"):
        file.write(records[1])
    file.close()
    assert path.read_bytes() == before


def test_a_torn_metrics_tail_is_cut_when_the_file_is_opened(logged_run, tmp_path):
    records = read_metrics(logged_run[0] / "metrics.jsonl")
    path = tmp_path / "metrics.jsonl"
    whole = (logged_run[0] / "metrics.jsonl").read_text().splitlines()
    path.write_text(whole[0] + "\n" + whole[1][:60])  # a killed writer's half record
    file = MetricsFile(path)
    file.write(records[1])
    file.close()
    assert [r.step for r in read_metrics(path)] == [records[0].step, records[1].step]


def test_resume_over_unparsable_metrics_lines_says_so_and_continues(logged_run, tmp_path, capsys):
    source, overrides = logged_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    damaged = [
        lines[0],
        b"[1, 2, 3]\n",
        lines[1],
        b'{"step": \xff}\n',
        *lines[2:],
        b'{"step": 5, "lo',
    ]
    (run_dir / "metrics.jsonl").write_bytes(b"".join(damaged))
    pretrain(
        load_recipe(ROOT / "recipes/tiny.yaml", overrides), run_dir=run_dir, steps=6, progress=False
    )
    said = capsys.readouterr().err
    assert "line 2 is not a metrics record (it is a JSON list, not an object)" in said
    assert "line 4 is not a metrics record (it is not UTF-8 text)" in said
    assert "line 7 is not a metrics record (it is not JSON" in said
    assert "continuing from the checkpoint at step 4" in said
    assert [r.step for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_disk_full_inside_torch_save_is_named_with_what_it_needs(tmp_path):
    """torch's zip writer reports a full disk as ``unexpected pos``; the disk's error is only
    the exception's context."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904
    except RuntimeError as zip_error:
        error = CheckpointException("save failed", {0: (zip_error, None)})
    save = PendingSave(
        tmp_path,
        4,
        tmp_path / ".tmp-step-4",
        {"unit_numels": [2**28]},
        keep=2,
        tokenizer_files=(),
        is_main=True,
    )
    line = save_failure(save, error)
    assert f"no space left on device at {tmp_path} (needs about 3.00 GiB)" in line
    assert "enforce fail" not in line and "\n" not in line


def test_a_checkpoint_save_onto_a_full_disk_says_so(small_data, tmp_path, monkeypatch):
    """The disk fills up under torch's zip writer (which then reports a position mismatch):
    the line names the full disk, where, and what a checkpoint needs; nothing is kept."""
    run_dir = tmp_path / "run"
    FullDisk(monkeypatch, run_dir / "checkpoints", room=200_000)
    overrides = [*FAST, f"data.path={small_data}", "checkpoint.every=2"]
    with pytest.raises(CheckpointError) as failed:
        pretrain(
            load_recipe(ROOT / "recipes/tiny.yaml", overrides),
            run_dir=run_dir,
            steps=2,
            progress=False,
        )
    line = str(failed.value)
    assert f"no space left on device at {run_dir / 'checkpoints'} (needs about" in line, line
    assert "unexpected pos" not in line and "\n" not in line
    assert list((run_dir / "checkpoints").iterdir()) == []


# ------------------------------------------------------------------ 3. paths in the way


def test_a_path_in_the_way_is_one_line_naming_it(logged_run, tmp_path, monkeypatch, capsys):
    """A directory where a file belongs (config.yaml, metrics.jsonl, report.html) or a file
    above an --output was a traceback."""
    source, overrides = logged_run
    run_dir, other = tmp_path / "run", tmp_path / "other"
    for folder, name in ((run_dir, "config.yaml"), (other, "metrics.jsonl")):
        shutil.copytree(source, folder)
        (folder / name).unlink()
        (folder / name).mkdir()
    (tmp_path / "rep/report.html").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    sets = [f"--set={s}" for s in overrides]
    commands = {
        "config.yaml": ["pretrain", str(ROOT / "recipes/tiny.yaml"), *sets, "--steps", "6"],
        "report.html": ["report", str(source), "--output", str(tmp_path / "rep")],
        "file": ["prepare-data", "--output", str(tmp_path / "file/data"), "--vocab-size", "512"],
    }
    commands["metrics.jsonl"] = [*commands["config.yaml"], "--run-dir", str(other)]
    commands["config.yaml"] += ["--run-dir", str(run_dir)]
    for name, args in commands.items():
        monkeypatch.setattr(sys, "argv", ["yatrain", *args])
        with pytest.raises(SystemExit) as ended:
            main()
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert ended.value.code == 2 and len(errors) == 1, errors
        assert name in errors[0] and str(tmp_path) in errors[0], errors[0]
    assert (run_dir / "config.yaml").is_dir() and (tmp_path / "file").read_text() == "x"
