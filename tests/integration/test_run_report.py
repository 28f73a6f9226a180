"""``yatrain report``: charts and one self-contained HTML page for one run or several, a
run in progress included, and the page renders in a real browser (headless Chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from conftest import FAST, ROOT
from test_failures import one_line_error, yatrain

from yatrain.errors import ConfigError
from yatrain.output.charts import LINES
from yatrain.output.html_report import write_report
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

CHARTS = [stem for stem, *_ in LINES] + ["step_time"]


@pytest.fixture(scope="module")
def two_runs(small_data, tmp_path_factory):
    """A finished run with evaluations, and a copy caught mid-write (half a last line) that
    stopped on a hang (its report in hang/)."""
    root = tmp_path_factory.mktemp("runs")
    overrides = [*FAST, f"data.path={small_data}", "eval.every=2", "checkpoint.enabled=false"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    pretrain(recipe, run_dir=root / "done", steps=4, progress=False)
    live = root / "live"
    shutil.copytree(root / "done", live)
    metrics = (live / "metrics.jsonl").read_text().splitlines()
    (live / "metrics.jsonl").write_text("\n".join(metrics[:3]) + "\n" + metrics[3][:40])
    (live / "hang").mkdir()
    (live / "hang/report.txt").write_text("yatrain: hang report (by rank 0, x): rank 2 is behind\n")
    return root / "done", live


def test_report_of_two_runs_is_one_self_contained_page(two_runs, tmp_path):
    done, live = two_runs
    page = write_report([done, live], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"{c}.png" for c in CHARTS] + ["report.html", ".yatrain-report"]
    )
    text = page.read_text()
    assert len(re.findall(r'<img alt="[a-z_]+" src="data:image/png;base64,', text)) == len(CHARTS)
    assert not re.search(r'(src|href)="(?!data:)', text)  # nothing fetched from elsewhere
    assert "4 records, last at step 4" in text and "3 records, last at step 3" in text
    assert "Step time by part (after step 1): compute" in text
    assert "<h3>Hang report</h3>" in text and "rank 2 is behind" in text
    assert text.count("<h3>Hang report</h3>") == 1  # only the run that has one


def test_report_command_and_its_errors(two_runs, isolated_env, tmp_path):
    done, _ = two_runs
    result = yatrain("report", str(done), "--output", str(tmp_path / "r"), env=isolated_env)
    assert result.returncode == 0 and "wrote" in result.stderr, result.stderr
    assert (tmp_path / "r/report.html").is_file()
    missing = yatrain("report", str(tmp_path / "nothing"), env=isolated_env)
    one_line_error(missing, "has no metrics.jsonl")


def test_the_html_report_renders_in_headless_chromium(two_runs, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium installed (apt-get install chromium): browser check skipped")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed")
    page_path = write_report(list(two_runs), tmp_path / "out")
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            images = page.evaluate(
                "Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])"
            )
        finally:
            browser.close()
    assert [alt for alt, *_ in images] == CHARTS
    assert all(complete and width > 0 for _, complete, width in images), images
    assert errors == []


def _tree(folder):
    """Every entry under ``folder`` with its bytes (a link as its target): what a refusal
    must leave as it was."""
    return {
        str(p.relative_to(folder)): (str(p.readlink()) if p.is_symlink() else p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def test_a_report_into_a_directory_of_other_files_is_refused_untouched(
    two_runs, isolated_env, tmp_path
):
    done, _ = two_runs
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.html").write_text("my own page")
    (mine / "loss.png").write_bytes(b"my own chart")
    before = _tree(mine)
    result = yatrain("report", str(done), "--output", str(mine), env=isolated_env)
    one_line_error(result, f"--output {mine}", "did not write", "new or empty directory")
    assert _tree(mine) == before


def test_the_default_report_directory_of_other_files_is_refused(two_runs, isolated_env, tmp_path):
    """Several runs report into ./report by default: a user's report.html there is kept."""
    done, live = two_runs
    (tmp_path / "report").mkdir()
    (tmp_path / "report/report.html").write_text("my own page")
    command = [sys.executable, "-m", "yatrain", "report", str(done), str(live)]
    result = subprocess.run(
        command, env=isolated_env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    one_line_error(result, "report", "did not write")
    assert _tree(tmp_path / "report") == {"report.html": b"my own page"}


def test_a_report_output_that_is_a_link_is_refused(two_runs, isolated_env, tmp_path):
    done, _ = two_runs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    result = yatrain("report", str(done), "--output", str(tmp_path / "out"), env=isolated_env)
    one_line_error(result, f"--output {tmp_path / 'out'}", "symbolic link")
    assert list(elsewhere.iterdir()) == []


def test_a_report_replaces_its_own_earlier_report(two_runs, tmp_path):
    done, live = two_runs
    out = tmp_path / "out"
    write_report([done], out)
    first = (out / "report.html").read_text()
    write_report([done, live], out)
    assert (out / "report.html").read_text() != first  # replaced: both runs now
    names = {p.name for p in out.iterdir()}
    assert names == {f"{c}.png" for c in CHARTS} | {"report.html", ".yatrain-report"}
    (out / "notes.txt").write_text("mine")  # a file of the user's joins: no longer ours alone
    with pytest.raises(ConfigError, match="notes.txt"):
        write_report([done], out)
    assert (out / "notes.txt").read_text() == "mine"
