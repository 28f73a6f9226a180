"""Held-out data for evaluation: which token streams, and the windows each rank reads.

An evaluation reads the first ``W`` windows of ``seq_len + 1`` tokens of a held-out stream,
in order and unshuffled (window ``j`` starts at token ``j * seq_len``, as in training), where
``W`` is the number asked for or every window of a shorter stream. The windows are dealt to
the ranks in contiguous slices of whole micro-batches, and every rank runs the same number
of micro-batches: slots past ``W`` are padding windows whose targets are ignored. So
micro-batch ``k`` holds windows ``[k m, (k + 1) m)`` at any world size, and no rank waits
for another that has run out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from yatrain.common import IGNORE_INDEX
from yatrain.data.batch import MicroBatch
from yatrain.data.documents import document_layout
from yatrain.data.file_index import open_manifest
from yatrain.data.manifest import has_validation
from yatrain.data.megatron import MegatronTokens, megatron_prefix, misspelt_prefix
from yatrain.data.shards import TokenShards
from yatrain.errors import ConfigError, DataError
from yatrain.recipe.config import DataConfig

NO_HELD_OUT_FIX = (
    "prepare the data with `yatrain prepare-data --val-fraction F`, point data.val_path at "
    "held-out data, or turn evaluation off (eval.every: 0, eval.at_end: false)"
)


@dataclass(frozen=True)
class HeldOut:
    """One held-out token stream: a validation split, or a whole directory without one."""

    name: str  # how logs call it (a mixture source's label)
    weight: float  # its share of the overall loss (a mixture's normalised weight)
    shards: TokenShards | MegatronTokens

    def describe(self) -> str:
        part = "validation split" if self.shards.split == "validation" else "whole: no split"
        return f"{self.shards.path} ({part})"


def open_held_out(
    path: Path, name: str = "", weight: float = 1.0, tokenizer: str | None = None
) -> HeldOut:
    """The validation split of the data directory ``path``, or all of it if it has none (a
    Megatron prefix: all of it, read with ``tokenizer``)."""
    if megatron_prefix(path) is not None:
        return HeldOut(name, weight, MegatronTokens.open(path, tokenizer, "data.val_path"))
    if (misspelt := misspelt_prefix(path)) is not None:
        raise misspelt
    split = "validation" if has_validation(open_manifest(path)[0]) else "train"
    return HeldOut(name, weight, TokenShards.open(path, split=split))


def _has_split(path: Path) -> bool:
    """Does ``path`` hold a held-out split (never a Megatron prefix: that format has none)?"""
    return megatron_prefix(path) is None and has_validation(open_manifest(path)[0])


def held_out_data(data: DataConfig, override: Path | None = None) -> list[HeldOut]:
    """What an evaluation reads: ``override`` (``yatrain eval --data``), else
    ``data.val_path``, else the validation split of ``data.path`` or of every mixture source.
    Never the training stream itself: a training directory without a split is refused."""
    if override is not None:
        return [open_held_out(override, tokenizer=data.tokenizer)]
    training = [data.path] if data.sources is None else [s.path for s in data.sources]
    if data.val_path is not None:
        val_path = Path(data.val_path)
        trains_on = any(Path(p).resolve() == val_path.resolve() for p in training)
        if trains_on and not _has_split(val_path):
            raise ConfigError(
                f"data.val_path {val_path} is training data without a held-out split: "
                f"evaluation never reads training data; {NO_HELD_OUT_FIX}"
            )
        return [open_held_out(val_path, tokenizer=data.tokenizer)]
    if data.sources is None:
        return [_split_of(Path(data.path), "data.path")]
    total = sum(s.weight for s in data.sources)
    return [
        HeldOut(s.label, s.weight / total, _split_of(Path(s.path), f"data.sources[{i}]").shards)
        for i, s in enumerate(data.sources)
    ]


def _split_of(path: Path, key: str) -> HeldOut:
    if megatron_prefix(path) is not None:
        raise ConfigError(
            f"{key} {path} is a Megatron-LM dataset, which holds no held-out split: point "
            "data.val_path at a second prefix of held-out documents, or turn evaluation off "
            "(eval.every: 0, eval.at_end: false)"
        )
    if not has_validation(open_manifest(path)[0]):
        raise ConfigError(
            f"{key} {path} has no held-out validation split to evaluate on (prepared with "
            f"--val-fraction 0, before held-out splits, or too small): {NO_HELD_OUT_FIX}"
        )
    return HeldOut("", 1.0, TokenShards.open(path, split="validation"))


def check_same_tokenizer(held: list[HeldOut], sha256: str, bos_id: int, eos_id: int) -> None:
    """Held-out data must be tokenized like the model's training data."""
    for part in held:
        s = part.shards
        if (s.tokenizer_sha256, s.bos_id, s.eos_id) != (sha256, bos_id, eos_id):
            raise DataError(
                f"held-out data {s.path} was prepared with another tokenizer than the model's "
                "training data: prepare it with the same --tokenizer"
            )


