"""Bad input to ``report``, ``generate``, ``export``, ``plan`` and TensorBoard's folder is one
``yatrain: error`` line and exit 2, never a traceback (the commands run in this process
through ``yatrain.cli.main``, as the console script runs them)."""

from __future__ import annotations

import contextlib
import io
import shutil
import sys

import pytest
from conftest import FAST, ROOT
from safetensors import SafetensorError
from test_whole_files import logged_run  # noqa: F401 (a fixture)

from yatrain.checkpoint import hf_export
from yatrain.cli import main
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain
from yatrain.train.rundir import LOCK_FILE


def cli(*args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``yatrain ARGS``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["yatrain", *args])
        try:
            main()
        except SystemExit as done:
            code = done.code
    return code, err.getvalue()


def one_line(args: list[str], *needles: str) -> str:
    code, err = cli(*args)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("yatrain: error")]
    assert len(lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


BAD_RECORDS = {
    "an array": (b"[1, 2, 3]", "it is a JSON list, not an object"),
    "a number": (b"42", "it is a JSON int, not an object"),
    "a text step": (b'{"step": "abc", "loss": 1.0}', "its step 'abc' is not a whole number"),
    "not utf-8": (b'{"step": 3, "loss": \xff}', "it is not UTF-8 text"),
    "infinite": (b"1e999", "it is a JSON float, not an object"),
    "an infinite loss": (b'{"step": 3, "loss": 1e999}', "its loss inf is not finite"),
    "a zero step time": (b'{"step": 3, "step_time_s": 0}', "its step_time_s 0 is not positive"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_report_on_a_line_that_is_no_record_is_one_line(logged_run, tmp_path, name):  # noqa: F811
    line, why = BAD_RECORDS[name]
    run_dir = tmp_path / "run"
    shutil.copytree(logged_run[0], run_dir)
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_bytes(b"".join([lines[0], line + b"\n", *lines[1:]]))
    one_line(["report", str(run_dir)], "metrics.jsonl line 2 is not a metrics record", why)
    assert not (run_dir / "report").exists()


def test_report_on_a_last_line_that_is_whole_but_no_record(logged_run, tmp_path):  # noqa: F811
    """A last line with its newline is not one being written: it is named too."""
    run_dir = tmp_path / "run"
    shutil.copytree(logged_run[0], run_dir)
    with (run_dir / "metrics.jsonl").open("ab") as f:
        f.write(b"[1, 2, 3]\n")
    one_line(["report", str(run_dir)], "line 5 is not a metrics record", "a JSON list")


def test_report_of_a_run_named_like_math_text(logged_run, tmp_path):  # noqa: F811
    run_dir = tmp_path / "lr$^^$"
    shutil.copytree(logged_run[0], run_dir)
    code, err = cli("report", str(run_dir))
    assert code == 0, err[-3000:]
    assert (run_dir / "report/report.html").is_file()


def test_report_output_a_file_or_below_one_is_one_line(logged_run, tmp_path):  # noqa: F811
    (tmp_path / "file").write_text("mine")
    for output in (tmp_path / "file", tmp_path / "file/below"):
        one_line(["report", str(logged_run[0]), "--output", str(output)], "is a file")
    assert (tmp_path / "file").read_text() == "mine"


def test_report_with_a_hang_report_that_is_not_utf8(logged_run, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(logged_run[0], run_dir)
    (run_dir / "hang").mkdir()
    (run_dir / "hang/report.txt").write_bytes(b"rank 1 stuck \xff\xfe in all_gather\n")
    code, err = cli("report", str(run_dir), "--output", str(tmp_path / "rep"))
    assert code == 0, err[-3000:]
    assert "rank 1 stuck \ufffd\ufffd in all_gather" in (tmp_path / "rep/report.html").read_text()


def test_tensorboard_folder_that_is_a_file_is_one_line(small_data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).touch()  # a run directory, which a user put a file into
    (run_dir / "tensorboard").write_text("mine")
    recipe = tmp_path / "recipe.yaml"
    shutil.copy(ROOT / "recipes/tiny.yaml", recipe)
    sets = [f"--set={s}" for s in [*FAST, f"data.path={small_data}", "logging.tensorboard=true"]]
    args = ["pretrain", str(recipe), *sets, "--run-dir", str(run_dir), "--steps", "1"]
    one_line([*args, "--no-progress"], f"{run_dir / 'tensorboard'} is a file, not a directory")
    assert (run_dir / "tensorboard").read_text() == "mine"


def test_tensorboard_folder_that_is_read_only_is_one_line(small_data, tmp_path):
    pytest.importorskip("tensorboard")
    if shutil.os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: nothing to refuse")
    (tmp_path / "run/tensorboard").mkdir(parents=True)
    (tmp_path / "run/tensorboard").chmod(0o500)
    overrides = [*FAST, f"data.path={small_data}", "logging.tensorboard=true"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    with pytest.raises(Exception, match="is not writable"):
        pretrain(recipe, run_dir=tmp_path / "run", steps=1, progress=False)


def test_generate_seed_out_of_range_and_a_prompt_not_utf8_are_one_line(logged_run):  # noqa: F811
    checkpoint = str(logged_run[0] / "checkpoints/step-4")
    for seed in ("99999999999999999999", "-1"):
        one_line(["generate", checkpoint, "--prompt", "a", "--seed", seed], "--seed")
    one_line(["generate", checkpoint, "--prompt", "caf\udce9"], "--prompt is not valid UTF-8")


def test_export_onto_a_full_disk_is_one_line(logged_run, tmp_path, monkeypatch):  # noqa: F811
    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

    monkeypatch.setattr(hf_export, "save_file", full)
    output = tmp_path / "hf"
    checkpoint = str(logged_run[0] / "checkpoints/step-4")
    one_line(["export", checkpoint, "--output", str(output)], "No space left on device")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(
    "flags",
    [
        ["--gpu-memory", "inf"],
        ["--gpu-memory", "nan"],
        ["--gpu-memory", "1e308"],
        ["--runtime-allowance", "1e308"],
        ["--runtime-allowance", "nan"],
        ["--gpus", "99999999999999999999"],
    ],
)
def test_plan_flags_out_of_range_are_one_line(flags):
    args = ["plan", str(ROOT / "recipes/llama3_8b.yaml"), "--gpus", "8", *flags]
    one_line(args, flags[0])
