"""Context parallelism's layout: rank i of a CP group holds chunks i and 2 CP - 1 - i of a
window, and gathering every rank's part gives the window back in order (its gradient back to
each part), without ranks: the group's collectives are played by one process."""

from __future__ import annotations

import torch

from yatrain.sharding.context import ContextGroup


class _Comm:
    """What ContextGroup reads of a communicator."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size, self.bytes_sent = rank, size, 0


class _Played(ContextGroup):
    """Rank ``rank`` of a group whose other ranks' parts are given: the all-gather stacks
    them, the reduce-scatter keeps this rank's slot of a sum the test supplies."""

    def __init__(self, rank: int, size: int, parts: list[torch.Tensor]) -> None:
        super().__init__(_Comm(rank, size))  # type: ignore[arg-type]
        self.parts = parts

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        assert torch.equal(local, self.parts[self.rank])
        return torch.stack(self.parts)

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rank]


def test_rank_holds_chunk_i_and_its_mirror():
    window = torch.arange(16)[None]  # 8 chunks of 2 at CP 4
    held = [ContextGroup(_Comm(r, 4)).split(window).tolist()[0] for r in range(4)]  # type: ignore[arg-type]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert ContextGroup(_Comm(1, 2)).positions(8, "cpu").tolist() == [2, 3, 4, 5]  # type: ignore[arg-type]


def test_gather_returns_the_window_and_its_gradient_to_each_part():
    size, window = 3, torch.randn(2, 5, 12, 4)  # [.., .., T, ..], 6 chunks of 2
    parts = [ContextGroup(_Comm(r, size)).split(window, 2) for r in range(size)]  # type: ignore[arg-type]
    for rank in range(size):
        local = parts[rank].clone().requires_grad_()
        whole = _Played(rank, size, parts).gather(local, dim=2)
        assert torch.equal(whole, window)
        weights = torch.randn_like(window)
        (whole * weights).sum().backward()
        assert torch.equal(local.grad, ContextGroup(_Comm(rank, size)).split(weights, 2))  # type: ignore[arg-type]
