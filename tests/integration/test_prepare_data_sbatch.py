"""scripts/prepare_data.sbatch: its array tasks run as local processes (a fake
SLURM_ARRAY_TASK_ID), one killed mid-write and rerun, then the merge; and `submit` with a
stand-in for SLURM's sbatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from tokenizer_fixtures import sample_texts

from yatrain.data import TokenShards, prepare_data, train_tokenizer

SCRIPT = ROOT / "scripts/prepare_data.sbatch"
VENV = Path(sys.executable).parents[1]
# Injected into the killed task only: SIGKILL right after its first token file write.
KILL = """
import os, signal
if os.environ.get("KILL_AFTER_FIRST_WRITE"):
    import yatrain.data.shards as _shards
    _real = _shards.ShardWriter.write

    def _write(self, tokens):
        _real(self, tokens)
        os.kill(os.getpid(), signal.SIGKILL)

    _shards.ShardWriter.write = _write
"""


@pytest.fixture()
def setup(tmp_path, isolated_env) -> tuple[Path, Path, dict]:
    corpus = tmp_path / "in"
    corpus.mkdir()
    texts = sample_texts(200, seed=3)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[:140])
    (corpus / "a.jsonl").write_text(lines)
    pq.write_table(pa.table({"text": texts[140:]}), corpus / "b.parquet", row_group_size=5)
    model = train_tokenizer(sample_texts(), tmp_path / "sp", 400)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(KILL)
    env = {**isolated_env, "YATRAIN_VENV": str(VENV)}
    env["PYTHONPATH"] = f"{faults}{os.pathsep}{env['PYTHONPATH']}"
    return corpus, model, env


def _script(env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**env, **extra},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_array_tasks_a_killed_one_rerun_and_the_merge(tmp_path, setup):
    corpus, model, env = setup
    out = tmp_path / "out"
    args = ["--input", str(corpus), "--tokenizer", str(model), "--workers", "1"]
    args += ["--val-fraction", "0.2"]
    for task in range(3):
        kill = {"KILL_AFTER_FIRST_WRITE": "1"} if task == 1 else {}
        done = _script(env, "part", "3", str(out), *args, SLURM_ARRAY_TASK_ID=str(task), **kill)
        assert done.returncode == (-9 if task == 1 else 0), done.stderr
    assert len(list((out / "parts").glob(".tmp-part-00001-of-00003-*"))) == 1
    merge = _script(env, "merge", str(out))
    assert merge.returncode != 0 and len(merge.stderr.strip().splitlines()) == 1
    assert "part 1/3" in merge.stderr and "stopped while being written" in merge.stderr
    assert "--shard 1/3" in merge.stderr and not (out / "manifest.json").exists()
    said = []
    for task in range(3):  # the array resubmitted
        done = _script(env, "part", "3", str(out), *args, SLURM_ARRAY_TASK_ID=str(task))
        assert done.returncode == 0, done.stderr
        said.append(done.stdout)
    assert ["nothing to do" in s for s in said] == [True, False, True]
    assert not list((out / "parts").glob(".tmp-*"))
    merge = _script(env, "merge", str(out))
    assert merge.returncode == 0 and f"merged {out}" in merge.stdout, merge.stderr
    one = tmp_path / "one"
    prepare_data(one, [corpus], tokenizer=model, workers=1, val_fraction=0.2, progress=False)
    for split in ("train", "validation"):
        a, b = TokenShards.open(one, split=split), TokenShards.open(out, split=split)
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))


def test_submit_makes_the_array_and_the_merge_that_waits_for_it(tmp_path, isolated_env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\nn=$(wc -l < {log})\necho "$((700 + n));cluster"\n'
    )
    sbatch.chmod(0o755)
    env = {**isolated_env, "PATH": f"{bin_dir}{os.pathsep}{isolated_env['PATH']}"}
    done = _script(env, "submit", "8", "/shared/web", "--input", "/shared/raw", "--tokenizer", "t")
    assert done.returncode == 0, done.stderr
    parts, merge = log.read_text().splitlines()
    assert parts.startswith("--parsable --array=0-7 ")
    assert parts.endswith("part 8 /shared/web --input /shared/raw --tokenizer t")
    assert "--dependency=afterany:701 " in merge and merge.endswith("merge /shared/web")
    assert "job 701" in done.stdout and "job 702" in done.stdout
    for count in ("0", "100000", "99999999999999999999"):
        bad = _script(env, "submit", count, "/shared/web")
        assert bad.returncode == 2 and "from 1 to 99999" in bad.stderr, bad.stderr
    assert len(log.read_text().splitlines()) == 2  # nothing more submitted


def test_shard_and_merge_flags_refuse_what_cannot_work(tmp_path, isolated_env):
    cases = [
        (["--output", "o", "--vocab-size", "512", "--shard", "0/2"], "--shard needs an existing"),
        (["--output", "o", "--tokenizer", "t", "--shard", "2/2"], "pass I/N with 0 <= I < N"),
        (["--merge", str(tmp_path), "--output", "o"], "--merge DIR takes no --output"),
        (["--merge", str(tmp_path)], "no complete part under"),
    ]
    for args, says in cases:
        done = subprocess.run(
            [sys.executable, "-m", "yatrain", "prepare-data", *args],
            env=isolated_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert done.returncode != 0 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
