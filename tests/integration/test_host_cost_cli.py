"""The collectives of a real run, counted from outside the code: ``yatrain pretrain`` under
torchrun at world size 2, counted by the shared collective counter (a ``sitecustomize`` that
wraps ``torch.distributed``'s functions in every process and writes their calls at exit).

The configuration users run: bf16 weights, fp32 reduction, gradient accumulation 2, the
first layer checkpointed, ``sharding.reduce_staging_mib: auto``. Each unit's gradient is
reduced by one reduce-scatter per micro-batch; the norm group once a step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import FAST, ROOT

COUNTER = ROOT.parent / "shared" / "tools" / "collective_counter"
STEPS, ACCUM, LAYERS = 2, 2, 2  # FAST: 2 layers
UNITS = LAYERS + 2  # embedding, layers, output head


@pytest.mark.skipif(not COUNTER.is_dir(), reason=f"the shared collective counter ({COUNTER})")
def test_pretrain_reduces_each_unit_once_per_micro_batch(small_data, isolated_env, tmp_path):
    counts = tmp_path / "counts"
    env = dict(isolated_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COUNTER), env.get("PYTHONPATH")]))
    env["COLLECTIVE_COUNT_DIR"] = str(counts)
    sets = [
        *FAST,
        f"data.path={small_data}",
        "data.global_batch_size=8",  # micro-batch 2 x world 2 x accumulation 2
        "train.dtype=bf16",
        "sharding.reduce_dtype=fp32",
        "sharding.activation_checkpoint_layers=1",
        "sharding.reduce_staging_mib=auto",
        "checkpoint.enabled=false",
        "eval.every=0",
        "eval.at_end=false",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command = [*torchrun, "--standalone", "-m", "yatrain", "pretrain", "recipes/tiny.yaml"]
    command += [*(f"--set={s}" for s in sets), "--steps", str(STEPS), "--no-progress"]
    command += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads(path.read_text()) for path in counts.glob("*.json")]
    ranks = [r for r in ranks if r["rank"] is not None and "reduce_scatter_single" in r["calls"]]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for found in ranks:
        calls = found["calls"]
        assert calls["reduce_scatter_single"] == STEPS * (ACCUM * UNITS + 1), calls
        assert "reduce_scatter_tensor" not in calls  # no other reduce-scatter besides
        # A forward and (when evicted) a backward gather of every unit, the norms once a step.
        assert calls["all_gather_single"] <= STEPS * (ACCUM * 2 * UNITS + 1), calls
