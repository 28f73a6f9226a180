"""Document masking (attention never crosses a document boundary), and training runs on
mixtures and masked windows end to end, with exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from distributed import run_ranks

from yatrain.data import document_layout, prepare_data
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.config import ModelConfig
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

BOS, EOS = 1, 2
CFG = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=97, max_seq_len=64
)


def _packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[list[int]]]:
    """One window of documents [bos] text [eos] back to back, the first and last cut short
    as in a real window; also the full documents."""
    gen = torch.Generator().manual_seed(seed)
    docs = [
        [BOS, *torch.randint(3, CFG.vocab_size, (n,), generator=gen).tolist(), EOS] for n in lengths
    ]
    stream = [t for d in docs for t in d]
    return torch.tensor([stream[3:-2]]), docs


def test_document_layout():
    x = torch.tensor([[7, 2, 1, 5, 6, 2, 1, 9], [1, 1, 2, 1, 8, 2, 2, 1]])
    layout = document_layout(x, BOS, EOS, restart_positions=True)
    assert layout["document_ids"].tolist() == [[1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 2, 2, 2, 2, 3]]
    assert layout["positions"].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2, 3, 0]]
    same = torch.tensor([[5, 3, 5, 5, 4, 5]])  # BOS == EOS (GPT-2 style): starts after a pair
    assert document_layout(same, 5, 5)["document_ids"].tolist() == [[1, 1, 1, 2, 2, 2]]
    assert "positions" not in document_layout(x, BOS, EOS)


@pytest.mark.parametrize("restart", [True, False])
def test_masked_window_equals_each_document_alone(restart):
    model = materialize(build_model(CFG, activation_checkpoint_layers=1), "cpu", seed=0)
    x, docs = _packed([9, 14, 1, 20, 6])
    logits = model(x, **document_layout(x, BOS, EOS, restart_positions=restart))
    start = -3  # the window starts 3 tokens into the first document
    for doc in docs:
        span = torch.arange(max(start, 0), min(start + len(doc), x.shape[1]))
        alone_tokens = torch.tensor([doc])[:, span - start]
        offset = 0 if restart else int(span[0])
        positions = torch.arange(offset, offset + len(span))[None]
        alone = model(alone_tokens, positions=positions)
        torch.testing.assert_close(logits[:, span], alone, atol=1e-5, rtol=0)
        start += len(doc)


def test_one_document_masked_equals_plain_causal():
    model = materialize(build_model(CFG), "cpu", seed=1)
    x = torch.randint(3, CFG.vocab_size, (2, 32))
    masked = model(x, document_ids=torch.ones_like(x))
    torch.testing.assert_close(masked, model(x), atol=1e-5, rtol=0)
    masked.sum().backward()  # and it trains


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def two_sources(small_data, tmp_path_factory) -> list[Path]:
    """A second source prepared with the first one's tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    prose = root / "prose.jsonl"
    prose.write_text(
        "".join(
            json.dumps({"text": f"Paragraph {i}: " + "words and more words. " * 40}) + "\n"
            for i in range(60)
        )
    )
    prepare_data(root / "prose", [prose], tokenizer=small_data / "tokenizer.model", progress=False)
    return [small_data, root / "prose"]


def _recipe(sources: list[Path], *extra: str):
    listed = f"[{{path: {sources[0]}, weight: 3}}, {{path: {sources[1]}, weight: 1}}]"
    overrides = [*FAST, "data.path=null", f"data.sources={listed}", "data.global_batch_size=8"]
    overrides += ["data.document_mask=true", "data.restart_positions=true", "checkpoint.every=2"]
    return load_recipe(ROOT / "recipes/tiny.yaml", [*overrides, *extra])


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _train_on_ranks(rank, world, sources, run_dir, steps):
    pretrain(_recipe(sources), run_dir=run_dir, steps=steps, progress=False)
    return rank


def test_mixture_with_document_mask_trains_and_resumes_exactly(two_sources, tmp_path, capfd):
    straight = tmp_path / "straight"
    pretrain(_recipe(two_sources), run_dir=straight, steps=6, progress=False)
    err = capfd.readouterr().err
    assert "data mixture over 6 steps (48 windows): stdlib-small weight 0.750 -> 0.750" in err
    assert "prose weight 0.250 -> 0.250 (12 windows" in err
    stopped = tmp_path / "stopped"
    pretrain(_recipe(two_sources), run_dir=stopped, steps=2, progress=False)
    # Resume on 2 ranks: the global batches, hence the losses, stay those of one process.
    run_ranks(2, _train_on_ranks, two_sources, stopped, 6)
    resumed, reference = _losses(stopped), _losses(straight)
    assert resumed[1] == reference[1] and resumed[2] == reference[2]  # bitwise, one process
    for step in (3, 4, 5, 6):
        assert resumed[step] == pytest.approx(
            reference[step], rel=1e-4
        )  # gloo sums in another order
