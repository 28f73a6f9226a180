"""sharding.context_parallel: what a recipe or a launch cannot do is one line naming the key
and the fix (a window not cut into 2 x CP equal chunks, CP not dividing the world or the
shard group, a batch that does not split over the data ranks, CP on one process); and what a
CP rank's step gets: its chunks of the window's positions (restarted at each document with
``data.restart_positions``), and its waits on the K/V gathers timed as exposed communication
(a played group: no process group)."""

from __future__ import annotations

import time

import pytest
import torch
import yaml
from conftest import ROOT

from yatrain.context_parallel.group import ContextGroup
from yatrain.context_parallel.split import ContextParallel
from yatrain.errors import ConfigError
from yatrain.recipe.load import load_recipe, recipe_from_dict
from yatrain.recipe.topology import context_parallel, shard_group_size, validate_world_size
from yatrain.sharding.comm import Communicator, Handle
from yatrain.sharding.timing import IntervalClock

TINY = ROOT / "recipes" / "tiny.yaml"  # seq_len 128, micro 8, global 16


def recipe(*overrides: str):
    return load_recipe(TINY, overrides)


def refusal(call, *args) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_default_is_one_and_every_layout_that_fits_is_accepted():
    assert recipe().sharding.context_parallel == 1
    assert context_parallel(recipe(), 3) == 1
    cp = recipe("sharding.context_parallel=2", "data.global_batch_size=16")
    validate_world_size(cp, 4)  # 2 data ranks x micro 8 = 16
    assert context_parallel(cp, 4) == 2
    hybrid = recipe("sharding.context_parallel=2", "sharding.shard_group_size=2")
    assert shard_group_size(hybrid, 4, 2) == 2


def test_sequence_not_cut_into_2_x_cp_chunks():
    raw = yaml.safe_load(TINY.read_text())
    raw["sharding"]["context_parallel"] = 3  # 128 tokens, 6 chunks
    message = refusal(recipe_from_dict, raw)
    assert (
        "'data.seq_len' (128) is not a multiple of 2 x 'sharding.context_parallel' = 6" in message
    )
    assert "use e.g. 132" in message


def test_cp_not_dividing_the_world():
    message = refusal(validate_world_size, recipe("sharding.context_parallel=4"), 6)
    assert "'sharding.context_parallel' 4 does not divide the world size (6)" in message
    assert "set it to one of 1, 2 (" in message  # 3 and 6 divide 6 but cannot cut 128 tokens


def test_cp_not_dividing_the_shard_group():
    hybrid = recipe("sharding.context_parallel=4", "sharding.shard_group_size=2")
    message = refusal(shard_group_size, hybrid, 8, 2)
    assert "'sharding.context_parallel' 4 does not divide the shard group of 2 ranks" in message
    assert message.endswith("set context_parallel to one of 1, 2")
    whole = recipe("sharding.context_parallel=4")  # the shard group is the world: its line
    assert "does not divide the world size (6)" in refusal(shard_group_size, whole, 6, 6)


def test_cp_sizes_suggested_cut_the_sequence():
    """A CP size c cuts data.seq_len into 2 x c chunks only if 2 x c divides it: the sizes
    suggested were every divisor, 3 among them, which the recipe's own check then refused."""
    sets = ["data.seq_len=131072", "sharding.context_parallel=2"]
    long = load_recipe(ROOT / "recipes/llama3_1_8b.yaml", sets)
    message = refusal(validate_world_size, long, 3)  # 131,072 tokens: 3 cannot cut them
    assert message.startswith("'sharding.context_parallel' 2 does not divide the world size (3)")
    assert "set it to 1 (the world" in message
    hybrid = recipe("sharding.context_parallel=4", "sharding.shard_group_size=6")
    message = refusal(shard_group_size, hybrid, 12, 6)  # 128 tokens: 3 and 6 cannot cut them
    assert message.endswith("set context_parallel to one of 1, 2")


def test_batch_not_split_over_the_data_ranks():
    cp = recipe("sharding.context_parallel=2", "data.global_batch_size=24")
    validate_world_size(cp, 2)  # one data rank: 24 = 3 x 8
    message = refusal(validate_world_size, cp, 4)  # two data ranks: 16 a step
    assert "x data ranks (world size 4 / sharding.context_parallel 2) = 16" in message
    assert "such as 16 or 32" in message


def test_cp_on_one_process():
    forced = recipe("sharding.context_parallel=2", "sharding.force_process_group=true")
    message = refusal(validate_world_size, forced, 1)
    assert "sharding.force_process_group runs one rank" in message
    assert "--nproc-per-node 2" in message


class _Played(Communicator):
    """Rank ``rank`` of a CP group of ``size``: an all-gather is a collective in flight that
    lands ``delay`` seconds into its wait (every rank's part a copy of this one's)."""

    def __init__(self, rank: int, size: int, delay: float = 0.0) -> None:
        super().__init__()
        self.rank, self.world_size, self.delay = rank, size, delay
        self.blocked_on: list[str | None] = []  # what the waits clock said during each wait

    def all_gather(self, out, shard, fill=None) -> Handle:
        out.view(self.world_size, -1).copy_(shard.view(1, -1).expand(self.world_size, -1))
        return Handle(kind="all-gather")

    def _wait(self, handle: Handle) -> None:
        self.blocked_on.append(self.clock.blocked if self.clock is not None else None)
        time.sleep(self.delay)


def test_each_cp_rank_gets_its_chunks_of_the_restarted_positions():
    """With data.restart_positions the loader's positions restart at each document; rank 1
    of 2 holds chunks 1 and 2 of a window of 4 chunks: tokens 2-5, at positions 2, 3, 0, 1
    (documents of 4 tokens), not the window's 2, 3, 4, 5."""
    inputs = torch.arange(16).view(2, 8)
    restarted = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4]])
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])
    extra = {"positions": restarted, "document_ids": ids}
    got = {}
    for rank in range(2):
        cp = ContextParallel(ContextGroup(_Played(rank, 2)))
        local_in, local_targets, local = cp.localize(inputs, inputs + 100, extra)
        got[rank] = local["positions"].tolist()
        assert local_in.tolist() == [
            [x + 8 * row for x in ([0, 1, 6, 7] if rank == 0 else [2, 3, 4, 5])] for row in (0, 1)
        ]
        assert torch.equal(local_targets, local_in + 100)
    assert got == {0: [[0, 1, 2, 3], [0, 1, 3, 4]], 1: [[2, 3, 0, 1], [2, 0, 1, 2]]}
    plain = ContextParallel(ContextGroup(_Played(1, 2)))
    assert plain.localize(inputs, inputs, {})[2]["positions"].tolist() == [[2, 3, 4, 5]] * 2


def test_the_waits_on_k_v_gathers_are_timed_as_exposed_communication():
    """The engine's waits clock, handed to CP, times the attention's K/V all-gather wait
    (booked as exposed communication, not compute) and says what a hang would be blocked
    on while it waits."""
    comm = _Played(0, 2, delay=0.05)
    cp = ContextParallel(ContextGroup(comm))
    clock = IntervalClock(torch.device("cpu"))
    cp.time_waits(clock)
    seq = 8
    tokens = torch.zeros(1, seq, dtype=torch.long)
    _, _, local = cp.localize(tokens, tokens, {})
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    out = local["attention"].attend(q, k, v)
    assert out.shape == q.shape
    assert comm.blocked_on == ["all-gather"] and clock.intervals == 1
    assert clock.take() >= 0.05 and clock.blocked is None
