"""Muon with the engine's other features: compiled decoder layers train as eager ones do, and
float8 gathers and matmuls train beside it (Muon updates the fp32 masters either way).

Training runs of the tiny recipe at test size (a few steps each), in this process."""

from __future__ import annotations

import math

import pytest
from test_checkpoint import losses, recipe

from yatrain.train.loop import pretrain

MUON = ("optim.name=muon", "optim.muon_ns_dtype=fp32", "checkpoint.enabled=false")
STEPS = 4


def _run(data, run_dir, *extra) -> dict[int, tuple[float, float]]:
    pretrain(recipe(data, *MUON, *extra), run_dir=run_dir, steps=STEPS, progress=False)
    return losses(run_dir)


def test_compiled_layers_train_with_muon_as_eager_ones_do(small_data, tmp_path):
    eager = _run(small_data, tmp_path / "eager")
    compiled = _run(
        small_data, tmp_path / "compiled", "train.compile=true", "train.compile_backend=aot_eager"
    )
    assert eager.keys() == compiled.keys() == set(range(1, STEPS + 1))
    for step, (loss, norm) in eager.items():
        assert compiled[step][0] == pytest.approx(loss, rel=1e-5)
        assert compiled[step][1] == pytest.approx(norm, rel=1e-4)


def test_float8_trains_with_muon(small_data, tmp_path):
    plain = _run(small_data, tmp_path / "plain", "model.ffn_dim=192")
    fp8 = _run(small_data, tmp_path / "fp8", "model.ffn_dim=192", "train.float8=tensorwise")
    assert all(math.isfinite(loss) for loss, _ in fp8.values())
    assert fp8[1][0] == pytest.approx(plain[1][0], rel=0.02)  # the same start, fp8 rounding
    assert fp8[STEPS][0] < fp8[1][0]  # and it learns
