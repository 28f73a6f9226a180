"""The sample order: a keyed bijection of the windows drawn per index (``data/order.py``), the
same global batches at every world size, exact resume, and the legacy order of older
checkpoints. Each property check is also run against broken orders, to show it can fail."""

from collections.abc import Callable

import numpy as np
import pytest
from test_data import _fake_data

from yatrain.data.loader import GlobalBatchLoader
from yatrain.data.mixture import MixtureLoader
from yatrain.data.order import FEISTEL, LEGACY, feistel_shuffle
from yatrain.errors import DataError

Order = Callable[[np.ndarray, int], np.ndarray]


def _feistel(positions: np.ndarray, n: int) -> np.ndarray:
    return feistel_shuffle(positions, n, [7, 0])


BROKEN: dict[str, Order] = {
    "identity": lambda p, n: p.copy(),
    "rotation": lambda p, n: (p + n // 3) % n,
    "no cycle walking": lambda p, n: feistel_shuffle(p, 1 << (n - 1).bit_length(), [7, 0]) % n,
    "strided": lambda p, n: (p * 2) % n,
}


def _is_permutation(order: Order, n: int) -> bool:
    out = order(np.arange(n, dtype=np.int64), n)
    return len(out) == n and np.array_equal(np.bincount(out, minlength=n), np.ones(n, np.int64))


def _scattered(order: Order, n: int) -> bool:
    """Consecutive positions land far apart, as for a uniformly random permutation: the mean
    distance between neighbours' windows is n / 3, and few neighbours are within n / 100."""
    out = order(np.arange(n, dtype=np.int64), n)
    gaps = np.abs(np.diff(out)) / n
    return abs(gaps.mean() - 1 / 3) < 0.02 and (gaps < 0.01).mean() < 0.03


def test_the_order_is_a_permutation_of_every_window_at_a_million_windows():
    assert _is_permutation(_feistel, 10**6)  # checked exhaustively


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 100, 1000, 4097, 65_537, 999_983])
def test_the_order_is_a_permutation_at_sizes_that_are_not_powers_of_two(n):
    assert _is_permutation(_feistel, n)


def test_consecutive_positions_do_not_map_to_neighbouring_windows():
    assert _scattered(_feistel, 100_003)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_checks_reject_a_broken_order(name):
    broken = BROKEN[name]
    assert not (_is_permutation(broken, 1000) and _scattered(broken, 100_003))


def test_orders_differ_by_seed_and_epoch_and_any_index_is_answered_alone():
    n = 10**12  # 15T tokens at seq 8192 is about 1.8e9 windows: far below
    picks = np.array([0, 1, 12345, n - 1], dtype=np.int64)
    first = feistel_shuffle(picks, n, [0, 0])
    assert len(set(first.tolist())) == 4 and first.max() < n
    assert not np.array_equal(first, feistel_shuffle(picks, n, [0, 1]))
    assert not np.array_equal(first, feistel_shuffle(picks, n, [1, 0]))
    alone = [int(feistel_shuffle(np.array([p]), n, [0, 0])[0]) for p in picks.tolist()]
    assert alone == first.tolist()
    with pytest.raises(IndexError):
        feistel_shuffle(np.array([n]), n, [0, 0])


@pytest.fixture
def data(tmp_path):
    return _fake_data(tmp_path / "fake", num_tokens=2_000, shard_tokens=97)


def _loader(data, world: int = 1, rank: int = 0, micro: int = 1) -> GlobalBatchLoader:
    return GlobalBatchLoader(data, seq_len=16, global_batch_size=8, micro_batch_size=micro,
                             rank=rank, world_size=world, seed=3)  # fmt: skip


def _step_tokens(data, world: int, micro: int, steps: int) -> list[np.ndarray]:
    """Each step's global batch as the ranks read it, concatenated in rank order."""
    loaders = [_loader(data, world, rank, micro) for rank in range(world)]
    out = []
    for _ in range(steps):
        inputs = [mb.inputs for loader in loaders for mb in loader.next_batch()]
        out.append(np.concatenate([t.numpy() for t in inputs]))
    return out


