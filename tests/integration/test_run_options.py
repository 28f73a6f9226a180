"""Recipe switches of a run: ``train.profile`` traces steps into the run directory, and
``sharding.force_process_group`` trains through the buffered path exactly like the direct one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from conftest import FAST, ROOT

from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain


def run(data: Path, run_dir: Path, steps: int, *extra: str) -> list[float]:
    recipe = load_recipe(
        ROOT / "recipes/tiny.yaml",
        [
            *FAST,
            f"data.path={data}",
            "checkpoint.enabled=false",
            "train.dtype=fp32",
            *extra,
        ],
    )
    pretrain(recipe, run_dir=run_dir, steps=steps, progress=False)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_profile_writes_a_trace_of_the_chosen_steps(small_data, tmp_path):
    run(small_data, tmp_path / "run", 5, "train.profile=2")
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [t.name for t in traces] == ["trace-rank0-steps3-4.json"]  # after 2 warm-up steps
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 3", "step 4"} <= names and "step 5" not in names  # one span per step
    assert any(str(n).startswith("aten::mm") for n in names)  # the model's matmuls


def test_no_profile_by_default(small_data, tmp_path):
    run(small_data, tmp_path / "run", 4)
    assert not (tmp_path / "run" / "profile").exists()


def test_force_process_group_trains_exactly_like_the_direct_path(small_data, tmp_path):
    direct = run(small_data, tmp_path / "direct", 3)
    forced = run(small_data, tmp_path / "forced", 3, "sharding.force_process_group=true")
    assert forced == direct  # fp32: bit-identical losses
    assert not dist.is_initialized()  # the one-rank group was the run's own, and is gone


def test_deterministic_mode_is_accepted_on_cpu_and_changes_nothing(
    small_data, tmp_path, monkeypatch, recwarn
):
    """``train.deterministic``: torch's deterministic kernels, strictly, and cuBLAS's
    workspace setting before CUDA starts; written into config.yaml. A CPU is deterministic
    already: the same losses, bit for bit, and no warning."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    plain = run(small_data, tmp_path / "plain", 3)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        strict = run(small_data, tmp_path / "strict", 3, "train.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    assert strict == plain
    written = yaml.safe_load((tmp_path / "strict" / "config.yaml").read_text())
    assert written["train"]["deterministic"] is True
    assert not [str(w.message) for w in recwarn.list]
