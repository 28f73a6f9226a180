"""The engine's buffer sizes, computed from unit sizes alone (yatrain/sharding/sizes.py)."""

from __future__ import annotations

import pytest
import torch

from yatrain.sharding.sizes import (
    PIECE_NUMEL,
    STAGING_MAX_NUMEL,
    engine_buffers,
    padded,
)

GIB = 2**30
BF16, FP32 = torch.bfloat16, torch.float32
# Llama 3 70B: a decoder layer and the embedding / output head, in elements.
LAYER_70B, EDGE_70B = 856_424_448, 128_256 * 8192
# Llama 3 8B
LAYER_8B, EDGE_8B = 218_103_808, 128_256 * 4096


def llama(layer: int, edge: int, n_layers: int, dim: int, world: int, **kw):
    units = [edge] + [layer] * n_layers + [edge]
    single = [True] + [False] * n_layers + [True]
    args = dict(world_size=world, param_dtype=BF16, reduce_dtype=FP32, prefetch_depth=1)
    args.update(direct=False)
    args.update(kw)
    return engine_buffers(units, single, (2 * n_layers + 1) * dim, **args)


def test_llama3_70b_on_256_gpus_fits_in_8_gib_of_buffers():
    """Edge units join a rotation of 2 gather buffers sized by the embedding (1.051B
    elements); the 2 gradient buffers are sized by a layer (0.856B) because the embedding
    and the head hand over their gradients as the tensors autograd made; the fp32 staging
    is 2^18 elements per rank, 256 MiB at 256 ranks."""
    b = llama(LAYER_70B, EDGE_70B, 80, 8192, 256)
    assert not b.edge_owns_gather
    assert (b.gather.count, b.gather.numel, b.gather.dtype) == (2, EDGE_70B, BF16)
    assert (b.grad.count, b.grad.numel, b.grad.dtype) == (2, LAYER_70B, BF16)
    assert b.staging.numel == 256 * PIECE_NUMEL and b.staging.dtype == FP32
    assert b.reduce_out.numel == PIECE_NUMEL == b.piece_numel
    norms = padded(161 * 8192, 256)
    assert b.small_gather.numel == b.small_grad.numel == norms
    assert b.small_out.count == 0  # fp32 reduce: the norm gradient lands in its shard
    want = 2 * 2 * (EDGE_70B + LAYER_70B) + 4 * 256 * PIECE_NUMEL + 4 * PIECE_NUMEL
    assert b.total_bytes() == want + 2 * 2 * norms
    assert b.total_bytes() / GIB == pytest.approx(7.36, abs=0.01)
    assert b.total_bytes() <= 8 * GIB


def test_a_large_vocabulary_gets_its_own_edge_buffer_when_that_is_cheaper():
    """Llama 3 8B: embedding 2.4x a layer; 2 layer buffers + 1 edge buffer (961M elements)
    beat a rotation of 2 embedding-sized buffers (1051M)."""
    b = llama(LAYER_8B, EDGE_8B, 32, 4096, 8)
    assert b.edge_owns_gather
    assert (b.gather.count, b.gather.numel) == (2, LAYER_8B)
    assert (b.edge_gather.count, b.edge_gather.numel) == (1, EDGE_8B)
    # Llama 2 7B: the embedding (131M) is smaller than a layer (202M): one rotation.
    small_vocab = llama(202_375_168, 32_000 * 4096, 32, 4096, 64)
    assert not small_vocab.edge_owns_gather and small_vocab.gather.numel == 202_375_168


def test_deeper_prefetch_adds_gather_buffers_only():
    one, two = (
        llama(LAYER_8B, EDGE_8B, 32, 4096, 8),
        llama(LAYER_8B, EDGE_8B, 32, 4096, 8, prefetch_depth=2),
    )
    assert two.gather.count == one.gather.count + 1
    assert two.gradient_bytes() == one.gradient_bytes()


def test_world_size_one_direct_path():
    fp32 = llama(1000, 3000, 2, 10, 1, param_dtype=FP32, direct=True)
    assert fp32.total_bytes() == 0  # views of the shard; gradients land in the fp32 shard
    bf16 = llama(1000, 3000, 2, 10, 1, direct=True)
    assert bf16.gather_bytes() == 0 and bf16.staging.count == 0 and bf16.grad.count == 0
    assert bf16.small_grad.numel == 50  # bf16 norm gradients accumulate before the cast
    with pytest.raises(ValueError, match="world size 1"):
        llama(1000, 3000, 2, 10, 2, direct=True)


def test_a_one_rank_process_group_gets_the_full_buffered_layout():
    b = llama(1000, 3000, 2, 10, 1)
    assert b.gather.count == 2 and b.grad.count == 2 and b.staging.count == 1


def test_pieces_never_exceed_the_largest_shard_nor_the_staging_cap():
    tiny = llama(1000, 3000, 2, 10, 2)
    assert tiny.piece_numel == 1500 and tiny.staging.numel == 3000  # one piece per unit
    huge_world = llama(LAYER_70B, EDGE_70B, 80, 8192, 4096)
    assert huge_world.staging.numel <= STAGING_MAX_NUMEL
    assert huge_world.piece_numel == STAGING_MAX_NUMEL // 4096


def test_dtypes_follow_the_reduce_dtype():
    b = llama(1000, 3000, 2, 10, 2, param_dtype=FP32, reduce_dtype=BF16)
    assert b.grad.dtype == FP32 and b.staging.dtype == BF16 and b.reduce_out.dtype == BF16
    assert b.small_out.count == 1 and b.small_out.dtype == BF16  # added into the fp32 shard


def test_units_with_one_tensor_need_no_gradient_buffer():
    b = engine_buffers(
        [5000, 100, 100, 5000],
        [True, False, False, True],
        30,
        world_size=2,
        param_dtype=BF16,
        reduce_dtype=FP32,
        prefetch_depth=1,
        direct=False,
    )
    assert b.grad.numel == 100
    only_single = engine_buffers(
        [5000, 5000],
        [True, True],
        30,
        world_size=2,
        param_dtype=BF16,
        reduce_dtype=FP32,
        prefetch_depth=1,
        direct=False,
    )
    assert only_single.grad.count == 0 and not only_single.edge_owns_gather


def test_rejects_inconsistent_arguments():
    with pytest.raises(ValueError, match="single_tensor"):
        engine_buffers(
            [1, 2],
            [True],
            1,
            world_size=1,
            param_dtype=FP32,
            reduce_dtype=FP32,
            prefetch_depth=1,
            direct=True,
        )
    with pytest.raises(ValueError, match="prefetch_depth"):
        engine_buffers(
            [1],
            [True],
            1,
            world_size=1,
            param_dtype=FP32,
            reduce_dtype=FP32,
            prefetch_depth=0,
            direct=True,
        )