def test_global_batches_are_the_same_at_world_sizes_1_2_and_8(data):
    steps = 2 * _loader(data).batches_per_epoch + 1  # into the third epoch
    one = _step_tokens(data, 1, 2, steps)
    for world, micro in [(2, 1), (2, 4), (8, 1)]:
        assert all(
            np.array_equal(a, b)
            for a, b in zip(one, _step_tokens(data, world, micro, steps), strict=True)
        )
    epoch_windows = np.concatenate(
        [_loader(data).global_batch(k) for k in range(_loader(data).batches_per_epoch)]
    )
    assert len(set(epoch_windows.tolist())) == len(epoch_windows)  # each window once an epoch
    per_epoch = _loader(data).batches_per_epoch
    assert not np.array_equal(one[0], one[per_epoch])  # each epoch reshuffled


def test_a_run_resumes_exactly_at_another_world_size(data):
    straight = _loader(data, world=1)
    expected = [straight.next_batch() for _ in range(5)][3:]
    first = [_loader(data, world=2, rank=r) for r in range(2)]
    for _ in range(3):
        for loader in first:
            loader.next_batch()
    state = first[0].state_dict()
    assert state["order"] == FEISTEL
    resumed = [_loader(data, world=8, rank=r) for r in range(8)]
    for loader in resumed:
        loader.load_state_dict(dict(state))
    for want in expected:
        got = np.concatenate(
            [mb.inputs.numpy() for loader in resumed for mb in loader.next_batch()]
        )
        assert np.array_equal(got, np.concatenate([mb.inputs.numpy() for mb in want]))


def test_a_checkpoint_from_before_named_orders_resumes_in_its_own_order(data):
    loader = _loader(data)
    state = {key: value for key, value in loader.state_dict().items() if key != "order"}
    loader.load_state_dict({**state, "step": loader.batches_per_epoch + 1})
    assert loader.state_dict()["order"] == LEGACY
    n, size = loader.num_windows, loader.global_batch_size
    old = np.random.default_rng([3, 1]).permutation(n)[size : 2 * size]  # the old formula
    assert np.array_equal(loader.global_batch(loader.batches_per_epoch + 1), old)


def test_an_unknown_order_is_refused_in_one_line(data):
    loader = _loader(data)
    with pytest.raises(DataError, match="sample order 'zigzag'.*resume with the yatrain"):
        loader.load_state_dict({**loader.state_dict(), "order": "zigzag"})


def _stride_counts(weights: list[float], slots: int) -> list[int]:
    """Stride scheduling by brute force: every pick's due time, sorted (ties: earlier source)."""
    w = np.asarray(weights) / sum(weights)
    due = sorted(((m + 0.5) / wi, i) for i, wi in enumerate(w) for m in range(slots + 1))
    return np.bincount([i for _, i in due[:slots]], minlength=len(w)).tolist()


def test_a_mixtures_counts_follow_the_weights_and_each_source_is_read_in_its_order(tmp_path):
    a = _fake_data(tmp_path / "a", num_tokens=3_000, shard_tokens=500)
    b = _fake_data(tmp_path / "b", num_tokens=9_000, shard_tokens=700)
    mix = MixtureLoader([a, b], [0.25, 0.75], seq_len=16, global_batch_size=12,
                        micro_batch_size=3, world_size=2, seed=5)  # fmt: skip
    first_epoch: list[int] = []
    for step in range(60):
        pairs = mix.global_batch(step)
        counts = np.bincount(pairs[:, 0], minlength=2).tolist()
        before = _stride_counts([0.25, 0.75], 12 * step)
        after = _stride_counts([0.25, 0.75], 12 * (step + 1))
        assert counts == [after[0] - before[0], after[1] - before[1]]
        if step == 0:  # drawn from the source's order, not its first windows
            assert sorted(pairs[pairs[:, 0] == 1, 1].tolist()) != list(range(counts[1]))
        if after[0] <= mix.num_windows[0]:  # steps wholly within source a's first epoch
            first_epoch += pairs[pairs[:, 0] == 0, 1].tolist()
    assert len(first_epoch) > mix.num_windows[0] // 2
    assert len(set(first_epoch)) == len(first_epoch)  # each window at most once an epoch
