"""Continued pretraining from published weights: a Llama 3.1-style model (rotary
scaling) and a tied Llama 3.2-style one, built by transformers itself in fp32, go through
``train.init_from``, train a few steps, are exported, and transformers agrees on the logits
at positions beyond ``original_max_position_embeddings``."""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from safetensors import safe_open
from test_hf_import import our_logits, save_hf_model, transformers_module
from tokenizer_fixtures import write_hf

from yatrain.checkpoint import hf_export as export_module
from yatrain.checkpoint.hf_export import default_export_dtype, export_hf, iter_checkpoint_weights
from yatrain.checkpoint.init_from import init_from_source
from yatrain.checkpoint.manifest import open_checkpoint
from yatrain.checkpoint.optimizer_state import ensure_state
from yatrain.checkpoint.store import save_checkpoint
from yatrain.data import default_corpus_files, load_tokenizer, prepare_data
from yatrain.errors import ConfigError, DataError
from yatrain.inference.generate_text import load_plain_model
from yatrain.models.llama import build_model, count_parameters
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine
from yatrain.train.loop import pretrain
from yatrain.train.optim import build_optimizer

# Llama 3.1's scaling with a 16-token "pretraining context", so a 64-token model reaches
# four times past it (Llama 3.1: factor 8 over 8192 tokens; Llama 3.2: factor 32).
SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SCALED = f"model.rope_scaling={json.dumps(SCALING)}"
KINDS = {"llama3_1": [SCALED], "llama3_2": [SCALED, "model.tie_embeddings=true"]}


@pytest.mark.parametrize(
    "name,billions",
    [("llama3_1_8b", 8.03), ("llama3_1_70b", 70.55), ("llama3_2_1b", 1.24), ("llama3_2_3b", 3.21)],
)
def test_recipes_have_the_published_shapes(name, billions):
    """Parameter counts as Meta publishes them (a tied embedding counted once)."""
    r = load_recipe(ROOT / f"recipes/{name}.yaml")
    assert round(count_parameters(r.model) / 1e9, 2) == billions
    assert r.model.rope_scaling.factor == (8.0 if "3_1" in name else 32.0)
    assert r.model.tie_embeddings is name.startswith("llama3_2")
    assert (r.optim.schedule, r.sharding.activation_checkpoint_layers) == ("wsd", "auto")


def test_export_defaults_to_bf16_above_a_billion_parameters():
    big = load_recipe(ROOT / "recipes/llama3_2_1b.yaml").model
    assert default_export_dtype(big, "fp32") == "bf16"
    assert default_export_dtype(recipe("llama3_2", "data.path=x").model, "fp32") == "fp32"


def recipe(kind: str, *more: str):
    return load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, *KINDS[kind], *more])


def save_published(
    kind: str, folder: Path, spelling: str = "rope_parameters", dtype: torch.dtype | None = None
):
    """A transformers model of the recipe's shape in several safetensors files (``dtype``
    on disk, bf16 as published; default fp32), its config.json spelling the scaling as
    transformers 5 does or as Meta's files do."""
    cfg = recipe(kind, "data.path=unused")
    tied = kind == "llama3_2"
    model = save_hf_model(
        cfg, folder, rope_scaling={"rope_type": "llama3", **SCALING}, tie_word_embeddings=tied
    )
    if dtype is not None:
        model = model.to(dtype)
    (folder / "model.safetensors").unlink()  # the first save's single file
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    if spelling == "rope_scaling":  # Meta's published config.json
        path = folder / "config.json"
        config = json.loads(path.read_text())
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params
        path.write_text(json.dumps(config))
    assert len(list(folder.glob("*.safetensors"))) > 2  # units span several files
    return cfg, model


def tokens(cfg, length: int = 60) -> torch.Tensor:
    """Positions 0..59: most of them past the 16-token original context."""
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.model.vocab_size, (2, length), generator=gen)


@pytest.mark.parametrize("kind", ["llama3_1", "llama3_2"])
@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_init_from_matches_transformers_past_the_original_context(kind, spelling, tmp_path):
    cfg, theirs = save_published(kind, tmp_path / "hf", spelling)
    x = tokens(cfg)
    with torch.no_grad():
        want = theirs(x).logits
    got = our_logits(cfg, tmp_path / "hf", x)
    assert (got - want).abs().max() < 1e-5
    # The scaling matters here: plain RoPE on the same weights is far off.
    plain = dataclasses.replace(cfg.model, rope_scaling=None)
    model = build_model(plain).to_empty(device="cpu")
    model.load_state_dict(_engine_weights(cfg, tmp_path / "hf"))
    with torch.no_grad():
        assert (model.eval()(x) - want).abs().max() > 1e-3


def _engine_weights(cfg, source: Path) -> dict[str, torch.Tensor]:
    model = build_model(cfg.model)
    init = init_from_source(source, cfg.model, model)
    return ShardedEngine.from_model(model, device="cpu", init=init).full_state_dict()


