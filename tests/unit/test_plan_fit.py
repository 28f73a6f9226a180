"""A run's start against the memory it has: what ``auto`` resolves to over the run's shard
group, the fit check's refusal (against the GPU, or a CPU's RAM shared by its ranks), and
the fewest GPUs the refusal names. In-process, on the planner's arithmetic: no model is
built, nothing is allocated."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT

from yatrain.common import GIB
from yatrain.errors import ConfigError
from yatrain.plan import budget as budget_module
from yatrain.plan.budget import MemoryBudget, memory_budget
from yatrain.plan.fit import start_plan
from yatrain.plan.memory import plan_for_layers
from yatrain.plan.search import min_gpus_to_fit, plan_memory
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import job_layout

CPU = torch.device("cpu")


def recipe(name: str, *overrides: str):
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


def gpu_budget(gib: int) -> MemoryBudget:
    """What ``memory_budget`` resolves on a GPU of ``gib``: the fit check compares with the
    memory ``auto`` planned against, with the planner's runtime allowance."""
    limit, source = gib * GIB, "sharding.gpu_memory_gib"
    return MemoryBudget(limit, source, limit, source, None, limit)


def test_auto_plans_over_the_runs_shard_group_not_the_world():
    """Llama 3 8B on 8 nodes x 8 GPUs of 40 GiB, sharded within each node (``auto``: the
    node's 8 ranks, known only at launch): each rank holds 1/8 of the state, not 1/64, so
    auto needs 23 layers; the 14 it would take sharded over the world peak at 52 GiB here."""
    r = recipe(
        "llama3_8b",
        "sharding.activation_checkpoint_layers=auto",
        "sharding.shard_group_size=auto",
    )
    layout = job_layout(r, 64, 8)
    assert (layout.world_size, layout.shard_group) == (64, 8)
    limit = 40 * GIB

    def fits(k: int, group: int) -> bool:
        return bool(plan_for_layers(r, 64, k, limit, None, shard_group=group).fits)

    smallest = next(k for k in range(r.model.n_layers + 1) if fits(k, 8))
    assert smallest == 23
    over_world = next(k for k in range(r.model.n_layers + 1) if fits(k, 64))
    assert over_world == 14 and not fits(14, 8)

    said: list[str] = []
    assert start_plan(r, layout, gpu_budget(40), True, said.append) == smallest
    assert len(said) == 1 and "auto -> 23 (sharding.gpu_memory_gib)" in said[0]


def test_a_layer_count_that_fits_only_over_the_world_is_refused_over_a_shard_group():
    """The fit check plans over the shard group too: 14 layers peak at 52.12 GiB per GPU
    when each of 8 ranks holds an eighth of the state."""
    r = recipe(
        "llama3_8b", "sharding.activation_checkpoint_layers=14", "sharding.shard_group_size=auto"
    )
    said: list[str] = []
    with pytest.raises(ConfigError) as caught:
        start_plan(r, job_layout(r, 64, 8), gpu_budget(40), True, said.append)
    message = str(caught.value)
    assert message.startswith("this run does not fit: the planner predicts a peak of 52.12 GiB")
    assert "(14 of 32 layers checkpointed, 64 device(s)) and 40.00 GiB is available" in message
    assert "set sharding.activation_checkpoint_layers=23 (or auto)" in message
    assert said == []  # a fixed count: no auto line


def test_the_fit_check_on_a_cpu_compares_with_ram_even_with_gpu_memory_set(monkeypatch):
    """``sharding.gpu_memory_gib`` is what ``auto`` plans against on a CPU; the fit check
    still compares the step's peak with the RAM this rank has. Llama 3 70B resolves auto to
    64 layers against 80 GiB and is refused against 22 GiB of RAM (the 80 GiB plan would
    have let it start and be killed by the kernel)."""
    r = recipe("llama3_70b", "sharding.gpu_memory_gib=80")
    layout = job_layout(r, 256, 1)
    monkeypatch.setattr(budget_module, "available_ram", lambda: 22 * GIB)
    budget = memory_budget(r, CPU, layout)
    assert (budget.limit, budget.have, budget.allowance) == (80 * GIB, 22 * GIB, 0)
    said: list[str] = []
    with pytest.raises(ConfigError) as caught:
        start_plan(r, layout, budget, True, said.append)
    message = str(caught.value)
    assert "this run does not fit" in message and "\n" not in message
    assert "(64 of 80 layers checkpointed, 256 device(s))" in message
    assert "22.00 GiB is available (available RAM)" in message
    assert len(said) == 1 and "auto -> 64 (sharding.gpu_memory_gib)" in said[0]

    monkeypatch.setattr(budget_module, "available_ram", lambda: 200 * GIB)  # enough RAM
    assert start_plan(r, layout, memory_budget(r, CPU, layout), True, said.append) == 64


