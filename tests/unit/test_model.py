"""Llama model: published parameter counts, numerics against a reference, init, checkpointing."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from yatrain.models import (
    Llama,
    RMSNorm,
    build_model,
    count_parameters,
    flops_per_token,
    materialize,
)
from yatrain.recipe.config import ModelConfig
from yatrain.recipe.load import load_recipe

RECIPES = ROOT / "recipes"
PUBLISHED = {  # billions of parameters, from the Llama 2 / Llama 3 papers and model cards
    "llama2_7b": 6.738,
    "llama2_13b": 13.016,
    "llama2_34b": 33.74,
    "llama2_70b": 68.98,
    "llama3_8b": 8.030,
    "llama3_70b": 70.554,
}
SMALL = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    vocab_size=128,
    rope_theta=500000.0,
    norm_eps=1e-5,
    max_seq_len=32,
)


def tiny_cfg() -> ModelConfig:
    return load_recipe(RECIPES / "tiny.yaml").model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    cfg = load_recipe(RECIPES / f"{name}.yaml").model
    model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == count_parameters(cfg)
    assert n / 1e9 == pytest.approx(PUBLISHED[name], rel=0.005)
    assert count_parameters(cfg, include_embedding=False) == n - cfg.vocab_size * cfg.dim


def test_tiny_forward_shapes():
    cfg = tiny_cfg()
    model = materialize(build_model(cfg), "cpu", seed=0)
    assert list(model.buffers()) == []
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # Initial loss is near ln(vocab): the model starts out uncommitted.
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1.0
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_units_and_norms():
    cfg = SMALL
    model = build_model(cfg)
    units = model.units()
    assert units[0] is model.tok_embeddings and units[-1] is model.output
    assert units[1:-1] == list(model.layers)
    norms = model.norm_modules()
    assert len(norms) == 2 * cfg.n_layers + 1 and norms[-1] is model.norm
    assert all(isinstance(n, RMSNorm) for n in norms)
    covered = {id(p) for u in units for p in u.parameters()} | {id(model.norm.weight)}
    assert covered == {id(p) for p in model.parameters()}


# ---------------------------------------------------------------- reference implementation
# Written the way Meta's llama/model.py does it: complex-number RoPE, explicit repeat of the
# key/value heads and an explicit causal mask.


def ref_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32)
    return torch.polar(torch.ones(seq_len, head_dim // 2), torch.outer(t, freqs))


def ref_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


def ref_attention(attn, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    B, T, _ = x.shape
    hd = cfg.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, cfg.n_heads, hd)
    k = (x @ attn.wk.weight.T).view(B, T, cfg.n_kv_heads, hd)
    v = (x @ attn.wv.weight.T).view(B, T, cfg.n_kv_heads, hd)
    freqs_cis = ref_freqs_cis(hd, T, cfg.rope_theta)
    q, k = ref_rope(q, freqs_cis), ref_rope(k, freqs_cis)
    rep = cfg.n_heads // cfg.n_kv_heads
    k = k[:, :, :, None, :].expand(B, T, cfg.n_kv_heads, rep, hd).reshape(B, T, -1, hd)
    v = v[:, :, :, None, :].expand(B, T, cfg.n_kv_heads, rep, hd).reshape(B, T, -1, hd)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    mask = torch.full((T, T), float("-inf")).triu(1)
    probs = torch.softmax(scores + mask, dim=-1)
    y = (probs @ v).transpose(1, 2).reshape(B, T, -1)
    return y @ attn.wo.weight.T


def ref_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    h = model.tok_embeddings.weight[tokens]
    for layer in model.layers:
        h = h + ref_attention(layer.attention, rms(h, layer.attention_norm.weight), cfg)
        ff, x = layer.feed_forward, rms(h, layer.ffn_norm.weight)
        h = h + (F.silu(x @ ff.w1.weight.T) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    return rms(h, model.norm.weight) @ model.output.weight.T


def test_rope_matches_complex_reference():
    from yatrain.models.llama import apply_rope, rope_cos_sin

    x = torch.randn(2, 32, 4, 16)
    cos, sin = rope_cos_sin(16, 32, 10000.0, "cpu")
    torch.testing.assert_close(apply_rope(x, cos, sin), ref_rope(x, ref_freqs_cis(16, 32, 1e4)))


def test_attention_matches_reference():
    torch.manual_seed(0)
    model = materialize(build_model(SMALL), "cpu", seed=1)
    attn = model.layers[0].attention
    x = torch.randn(2, 32, SMALL.dim)
    cos, sin = model.rope(32, x.device)
    torch.testing.assert_close(attn(x, cos, sin), ref_attention(attn, x, SMALL), atol=1e-5, rtol=0)


def test_model_matches_reference():
    model = materialize(build_model(SMALL), "cpu", seed=2)
    with torch.no_grad():  # non-trivial norm weights, so they are exercised too
        for norm in model.norm_modules():
            norm.weight.uniform_(0.5, 1.5)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 24))
    torch.testing.assert_close(model(tokens), ref_forward(model, tokens), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- initialisation


def test_init_is_deterministic():
    a = materialize(build_model(SMALL), "cpu", seed=7).state_dict()
    b = materialize(build_model(SMALL), "cpu", seed=7).state_dict()
    c = materialize(build_model(SMALL), "cpu", seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    # Different units draw from different streams.
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])


def test_unit_at_a_time_init_equals_whole_model():
    whole = materialize(build_model(SMALL), "cpu", seed=3).state_dict()
    model = build_model(SMALL)
    for i, unit in reversed(list(enumerate(model.units()))):  # order must not matter
        unit.to_empty(device="cpu")
        model.init_unit_(i, seed=3)
    for norm in model.norm_modules():
        norm.to_empty(device="cpu")
    model.init_norms_()
    parts = model.state_dict()
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)


def test_init_unit_touches_only_its_unit_and_not_norms():
    model = materialize(build_model(SMALL), "cpu", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)
    model.init_unit_(1, seed=0)  # layer 0
    for name, p in model.named_parameters():
        changed = not bool((p == 5.0).all())
        assert changed == (name.startswith("layers.0.") and "norm" not in name), name


def test_init_scales():
    cfg = ModelConfig(
        dim=256,
        n_layers=8,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=512,
        vocab_size=1024,
        max_seq_len=16,
    )
    m = materialize(build_model(cfg), "cpu", seed=0)
    layer = m.layers[0]
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert layer.attention.wo.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert m.output.weight.std().item() == pytest.approx(cfg.dim**-0.5, rel=0.05)
    assert all(bool((n.weight == 1).all()) for n in m.norm_modules())


# ---------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_gives_identical_loss_and_grads():
    cfg = SMALL
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    results = []
    for n_ckpt in (0, 1, cfg.n_layers):
        model = materialize(build_model(cfg, activation_checkpoint_layers=n_ckpt), "cpu", 4)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    base_loss, base_grads = results[0]
    for loss, grads in results[1:]:
        assert torch.equal(loss, base_loss)
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, atol=0, rtol=0, msg=name)


def test_checkpoint_layers_can_change_after_construction():
    model = materialize(build_model(SMALL), "cpu", seed=0)
    tokens = torch.randint(0, SMALL.vocab_size, (1, 8))
    ref = model(tokens)
    model.activation_checkpoint_layers = SMALL.n_layers
    torch.testing.assert_close(model(tokens), ref, atol=0, rtol=0)


# ---------------------------------------------------------------- FLOPs


def test_flops_per_token_by_hand():
    cfg = SMALL  # dim 64, 2 layers, 4 heads of 16, 2 kv heads, ffn 96, vocab 128
    # per layer: wq 4096 + wk,wv 2*2048 + wo 4096 + ffn 3*6144 + norms 128 = 30848
    # N = 2 * 30848 + final norm 64 + output head 8192 = 69952 (input embedding excluded)
    # attention: 12 * 2 layers * 4 heads * 16 head_dim * 32 tokens = 49152
    assert count_parameters(cfg, include_embedding=False) == 69_952
    assert flops_per_token(cfg, seq_len=32) == 6 * 69_952 + 49_152 == 468_864
