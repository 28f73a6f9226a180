"""Weighted data mixtures: proportions, world-size independence, exact resume, epochs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from yatrain.data import MixtureLoader, TokenShards, build_loader
from yatrain.data.mixture import mixture_counts
from yatrain.errors import ConfigError, DataError
from yatrain.recipe.load import load_recipe


def _fake(path: Path, first_token: int, num_tokens: int, tokenizer: bytes = b"tok") -> TokenShards:
    """A data dir whose token i is first_token + i: a window's source shows in its values."""
    path.mkdir(parents=True)
    (path / "tokenizer.model").write_bytes(tokenizer)
    data = (first_token + np.arange(num_tokens, dtype="<u2")).tobytes()
    (path / "tokens-00000.bin").write_bytes(data)
    manifest = {
        "format": "yatrain-tokens-v1",
        "dtype": "uint16",
        "tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest(),
        "vocab_size": 65536,
        "bos_id": 1,
        "eos_id": 2,
        "num_documents": 1,
        "num_tokens": num_tokens,
        "files": [
            {
                "name": "tokens-00000.bin",
                "num_tokens": num_tokens,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ],
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return TokenShards.open(path)


SEQ = 8


@pytest.fixture
def sources(tmp_path) -> list[TokenShards]:
    # 40, 15 and 100 windows of 8+1 tokens; values 0.., 20000.., 40000.. name the source
    return [
        _fake(tmp_path / "a", 0, 40 * SEQ + 1),
        _fake(tmp_path / "b", 20_000, 15 * SEQ + 1),
        _fake(tmp_path / "c", 40_000, 100 * SEQ + 1),
    ]


def _source_of(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0] // 20_000


def test_counts_follow_weights_within_one_window():
    for weights in ([0.7, 0.3], [1, 1, 1], [0.5, 0.3, 0.15, 0.05], [0.999, 0.001]):
        w = np.asarray(weights, dtype=float) / sum(weights)
        previous = np.zeros(len(w), dtype=np.int64)
        for n in range(0, 3000, 7):
            counts = mixture_counts(w, n)
            assert counts.sum() == n and (counts >= previous).all(), "monotone, exact total"
            assert np.abs(counts - n * w).max() <= 1.0
            previous = counts
    assert mixture_counts(np.array([0.25, 0.75]), 10**9).tolist() == [250_000_000, 750_000_000]


def test_each_global_batch_gets_its_share(sources):
    weights = [0.5, 0.2, 0.3]
    loader = MixtureLoader(sources, weights, SEQ, global_batch_size=20, micro_batch_size=20)
    shares = []
    for _ in range(30):
        ((x, _y, _extra),) = loader.next_batch()
        per_source = torch.bincount(_source_of(x), minlength=3).numpy()
        assert (np.abs(per_source - 20 * np.array(weights)) <= 1).all()
        shares.append(per_source)
    total = np.sum(shares, axis=0)
    assert total.tolist() == [300, 120, 180]  # 600 windows at 0.5 / 0.2 / 0.3, exactly
    assert "a weight 0.500 -> 0.500 (300 windows, 7.5 epochs)" in loader.describe(30)
    # The windows of a source are whole windows of that source, in seq_len steps.
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(20, SEQ - 1, dtype=x.dtype))
    assert ((x[:, 0] % 20_000) % SEQ == 0).all()


def _step_inputs(sources, weights, step, world, micro) -> torch.Tensor:
    parts = []
    for rank in range(world):
        loader = MixtureLoader(sources, weights, SEQ, 12, micro, rank, world, seed=5)
        loader.load_state_dict({**loader.state_dict(), "step": step})
        parts += [batch.inputs for batch in loader.next_batch()]
    return torch.cat(parts)


def test_global_batch_independent_of_world_size(sources):
    weights = [3.0, 1.0, 2.0]  # normalised to shares
    for step in (0, 1, 7, 30):  # 30: every source is past its first epoch
        expected = _step_inputs(sources, weights, step, world=1, micro=12)
        for world, micro in ((2, 2), (3, 1), (4, 3), (6, 2)):
            assert torch.equal(_step_inputs(sources, weights, step, world, micro), expected)


def test_resume_is_exact_and_checked(sources):
    weights = [0.6, 0.1, 0.3]
    straight = MixtureLoader(sources, weights, SEQ, 12, 4, seed=2)
    reference = [torch.cat([batch.inputs for batch in straight.next_batch()]) for _ in range(25)]
    first = MixtureLoader(sources, weights, SEQ, 12, 4, seed=2)
    for _ in range(9):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = MixtureLoader(sources, weights, SEQ, 12, 6, rank=1, world_size=2, seed=2)
    resumed.load_state_dict(state)
    for step in range(9, 25):
        assert torch.equal(resumed.next_batch()[0][0], reference[step][6:12])
    other = MixtureLoader(sources, [0.5, 0.2, 0.3], SEQ, 12, 4, seed=2)
    with pytest.raises(DataError, match="checkpoint data loader has mixture=.*same data.sources"):
        other.load_state_dict(state)


def test_exhausted_source_reshuffles_and_says_so_once(sources):
    said: list[str] = []
    loader = MixtureLoader(sources, [0.2, 0.6, 0.2], SEQ, 10, 10, seed=1, notice=said.append)
    steps = []
    for _ in range(10):  # source b (15 windows) gets 6 per step: 4 epochs in 10 steps
        ((x, _y, _extra),) = loader.next_batch()
        steps.append(x[_source_of(x) == 1, 0].tolist())
    assert said == [
        f"data source {sources[1].path} used all its 15 windows at step 3: "
        "continuing with epoch 2 (reshuffled)"
    ]
    counts = {}
    for windows in steps:
        for w in windows:
            counts[w] = counts.get(w, 0) + 1
    assert len(counts) == 15 and set(counts.values()) == {4}, "4 full epochs, no repeats"
    # Steps 1-2 take the first 12 of epoch 1's order, steps 6-7 the first 12 of epoch 3's.
    first, third = set(steps[0] + steps[1]), set(steps[5] + steps[6])
    assert len(first) == 12 and first != third


def test_sources_must_share_a_tokenizer(tmp_path):
    a = _fake(tmp_path / "a", 0, 100)
    b = _fake(tmp_path / "b", 0, 100, tokenizer=b"another")
    with pytest.raises(DataError, match="prepared with different tokenizers"):
        MixtureLoader([a, b], [1, 1], SEQ, 4, 4)


def test_recipe_sources_build_a_mixture(sources, tmp_path):
    pairs = zip(sources, [2, 1, 1], strict=True)
    listed = "[" + ", ".join(f"{{path: {s.path}, weight: {w}}}" for s, w in pairs) + "]"
    base = ["data.path=null", f"data.sources={listed}", "data.seq_len=8"]
    base += ["data.global_batch_size=8", "data.micro_batch_size=2"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", base)
    assert [s.weight for s in recipe.data.sources] == [2.0, 1.0, 1.0]
    loader = build_loader(recipe.data, seed=0, rank=1, world_size=2)
    assert isinstance(loader, MixtureLoader) and loader.accumulation_steps == 2
    with pytest.raises(ConfigError, match="'data.path' and 'data.sources' are both set"):
        load_recipe(ROOT / "recipes/tiny.yaml", base[1:])
    bad = f"data.sources=[{{path: {sources[0].path}, weight: 0}}]"
    with pytest.raises(ConfigError, match=r"'data.sources\[0\].weight' must be positive"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["data.path=null", bad])
    twice = "data.sources=[{path: a, weight: 1}, {path: ./a, weight: 2}]"
    with pytest.raises(ConfigError, match=r"'data.sources\[1\].path' repeats data.sources\[0\]"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["data.path=null", twice])
    with pytest.raises(ConfigError, match="needs 'data.document_mask: true'"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["data.restart_positions=true"])


def test_every_rank_of_a_step_gets_windows_of_every_source(sources):
    """Two sources at equal weights, a step of 8 windows over 4 ranks of 2: in source
    order, ranks 0-1 would only ever see a and ranks 2-3 only c. Shuffled together, a
    rank's 2 windows are of both sources with probability 4 x 4 / (8 choose 2) = 4/7."""
    two = [sources[0], sources[2]]  # token values 0.. and 40000..: source 0 and 2
    ranks = [MixtureLoader(two, [1, 1], SEQ, 8, 2, rank, 4, seed=3) for rank in range(4)]
    mixed, seen = 0, [set() for _ in ranks]
    steps = 20
    for _ in range(steps):
        for rank, loader in enumerate(ranks):
            ((x, _y, _extra),) = loader.next_batch()
            found = set(_source_of(x).tolist())
            assert found <= {0, 2}
            seen[rank] |= found
            mixed += len(found) == 2
    assert all(s == {0, 2} for s in seen), seen
    assert mixed >= steps * 4 // 3, mixed  # expected 4/7 of the 80 rank-steps