def _load_quietly(transformers, folder: Path):
    """``from_pretrained`` with every warning and warning log line captured."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    finally:
        logger.removeHandler(handler)
    shown = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
    return model.eval(), shown + [r.getMessage() for r in records]


@pytest.mark.parametrize("kind", ["llama3_1", "llama3_2"])
def test_trained_export_loads_in_transformers_and_agrees(kind, small_data, tmp_path, monkeypatch):
    transformers = transformers_module()
    monkeypatch.setattr(export_module, "SHARD_BYTES", 150_000)  # several files, as for 8B
    save_published(kind, tmp_path / "hf")
    cfg = recipe(
        kind, f"data.path={small_data}", f"train.init_from={tmp_path / 'hf'}", "train.dtype=fp32"
    )
    pretrain(cfg, run_dir=tmp_path / "run", steps=3, progress=False)
    out = export_hf(tmp_path / "run/checkpoints/step-3", tmp_path / "out")
    before, after = _tensors(tmp_path / "hf"), _tensors(out)
    assert before.keys() == after.keys()  # tied: no lm_head.weight, as published
    assert all(not torch.equal(before[k], after[k]) for k in before)  # all of it trained
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (kind == "llama3_2")
    assert config["rope_scaling"] == {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}
    assert ("lm_head.weight" in after) is (kind == "llama3_1")
    files = list(out.glob("*.safetensors"))
    assert len(files) > 2 and all(f.stat().st_size <= 150_000 + 10_000 for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)
    theirs, warned = _load_quietly(transformers, out)
    assert warned == []
    weights = dict(iter_checkpoint_weights(tmp_path / "run/checkpoints/step-3"))
    ours = build_model(cfg.model).to_empty(device="cpu")
    ours.load_state_dict(weights)
    # What `yatrain generate` builds from the checkpoint: the same model.
    saved = open_checkpoint(tmp_path / "run/checkpoints/step-3")
    plain = load_plain_model(saved, torch.device("cpu"), torch.float32)
    x = tokens(cfg)
    with torch.no_grad():
        want = theirs(x).logits
        assert (want - ours.eval()(x)).abs().max() < 1e-5
        assert (want - plain(x)).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["llama3_1", "llama3_2"])
def test_round_trip_without_training_is_bit_exact(kind, tmp_path):
    """HF -> init_from -> a yatrain checkpoint -> export (fp32): every tensor unchanged."""
    cfg, _ = save_published(kind, tmp_path / "hf")
    model = build_model(cfg.model)
    init = init_from_source(tmp_path / "hf", cfg.model, model)
    engine = ShardedEngine.from_model(model, device="cpu", init=init)
    optimizer = build_optimizer(engine.param_groups(0.1), cfg.optim)
    ensure_state(optimizer)
    meta = {"model": dataclasses.asdict(cfg.model), "dtype": "fp32"}
    saved = save_checkpoint(
        tmp_path / "ckpt", 0, engine, optimizer, None, meta, is_main=True, keep=1
    )
    out = export_hf(saved, tmp_path / "out", "fp32")
    before, after = _tensors(tmp_path / "hf"), _tensors(out)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            found.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return found


def test_the_model_directory_s_tokenizer_goes_through_data_training_and_export(tmp_path):
    """prepare-data --tokenizer HF_DIR (tokenizer.json, BOS/EOS from tokenizer_config.json),
    data.tokenizer checked against it, and the export carries it for transformers."""
    transformers = transformers_module()
    save_published("llama3_2", tmp_path / "hf")
    write_hf(tmp_path / "hf", config={"bos_token": "<s>", "eos_token": "</s>"})
    data = tmp_path / "data"
    prepare_data(data, default_corpus_files(max_bytes=100_000), tmp_path / "hf", progress=False)
    source = f"train.init_from={tmp_path / 'hf'}"
    cfg = recipe("llama3_2", f"data.path={data}", source, f"data.tokenizer={tmp_path / 'hf'}")
    pretrain(cfg, run_dir=tmp_path / "run", steps=1, progress=False)
    out = export_hf(tmp_path / "run/checkpoints/step-1", tmp_path / "out")
    ours = load_tokenizer(tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    return 0\n"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    other = tmp_path / "other"
    write_hf(other, vocab_size=300, config={"bos_token": "<s>", "eos_token": "</s>"})
    mismatched = recipe("llama3_2", f"data.path={data}", f"data.tokenizer={other}")
    with pytest.raises(DataError, match="is not the tokenizer the data"):
        pretrain(mismatched, run_dir=tmp_path / "run2", steps=1, progress=False)


def test_rope_scaling_keys_are_checked():
    with pytest.raises(ConfigError, match="high_freq_factor' must exceed low_freq_factor"):
        recipe("llama3_1", "data.path=x", "model.rope_scaling.high_freq_factor=1.0")
    with pytest.raises(ConfigError, match="model.rope_scaling.factor"):
        recipe("llama3_1", "data.path=x", "model.rope_scaling.factor=0")
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type.*yarn"):
        recipe("llama3_1", "data.path=x", "model.rope_scaling.rope_type=yarn")
