"""``train.init_from`` a Hugging Face directory: each rank reads only its own slice of each
tensor (plus the norms), and builds exactly the shards a one-rank load builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from safetensors import safe_open
from test_continue import save_published

from yatrain.checkpoint.init_from import init_from_source
from yatrain.models.llama import build_model
from yatrain.sharding import ShardedEngine


def _load(rank: int, world: int, cfg, source: Path):
    """This rank's engine from ``source``: its gathered weights and the bytes it read."""
    model = build_model(cfg.model)
    init = init_from_source(source, cfg.model, model)
    group = torch.distributed.group.WORLD if world > 1 else None
    engine = ShardedEngine.from_model(model, device="cpu", init=init, group=group)
    return engine.full_state_dict(), init.report.__self__.bytes_read


def _sizes(folder: Path) -> tuple[int, int]:
    """Bytes of the tensors on disk: all of them, and the 1-D ones (norms)."""
    total = norms = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                tensor = f.get_slice(key)
                size = torch.Size(tensor.get_shape()).numel() * 2  # bf16
                total += size
                norms += size if len(tensor.get_shape()) == 1 else 0
    return total, norms


@pytest.mark.parametrize("kind", ["llama3_1", "llama3_2"])
def test_each_rank_reads_its_share_and_builds_the_same_model(kind, tmp_path):
    cfg, model = save_published(kind, tmp_path / "hf", dtype=torch.bfloat16)
    total, norms = _sizes(tmp_path / "hf")
    want, read_alone = _load(0, 1, cfg, tmp_path / "hf")
    assert read_alone == total  # one rank keeps everything
    for world in (2, 4):
        results = run_ranks(world, _load, cfg, tmp_path / "hf")
        for weights, read in results:
            assert weights.keys() == want.keys()
            assert all(torch.equal(weights[k], want[k]) for k in want)
            share = (total - norms) / world + norms
            assert read <= 1.2 * share, (world, read, share)
