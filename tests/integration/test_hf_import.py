"""Hugging Face weights in: what we can honour is checked against transformers, what we
cannot (rotary scaling, biases) is refused in one line, never loaded wrongly."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT

from yatrain.checkpoint.init_from import init_from_source
from yatrain.errors import ConfigError
from yatrain.models.llama import build_model
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine


def transformers_module():
    if os.environ.get("YATRAIN_TEST_REQUIRE_HF"):  # scripts/test.sh: CI must not skip this
        import transformers

        return transformers
    return pytest.importorskip("transformers", reason="pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def cfg():
    return load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, "data.path=unused"])


def save_hf_model(cfg, folder: Path, **extra) -> object:
    """A randomly initialised transformers Llama of the recipe's shape, saved as safetensors."""
    transformers = transformers_module()
    m = cfg.model
    config = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        max_position_embeddings=m.max_seq_len,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def our_logits(cfg, source: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model)
    init = init_from_source(source, cfg.model, model)
    weights = ShardedEngine.from_model(model, device="cpu", init=init).full_state_dict()
    ours = build_model(cfg.model).to_empty(device="cpu")
    ours.load_state_dict(weights)
    with torch.no_grad():
        return ours.eval()(tokens)


def test_tied_embeddings_stay_tied(cfg, tmp_path):
    """Llama 3.2 1B/3B tie the output head to the embedding: one weight, read once; a
    recipe that unties it is refused rather than silently given a copy."""
    theirs = save_hf_model(cfg, tmp_path / "tied", tie_word_embeddings=True)
    with open(tmp_path / "tied/config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is True
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want = theirs(tokens).logits
    tied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True))
    assert torch.allclose(our_logits(tied, tmp_path / "tied", tokens), want, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="model.tie_embeddings False vs True"):
        init_from_source(tmp_path / "tied", cfg.model, build_model(cfg.model))


# Meta's spelling: rope_scaling and a top-level rope_theta, no rope_parameters (which
# transformers writes, and which must not contradict rope_scaling)
META_SPELLING = {"rope_parameters": None, "rope_theta": 500000.0}


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {
                **META_SPELLING,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            'model.rope_scaling null vs {"factor": 8.0',
        ),
        (
            {**META_SPELLING, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_type llama3 without low_freq_factor, high_freq_factor, original_max_position",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}},
            "rotary scaling rope_type 'yarn' (yatrain reads only llama3",
        ),
        (
            {**META_SPELLING, "rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_type 'linear'",
        ),
        (
            {"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "linear"}},
            "rope_scaling (default) and rope_parameters (linear) contradict each other",
        ),
        ({"attention_bias": True}, "bias terms"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_theta": 10000.0, "rope_parameters": None}, "model.rope_theta 500000.0 vs 10000.0"),
        ({"hidden_size": "64"}, "hidden_size is '64', not a whole number"),
    ],
)
def test_configs_we_cannot_honour_are_refused(cfg, tmp_path, change, message):
    save_hf_model(cfg, tmp_path / "hf")
    path = tmp_path / "hf/config.json"
    config = {**json.loads(path.read_text()), **change}
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        init_from_source(tmp_path / "hf", cfg.model, build_model(cfg.model))
    assert "\n" not in str(error.value)


def test_weight_files_outside_the_directory_are_refused(cfg, tmp_path):
    save_hf_model(cfg, tmp_path / "hf")
    (tmp_path / "hf/model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}
    (tmp_path / "hf/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ConfigError,
        match=re.escape("its index names '../elsewhere.safetensors', which is not a file name"),
    ):
        init_from_source(tmp_path / "hf", cfg.model, build_model(cfg.model))
