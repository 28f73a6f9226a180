"""Weights in and out: Hugging Face export (checked against transformers) and init_from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT

from yatrain.config import load_recipe
from yatrain.errors import ConfigError
from yatrain.models.llama import build_model
from yatrain.sharding import ShardedEngine
from yatrain.train.loop import pretrain
from yatrain.train.weights import export_hf, init_from_source, iter_checkpoint_weights


@pytest.fixture(scope="module")
def trained(small_data, tmp_path_factory) -> tuple[Path, object]:
    """A few steps of the tiny recipe (small shape), so weights are not just the init."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}"])
    pretrain(cfg, run_dir=run_dir, steps=3, progress=False)
    return run_dir / "checkpoints/step-3", cfg


def our_model(weights: dict[str, torch.Tensor], cfg):
    model = build_model(cfg.model).to_empty(device="cpu")
    model.load_state_dict(weights)
    return model.eval()


def test_export_writes_a_complete_hf_directory(trained, tmp_path):
    checkpoint, cfg = trained
    out = export_hf(checkpoint, tmp_path / "hf")
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "model.safetensors.index.json"} <= set(names)
    assert {"tokenizer.model", "tokenizer_config.json"} <= set(names)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    with pytest.raises(Exception, match="not empty"):
        export_hf(checkpoint, out)
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written


def test_transformers_loads_export_with_matching_logits(trained, tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="pip install -e '.[hf]' to run the Hugging Face round trip"
    )
    checkpoint, cfg = trained
    out = export_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours = our_model(dict(iter_checkpoint_weights(checkpoint)), cfg)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = ours(tokens)
        got = theirs(tokens).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def _engine_weights(cfg, source: Path) -> dict[str, torch.Tensor]:
    model = build_model(cfg.model)
    init = init_from_source(source, cfg.model, model)
    return ShardedEngine.from_model(model, device="cpu", init=init).full_state_dict()


def test_init_from_hf_and_from_checkpoint_round_trip(trained, tmp_path):
    checkpoint, cfg = trained
    want = dict(iter_checkpoint_weights(checkpoint))
    from_checkpoint = _engine_weights(cfg, checkpoint)
    from_hf = _engine_weights(cfg, export_hf(checkpoint, tmp_path / "hf"))
    for name, tensor in want.items():
        assert torch.equal(from_checkpoint[name], tensor), name
        assert torch.equal(from_hf[name], tensor), name


def test_init_from_rejects_other_shapes_and_unknown_dirs(trained, tmp_path):
    checkpoint, cfg = trained
    other = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, "model.n_layers=3"])
    with pytest.raises(ConfigError, match="another"):
        init_from_source(checkpoint, other.model, build_model(other.model))
    with pytest.raises(ConfigError, match="neither"):
        init_from_source(tmp_path, cfg.model, build_model(cfg.model))


def test_pretrain_init_from_starts_at_the_given_weights(trained, small_data, tmp_path):
    checkpoint, _ = trained
    cfg = load_recipe(
        ROOT / "recipes/tiny.yaml",
        [
            *FAST,
            f"data.path={small_data}",
            f"train.init_from={checkpoint}",
            "optim.lr=1.0e-12",
            "optim.min_lr=0",
        ],
    )
    fresh = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}"])
    a = pretrain(cfg, run_dir=tmp_path / "a", steps=1, progress=False)
    b = pretrain(fresh, run_dir=tmp_path / "b", steps=1, progress=False)
    assert a["first_loss"] < b["first_loss"]  # trained weights, not a fresh init
