"""The throughput numbers a run prints: FLOPs per token, tokens/s, TFLOP/s and MFU by hand."""

from __future__ import annotations

import json

import pytest
from conftest import FAST, ROOT

from yatrain.models.llama import flops_per_token
from yatrain.recipe.load import load_recipe
from yatrain.runtime import device
from yatrain.train.loop import pretrain

# The FAST shape (dim 64, 2 layers, 4 heads of 16, 2 kv heads, ffn 160, vocab 512), seq 32:
# per layer wq, wo 2 x 64 x 64 = 8,192; wk, wv 2 x 64 x 32 = 4,096; SwiGLU 3 x 64 x 160 =
# 30,720; two norms 128 -> 43,136. N = 2 x 43,136 + final norm 64 + output head 512 x 64
# = 119,104 (the input embedding is a lookup, not counted). Attention: 12 x 2 layers x 4
# heads x 16 x 32 tokens = 49,152. FLOPs per token = 6 x 119,104 + 49,152 = 763,776.
FAST_FLOPS_PER_TOKEN = 763_776
TOKENS_PER_STEP = 4 * 32  # global batch 4 sequences x 32 tokens
PEAK = 2.5e9  # a made-up device peak, so MFU has an exact expected value


def test_llama3_8b_flops_per_token_by_hand():
    """Llama 3 8B at 8192 tokens: per layer 2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336
    + 2 x 4096 = 218,112,000; N = 32 x that + 4096 + 128256 x 4096 = 7,504,924,672;
    attention 12 x 32 x 32 x 128 x 8192 = 12,884,901,888."""
    cfg = load_recipe(ROOT / "recipes/llama3_8b.yaml").model
    assert flops_per_token(cfg, 8192) == 6 * 7_504_924_672 + 12_884_901_888 == 57_914_449_920


def test_run_reports_throughput_tflops_and_mfu_by_hand(small_data, tmp_path, monkeypatch):
    monkeypatch.setattr(device, "measure_matmul_flops", lambda device, dtype: PEAK)
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}"])
    assert flops_per_token(cfg.model, cfg.data.seq_len) == FAST_FLOPS_PER_TOKEN
    run_dir = tmp_path / "run"
    summary = pretrain(cfg, run_dir=run_dir, steps=4, progress=False)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        approx = pytest.approx  # float round-off only
        assert r["tokens_seen"] == r["step"] * TOKENS_PER_STEP
        assert r["tokens_per_s"] * r["step_time_s"] == approx(TOKENS_PER_STEP, rel=1e-9)
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"]  # one process
        per_device = r["tokens_per_s_per_device"]
        assert r["tflops_per_device"] == approx(FAST_FLOPS_PER_TOKEN * per_device / 1e12)
        assert r["mfu"] == approx(FAST_FLOPS_PER_TOKEN * per_device / PEAK)
    # Step times are measured, not invented: together they fit inside the run's wall time.
    assert 0 < sum(r["step_time_s"] for r in records) <= summary["wall_time_s"]