def test_a_cpu_nodes_ram_is_shared_among_its_ranks(monkeypatch):
    """Each of a node's 4 ranks is checked against a quarter of the available RAM."""
    r = recipe("tiny")
    monkeypatch.setattr(budget_module, "available_ram", lambda: 64 * GIB + 3)
    four = memory_budget(r, CPU, job_layout(r, 4, 4, batch=False))
    assert (four.have, four.have_source) == (16 * GIB, "available RAM / 4 local ranks")
    assert four.allowance == 0 and four.limit is None  # nothing for auto to plan against
    one = memory_budget(r, CPU, job_layout(r, 2, 1))  # one rank on each of two nodes
    assert (one.have, one.have_source) == (64 * GIB + 3, "available RAM")


def test_the_fewest_gpus_named_is_the_smallest_count_that_fits_and_splits_the_batch():
    """Llama 3 70B (512 sequences a step) on GPUs of 60 GiB: the first count that fits all
    layers checkpointed is itself a divisor of 512, and it is the answer."""
    r = recipe("llama3_70b")
    limit, n = 60 * GIB, r.model.n_layers
    slots = r.data.global_batch_size // r.data.micro_batch_size
    fitting = [g for g in range(8, 33) if plan_for_layers(r, g, n, limit, None).fits]
    assert fitting == [32] and slots % 32 == 0  # no count from 8 to 31 fits
    assert min_gpus_to_fit(r, 8, limit, None) == 32
    assert plan_memory(r, 8, limit).min_gpus == 32


def test_auto_that_no_layer_count_fits_the_memory_set_is_refused_on_a_cpu(monkeypatch):
    """``sharding.gpu_memory_gib`` 0.5 on a CPU: auto logged "does not fit even with all
    layers checkpointed" and trained anyway (the fit check compares with RAM, of which there
    was plenty). A GPU of that memory refuses the run; so does a CPU planning for one."""
    r = recipe("tiny", "sharding.activation_checkpoint_layers=auto", "sharding.gpu_memory_gib=0.5")
    layout = job_layout(r, 1, 1)
    assert plan_memory(r, 1, GIB // 2).fits is False  # the independent expectation
    monkeypatch.setattr(budget_module, "available_ram", lambda: 64 * GIB)
    budget = memory_budget(r, CPU, layout)
    said: list[str] = []
    with pytest.raises(ConfigError) as caught:
        start_plan(r, layout, budget, True, said.append)
    message = str(caught.value)
    assert "\n" not in message and "does not fit" in message
    assert "sharding.gpu_memory_gib (0.50 GiB)" in message and "--no-fit-check" in message
    assert start_plan(r, layout, budget, False, said.append) == r.model.n_layers  # unchecked
    gpu = recipe("tiny", "sharding.activation_checkpoint_layers=auto")
    with pytest.raises(ConfigError, match="does not fit"):  # a 0.5 GiB GPU: the same refusal
        start_plan(gpu, layout, half_gib_gpu(), True, said.append)


def half_gib_gpu() -> MemoryBudget:
    limit, source = GIB // 2, "NVIDIA (0.5 GiB)"
    return MemoryBudget(limit, source, limit, source, None, limit)


def cpu_refusal(r, world: int, local: int, ram: int, monkeypatch) -> str:
    monkeypatch.setattr(budget_module, "available_ram", lambda: ram)
    layout = job_layout(r, world, local)
    with pytest.raises(ConfigError) as caught:
        start_plan(r, layout, memory_budget(r, CPU, layout), True, lambda line: None)
    message = str(caught.value)
    assert "\n" not in message and "this run does not fit" in message
    return message


def test_a_cpu_run_is_told_the_micro_batch_that_fits_not_more_devices(monkeypatch):
    """Llama 3.2 1B in micro-batches of 4 on one process with 24 GiB of RAM: the fit check
    said "use at least 2 devices", and a second rank on this machine shares the same RAM."""
    r = recipe("llama3_2_1b", "data.micro_batch_size=4")
    assert plan_memory(r, 1, 24 * GIB, 0).min_gpus == 2  # what a GPU run would be told
    message = cpu_refusal(r, 1, 1, 24 * GIB, monkeypatch)
    assert "devices" not in message and "share" in message
    named = message.split("set data.micro_batch_size=")[1]
    micro, layers = int(named.split()[0]), int(named.split("activation_checkpoint_layers=")[1][:2])
    assert micro == 2, message
    smaller = recipe("llama3_2_1b", f"data.micro_batch_size={micro}")
    assert plan_for_layers(smaller, 1, layers, 24 * GIB, 0).fits  # what it names fits
    assert not plan_for_layers(smaller, 1, layers - 1, 24 * GIB, 0).fits  # and is the fewest


def test_a_cpu_run_whose_state_alone_does_not_fit_is_told_machines_not_devices(monkeypatch):
    """Llama 3 8B on 4 ranks of one machine with 88 GiB: each has 22 GiB and the state
    alone needs more; more ranks here do not help, more machines like it would."""
    r = recipe("llama3_8b", "sharding.activation_checkpoint_layers=32")
    fewest = plan_memory(r, 4, 22 * GIB, 0).min_gpus
    assert fewest is not None
    message = cpu_refusal(r, 4, 4, 88 * GIB, monkeypatch)
    assert "devices" not in message and "share" in message
    assert f"at least {-(-fewest // 4)} machines like this one (4 ranks each)" in message
    assert "micro_batch_size" not in message  # no micro-batch helps
