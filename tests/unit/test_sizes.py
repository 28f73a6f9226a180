"""The engine's buffer sizes, computed from unit sizes alone (yatrain/sharding/sizes.py)."""

from __future__ import annotations

import pytest
import torch

from yatrain.sharding.sizes import (
    MIB,
    engine_buffers,
    equal_pieces,
    padded,
    staging_budget,
)

GIB = 2**30
BF16, FP32 = torch.bfloat16, torch.float32
# Llama 3 70B: a decoder layer (its norms in the norm group) and the embedding / output head.
LAYER_70B, EDGE_70B = 855_638_016, 128_256 * 8192
AUTO_80GB = staging_budget("auto", 80 * GIB)  # 1% of an 80 GiB GPU: 819 MiB
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
    and the head hand over their gradients as the tensors autograd made. The fp32 staging
    under ``auto`` on 80 GiB (819 MiB): the edges in 5 equal pieces, the layers in 4."""
    b = llama(LAYER_70B, EDGE_70B, 80, 8192, 256, staging_bytes=AUTO_80GB)
    assert not b.edge_owns_gather
    assert (b.gather.count, b.gather.numel, b.gather.dtype) == (2, EDGE_70B, BF16)
    assert (b.grad.count, b.grad.numel, b.grad.dtype) == (2, LAYER_70B, BF16)
    assert b.pieces == (5,) + (4,) * 80 + (5,) and max(b.pieces) <= 8
    assert b.staging.dtype == FP32 and b.staging.bytes <= AUTO_80GB
    assert b.piece_numel == -(-LAYER_70B // 256 // 4)  # a layer's quarter is the widest
    assert b.staging.numel == 256 * b.piece_numel and b.reduce_out.numel == b.piece_numel
    norms = padded(161 * 8192, 256)
    assert b.small_gather.numel == b.small_grad.numel == norms
    assert b.small_out.count == 0  # fp32 reduce: the norm gradient lands in its shard
    want = 2 * 2 * (EDGE_70B + LAYER_70B) + 4 * 257 * b.piece_numel
    assert b.total_bytes() == want + 2 * 2 * norms
    assert b.total_bytes() / GIB == pytest.approx(7.90, abs=0.01)
    assert b.total_bytes() <= 8 * GIB


def test_the_staging_budget_trades_pieces_for_memory_at_llama3_70b():
    """By hand: one piece a unit needs 11.0 GiB of buffers, five 7.9 GiB,
    eight 7.6 GiB (a budget that fits 1/n of the embedding's gradient in fp32)."""
    for n, gib in ((1, 11.0), (5, 7.9), (8, 7.6)):
        budget = -(-EDGE_70B // 256 // n) * 256 * 4
        b = llama(LAYER_70B, EDGE_70B, 80, 8192, 256, staging_bytes=budget)
        assert b.pieces[0] == n and max(b.pieces) == n
        assert b.total_bytes() / GIB == pytest.approx(gib, abs=0.05)


def test_auto_staging_is_256_mib_or_one_percent_of_the_device():
    assert staging_budget("auto", None) == 256 * MIB  # nothing known: the floor
    assert staging_budget("auto", 16 * GIB) == 256 * MIB  # 1% would be 164 MiB
    assert staging_budget("auto", 141 * GIB) == int(0.01 * 141 * GIB)  # an H200
    assert staging_budget(None, 24 * GIB) == 256 * MIB
    assert staging_budget(64, 141 * GIB) == 64 * MIB  # a number is the budget
    assert staging_budget(0.5, None) == MIB // 2


def test_equal_pieces_are_the_fewest_that_fit():
    assert equal_pieces(100, 100) == (1, 100)
    assert equal_pieces(100, 99) == (2, 50)
    assert equal_pieces(101, 50) == (3, 34)
    assert equal_pieces(7, 1) == (7, 1)


def test_the_gpu_benchmark_model_reduces_each_unit_at_once():
    """The GPU benchmark's 0.886B model (dim 2048, 16 layers, vocab 32000; bench_gpu.sh):
    one reduce-scatter a unit under ``auto`` at world 1 and 8, in about 250 MiB of fp32."""
    dim, ffn, vocab = 2048, 5632, 32_000
    layer = 4 * dim * dim + 3 * dim * ffn
    for world in (1, 8):
        b = llama(layer, vocab * dim, 16, dim, world, staging_bytes=AUTO_80GB)
        assert set(b.pieces) == {1}
        assert b.staging.bytes / MIB == pytest.approx(250, abs=2)


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


def test_pieces_never_exceed_the_largest_shard_nor_the_staging_budget():
    tiny = llama(1000, 3000, 2, 10, 2)
    assert tiny.piece_numel == 1500 and tiny.staging.numel == 3000  # one piece per unit
    assert tiny.pieces == (1, 1, 1, 1)
    huge_world = llama(LAYER_70B, EDGE_70B, 80, 8192, 4096)  # the 256 MiB floor
    assert huge_world.staging.bytes <= 256 * MIB
    assert huge_world.pieces[0] == -(-EDGE_70B * 4 // (256 * MIB))


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
