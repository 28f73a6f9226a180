"""The training loop's entry to the data: a batch loader for ``data.path`` or ``data.sources``.

It opens and checks what the recipe names (the tokenizer it expects, a mixture's sources)
and returns a loader whose position is part of every checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from yatrain.data.loader import BatchLoader, GlobalBatchLoader
from yatrain.data.megatron import MegatronTokens, open_stream
from yatrain.data.mixture import MixtureLoader
from yatrain.data.shards import TokenShards
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.errors import DataError
from yatrain.recipe.config import DataConfig


def build_loader(
    data: DataConfig,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    notice: Callable[[str], None] | None = None,
) -> BatchLoader:
    """The loader for ``data`` on this rank; ``notice`` receives one-off messages (a mixture
    source starting a new epoch)."""
    paths = [data.path] if data.sources is None else [s.path for s in data.sources]
    keys = (
        ["data.path"] if data.sources is None else [f"data.sources[{i}]" for i in range(len(paths))]
    )
    shards = [open_stream(p, data.tokenizer, k) for p, k in zip(paths, keys, strict=True)]
    if data.tokenizer is not None:
        _check_tokenizer(Path(data.tokenizer), shards)
    common = dict(
        seq_len=data.seq_len,
        global_batch_size=data.global_batch_size,
        micro_batch_size=data.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        document_mask=data.document_mask,
        restart_positions=data.restart_positions,
    )
    if data.sources is None:
        return GlobalBatchLoader(shards[0], **common)
    weights = [s.weight for s in data.sources]
    return MixtureLoader(shards, weights, notice=notice, **common)


def _check_tokenizer(path: Path, shards: list[TokenShards | MegatronTokens]) -> None:
    wanted = load_tokenizer(path)
    for data in shards:
        if (wanted.sha256, wanted.bos_id, wanted.eos_id) != (
            data.tokenizer_sha256,
            data.bos_id,
            data.eos_id,
        ):
            raise DataError(
                f"data.tokenizer {path} is not the tokenizer the data at {data.path} was "
                "prepared with: re-run prepare-data with it, or drop data.tokenizer"
            )
