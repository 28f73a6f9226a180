"""Weights in and out: Hugging Face export (checked against transformers) and init_from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, ROOT
from safetensors.torch import load_file

from yatrain.checkpoint.hf_export import export_hf, iter_checkpoint_weights
from yatrain.checkpoint.init_from import init_from_source
from yatrain.data import TokenShards
from yatrain.errors import ConfigError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.inference.generate_text import generate_text
from yatrain.models.generate import Sampling
from yatrain.models.llama import build_model
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine
from yatrain.train.loop import pretrain


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


def hf_reference_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    """A Llama forward written from the Hugging Face convention, reading an exported
    directory: rotary embedding by rotating the two halves of each head (``rotate_half``),
    applied to q/k as stored in ``q_proj``/``k_proj``. It shares no code with our model, so
    it checks the export's head permutation where transformers is not installed."""
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    w = {}
    for file in sorted(set(index["weight_map"].values())):
        w.update(load_file(directory / file))
    w = {k: v.float() for k, v in w.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, eps = config["head_dim"], config["rms_norm_eps"]
    batch, seq = tokens.shape

    def rms_norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rotate_half(x):
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, head_dim)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, head_dim)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        attention = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        x = x + attention @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_export_matches_a_forward_in_the_hugging_face_convention(trained, tmp_path):
    checkpoint, cfg = trained
    out = export_hf(checkpoint, tmp_path / "hf")
    ours = our_model(dict(iter_checkpoint_weights(checkpoint)), cfg)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = ours(tokens)
        got = hf_reference_logits(out, tokens)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def _transformers():
    if os.environ.get("YATRAIN_TEST_REQUIRE_HF"):  # scripts/test.sh: CI must not skip this
        import transformers

        return transformers
    return pytest.importorskip(
        "transformers", reason="pip install -e '.[hf]' to run the Hugging Face round trip"
    )


def test_transformers_loads_export_with_matching_logits(trained, tmp_path):
    transformers = _transformers()
    checkpoint, cfg = trained
    out = export_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = our_model(dict(iter_checkpoint_weights(checkpoint)), cfg)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = ours(tokens)
        got = theirs(tokens).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_transformers_agrees_on_greedy_generation_and_held_out_loss(trained, tmp_path):
    """``yatrain generate --temperature 0`` and ``yatrain eval`` against transformers on the
    exported checkpoint: the same prompt ids, new tokens and held-out loss."""
    transformers = _transformers()
    checkpoint, cfg = trained
    out = export_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = generate_text(checkpoint, "def main():", max_new_tokens=12, sampling=Sampling(0.0))
    assert tokenizer("def main():")["input_ids"] == ours["prompt_ids"]  # BOS first, as here
    prompt = torch.tensor([ours["prompt_ids"]])
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        generated = theirs.generate(
            prompt, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos
        )
    assert generated[0, prompt.shape[1] :].tolist() == ours["new_ids"]

    held_out = evaluate_checkpoint(checkpoint, batches=2)
    seq, windows = cfg.data.seq_len, held_out["val_windows"]
    shards = TokenShards.open(cfg.data.path, split="validation")
    tokens = torch.from_numpy(shards.read(0, windows * seq + 1)).unfold(0, seq + 1, seq)
    with torch.no_grad():
        logits = theirs(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert held_out["val_tokens"] == tokens[:, 1:].numel() == 2 * 4 * seq
    assert loss.item() == pytest.approx(held_out["val_loss"], rel=1e-5)


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
