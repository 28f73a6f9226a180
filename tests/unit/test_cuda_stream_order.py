"""The engine's CUDA path, run on the CPU against stand-in streams and events.

No CPU test otherwise runs ``CudaStreamCommunicator`` or ``StreamReducer``: they would run
for the first time on a user's GPU. Here the engine is built with them (the communicator is
picked as for a CUDA device, the reducer follows from it) over real gloo collectives, and
``cuda_standin`` attributes every op to the fake stream current at the time and checks the
ordering rule (see there): no stream reads what another wrote, or overwrites or frees what
another still uses, unless an event wait orders the two; every wait names a recorded event.
Two training steps of two micro-batches each, on two ranks, full sharding and hybrid (the
replicas' all-reduce ordered after a reduction on another stream); the losses, gradient
norms and weights must be those of the same run on the normal CPU path.

Removing any one ``wait_event`` of the CUDA path, or letting the reducer release autograd's
gradient before the communication stream's reduction of it is done, makes this test fail
(checked by mutation: scripts/check_stream_mutations.sh).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from engine_reference import CFG, SEED, batches, optimizer_for

from yatrain.models.llama import build_model
from yatrain.recipe.config import OptimConfig
from yatrain.sharding import ShardedEngine
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.groups import hybrid_mesh
from yatrain.sharding.reduce import StreamReducer
from yatrain.testing import cuda_standin
from yatrain.train.optim import run_optimizer
from yatrain.train.step import train_step

STEPS, WORLD = 2, 2
MUON = OptimConfig(lr=3e-3, name="muon")
STAGING = 512 * WORLD * 4  # a small budget: every unit's reduction goes out in several pieces


def _train(
    rank: int, layout: str, dtype: torch.dtype, muon: bool = False
) -> tuple[list[float], list[float], dict]:
    """Two steps of two micro-batches through ``train_step``; losses, norms, final weights.
    ``muon``: Muon's optimizer, whose all-to-alls run on the communication stream too."""
    options = {"mesh": hybrid_mesh("cpu", 1)} if layout == "hybrid" else {}
    model = build_model(CFG, 1)  # the first layer checkpointed: a backward regathers it
    engine = ShardedEngine.from_model(
        model,
        device="cpu",
        seed=SEED,
        param_dtype=dtype,
        staging_bytes=STAGING,
        force_process_group=True,
        **options,
    )
    cuda = isinstance(engine.comm, CudaStreamCommunicator)
    if cuda:  # the exposed-communication clock times with CUDA events too
        engine.comm.clock.cuda = True
        assert isinstance(engine.buffers.reducer, StreamReducer)
        assert layout != "hybrid" or isinstance(engine.replica_comm, CudaStreamCommunicator)
    opt = run_optimizer(engine, model, MUON) if muon else optimizer_for(engine.param_groups(0.1))
    losses, norms = [], []
    for step in batches(4, STEPS):
        mine = step[2 * rank : 2 * rank + 2]  # two micro-batches of one sequence
        micros = [(mine[i : i + 1, :-1], mine[i : i + 1, 1:]) for i in range(2)]
        engine.comm.clock.active = True
        outcome = train_step(model, engine, opt, micros, grad_clip=0.5)
        engine.comm.clock.active = False
        engine.comm.clock.take()
        losses.append(outcome.loss.item())
        norms.append(outcome.grad_norm.item())
    return losses, norms, engine.full_state_dict()


def _both_paths(rank: int, world: int, layout: str, dtype: torch.dtype, muon: bool):
    """The normal CPU path, then the CUDA path on stand-in streams; the stand-in's log."""
    plain = _train(rank, layout, dtype, muon)
    with pytest.MonkeyPatch.context() as patch:
        order = cuda_standin.as_if_cuda(patch)
        with order.recording():
            streamed = _train(rank, layout, dtype, muon)
    return plain, streamed, order.violations, dict(order.counts)


@pytest.mark.parametrize(
    "layout,dtype,muon",
    [
        ("full", torch.float32, False),  # 2 ranks share every unit
        ("hybrid", torch.bfloat16, False),  # 2 replicas of 1 (one-rank groups): the all-reduce
        ("full", torch.float32, True),  # Muon's two all-to-alls a step
    ],
)
def test_cuda_path_orders_every_buffer_access_by_events(layout, dtype, muon):
    for rank, (plain, streamed, violations, counts) in enumerate(
        run_ranks(WORLD, _both_paths, layout, dtype, muon)
    ):
        shown = "\n".join(violations[:8])
        assert not violations, f"rank {rank}: {len(violations)} ordering breaches:\n{shown}"
        # It did run on two streams (three with hybrid), ordered by recorded events, and the
        # frees of tensors another stream read were checked.
        assert counts["wait on compute"] and counts["record on compute"], counts
        assert counts["reduce_scatter_single on comm1"], counts
        assert counts["all_gather_single on comm1"], counts
        assert counts["cross-stream reads"] and counts["cross-stream frees"], counts
        if layout == "hybrid":
            assert counts["all_reduce on comm2"], counts
        if muon:
            assert counts["all_to_all_single on comm1"] == 2 * STEPS, counts
        # The numbers are honest: the same run on the normal CPU path.
        assert streamed[0] == pytest.approx(plain[0], rel=1e-6)
        assert streamed[1] == pytest.approx(plain[1], rel=1e-6)
        for name, weight in plain[2].items():
            torch.testing.assert_close(streamed[2][name], weight, rtol=1e-6, atol=1e-7)