# A micro-batch's model inputs from its inputs (document ids, positions).
ModelInputs = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def attention_inputs(data: DataConfig, bos_id: int, eos_id: int) -> ModelInputs | None:
    """The extra model inputs of document masking for a batch of inputs, as in training."""
    if not data.document_mask:
        return None
    return functools.partial(
        document_layout, bos_id=bos_id, eos_id=eos_id, restart_positions=data.restart_positions
    )


class EvalWindows:
    """The windows one evaluation reads from one held-out stream, cut for one rank."""

    def __init__(
        self,
        held: HeldOut,
        seq_len: int,
        requested: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        model_inputs: ModelInputs | None = None,
    ) -> None:
        self.held, self.seq_len, self.micro = held, seq_len, micro_batch_size
        self.model_inputs = model_inputs  # ``attention_inputs``: document ids, positions
        self.available = held.shards.windows(seq_len)
        if self.available == 0:
            raise DataError(
                f"held-out data {held.describe()} has {held.shards.num_tokens:,} tokens, "
                f"fewer than one window of {seq_len}+1: hold out more data (a larger "
                "--val-fraction) or use other held-out data (data.val_path)"
            )
        self.requested = requested
        self.windows = min(requested, self.available)
        group = micro_batch_size * world_size
        self.per_rank = -(-self.windows // group) * micro_batch_size  # slots, padding included
        self.first = rank * self.per_rank

    @property
    def short(self) -> bool:
        """Fewer windows than requested: the whole stream is evaluated."""
        return self.available < self.requested

    @property
    def tokens(self) -> int:
        """Predicted tokens over all ranks (padding excluded)."""
        return self.windows * self.seq_len

    @property
    def micro_batches_per_rank(self) -> int:
        return self.per_rank // self.micro

    def micro_batches(self) -> Iterator[MicroBatch]:
        """This rank's micro-batches of [micro, seq_len] windows, with their model inputs
        (``model_inputs``, as in training); padding targets ignored."""
        span = self.seq_len + 1
        for start in range(self.first, self.first + self.per_rank, self.micro):
            real = max(0, min(self.micro, self.windows - start))
            tokens = np.zeros((self.micro, span), dtype=np.int64)
            if real:
                stream = self.held.shards.read(start * self.seq_len, real * self.seq_len + 1)
                windows = np.lib.stride_tricks.sliding_window_view(stream, span)
                tokens[:real] = windows[:: self.seq_len]
            inputs = torch.from_numpy(tokens[:, :-1].copy())
            targets = torch.from_numpy(tokens[:, 1:].copy())
            targets[real:] = IGNORE_INDEX
            extra = self.model_inputs(inputs) if self.model_inputs is not None else {}
            yield MicroBatch(inputs, targets, extra)
