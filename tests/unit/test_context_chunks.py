"""Context parallelism's layout: rank i of a CP group holds chunks i and 2 CP - 1 - i of a
window, gathering every rank's part gives the window back in order (its gradient back to
each part), and each rank's attention over the gathered window is its rows of the whole
window's, without ranks: the group's collectives are played by one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from yatrain.context_parallel.attention import GatheredAttention
from yatrain.context_parallel.group import ContextGroup
from yatrain.models.llama import document_causal_mask


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


@pytest.mark.parametrize(
    ("documents", "lower_right", "mask_elements"),
    [
        (False, False, 2**21),  # one piece per chunk
        (False, False, 3 * 24),  # pieces of 3 rows of a 5-row chunk: 3 + 2, views of one mask
        (False, True, 2**21),  # torch's lower-right causal bias
        (True, False, 2**21),  # documents
    ],
)
def test_each_rank_attends_as_the_whole_window(documents, lower_right, mask_elements):
    """Every rank's output (and the gradients its queries get) is its chunks' rows of plain
    causal attention over the whole window."""
    size, seq = 2, 20  # 4 chunks of 5 tokens
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=gen)
    k, v = torch.randn(2, 2, seq, 8, generator=gen), torch.randn(2, 2, seq, 8, generator=gen)
    ids = torch.randint(0, 3, (2, seq), generator=gen).sort(dim=1).values
    mask = document_causal_mask(ids) if documents else None
    whole_q = q.clone().requires_grad_()
    want = F.scaled_dot_product_attention(
        whole_q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    weights = torch.randn(want.shape, generator=gen)
    (want * weights).sum().backward()
    kv = torch.stack([k, v])
    parts = [ContextGroup(_Comm(r, size)).split(kv, 3) for r in range(size)]  # type: ignore[arg-type]
    for rank in range(size):
        group = _Played(rank, size, parts)
        local_q = group.split(q, 2).requires_grad_()
        attention = GatheredAttention(
            group,
            seq,
            ids if documents else None,
            lower_right=lower_right,
            mask_elements=mask_elements,
        )
        got = attention.attend(local_q, *group.split(kv, 3).unbind(0))
        torch.testing.assert_close(got, group.split(want, 2), atol=1e-6, rtol=0)
        (got * group.split(weights, 2)).sum().backward()
        # fp32 sums in another order: 1.07e-6 apart on gradients of about 1.4 (torch 2.13 CPU)
        grad = group.split(whole_q.grad, 2)
        torch.testing.assert_close(local_q.grad, grad, atol=1e-6, rtol=1e-6)
        if mask_elements < 2**21:
            assert [last - first for first, last, _ in attention.pieces] == [3, 2, 3, 2]
