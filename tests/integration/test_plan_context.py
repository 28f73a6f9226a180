"""The planner under context parallelism: its figures for Llama 3.1 8B at long sequences
(docs/long_context.md's targets), the smallest CP it names, and its prediction against the
live-tensor peak of real CP steps (2 fork-started gloo ranks sharing each window)."""

from __future__ import annotations

import pytest
import torch
from conftest import PLANNER_TOLERANCE, ROOT
from distributed import run_ranks
from test_context_parallel import documents
from test_plan import SMALL, planned
from typer.testing import CliRunner

from yatrain.cli import app
from yatrain.common import DTYPES, GIB
from yatrain.context_parallel.group import ContextGroup
from yatrain.context_parallel.split import ContextParallel
from yatrain.data.batch import MicroBatch
from yatrain.models.llama import build_model
from yatrain.plan import LiveTensorTracker, plan_for_layers, plan_memory
from yatrain.plan.fit import fit_advice, longest_masked_window
from yatrain.recipe.load import load_recipe, recipe_from_dict
from yatrain.sharding import ShardedEngine
from yatrain.train.optim import build_optimizer
from yatrain.train.step import train_step


def long_recipe(seq: int, cp: int, name: str = "llama3_1_8b"):
    """One sequence per data rank on 8 GPUs."""
    return load_recipe(
        ROOT / "recipes" / f"{name}.yaml",
        [
            f"data.seq_len={seq}",
            f"model.max_seq_len={max(seq, 131_072)}",
            "data.micro_batch_size=1",
            "data.global_batch_size=8",
            f"sharding.context_parallel={cp}",
        ],
    )


def test_llama3_1_8b_at_131072_tokens_fits_8_gpus_with_context_parallelism():
    """8 x 80 GiB: 131,072 tokens do not fit one rank's window even with every layer
    checkpointed; the planner names the smallest CP that does, and CP 8 fits."""
    whole = plan_memory(long_recipe(131_072, 1), 8, 80 * GIB)
    assert whole.fits is False and whole.activation_checkpoint_layers == 32
    smallest = whole.min_context_parallel
    assert smallest is not None
    cp, k = smallest["context_parallel"], smallest["activation_checkpoint_layers"]
    assert plan_for_layers(long_recipe(131_072, cp), 8, k, 80 * GIB).fits
    assert not plan_for_layers(long_recipe(131_072, cp), 8, k - 1, 80 * GIB).fits
    for smaller in range(2, cp):
        assert not plan_for_layers(long_recipe(131_072, smaller), 8, 32, 80 * GIB).fits
    cp8 = plan_memory(long_recipe(131_072, 8), 8, 80 * GIB)
    assert cp8.fits and cp8.context_parallel == 8
    assert 12 <= cp8.activation_checkpoint_layers <= 20  # "about 15 of 32"


def test_context_parallelism_needs_fewer_checkpointed_layers():
    """At 65,536 tokens CP 2 checkpoints fewer layers than one rank per window (29)."""
    chosen = [
        plan_memory(long_recipe(65_536, cp), 8, 80 * GIB).activation_checkpoint_layers
        for cp in (1, 2, 4, 8)
    ]
    assert chosen[0] == 29
    assert chosen == sorted(chosen, reverse=True) and chosen[1] < chosen[0]


def test_dense_document_mask_is_counted():
    """The document mask is dense: [B, 1, T, T] booleans on one rank (16 GiB at 131,072
    tokens, and 32 GiB more in the one layer recomputed at a time), each rank's chunks'
    additive masks under CP (about 2 GiB at CP 8, bf16, shared by every layer)."""
    whole = plan_for_layers(long_recipe(131_072, 1), 8, 32, 80 * GIB)
    masked = long_recipe(131_072, 1)
    masked.data.document_mask = True
    plan = plan_for_layers(masked, 8, 32, 80 * GIB)
    assert plan.breakdown["attention_masks"] == 131_072**2 == 16 * GIB
    # and each layer that keeps its activations keeps SDPA's additive copy (bf16)
    assert plan.full_layer_bytes == whole.full_layer_bytes + 2 * 131_072**2
    assert plan.peak_bytes_per_gpu >= whole.peak_bytes_per_gpu + 48 * GIB
    cp8 = long_recipe(131_072, 8)
    cp8.data.document_mask = True
    width = 131_072 // 16
    mask = plan_for_layers(cp8, 8, 32, 80 * GIB).breakdown["attention_masks"]
    assert mask == width * width * 17 * 2 and 2 * GIB < mask < 2.2 * GIB


# ----------------------------------------------------------------------------- measured


def small_cp_recipe(dtype: str, layers: int, seq: int, masked: bool, cp: int = 2):
    return recipe_from_dict(
        {
            "model": {**SMALL, "max_seq_len": seq},
            "data": {
                "path": "unused",
                "seq_len": seq,
                "micro_batch_size": 2,
                "global_batch_size": 2,
                "document_mask": masked,
            },
            "train": {"steps": 3, "dtype": dtype},
            "optim": {"lr": 1e-3},
            "sharding": {"activation_checkpoint_layers": layers, "context_parallel": cp},
        }
    )


def _measure(rank, world, rec):
    """Resident bytes before a forward and the peak above them on the second step, with
    the CP group of both ranks sharing each window."""
    m, micro, seq = rec.model, rec.data.micro_batch_size, rec.data.seq_len
    tokens = torch.randint(0, m.vocab_size, (2, micro, seq + 1), generator=torch.Generator())
    inputs_of = documents if rec.data.document_mask else None
    with LiveTensorTracker() as mem:
        cp = rec.sharding.context_parallel
        context = ContextParallel(ContextGroup.build(cp, "cpu")) if cp > 1 else None
        model = build_model(m, rec.sharding.activation_checkpoint_layers)
        engine = ShardedEngine.from_model(
            model,
            device="cpu",
            param_dtype=DTYPES[rec.train.dtype],
            reduce_dtype=DTYPES[rec.sharding.reduce_dtype],
        )
        optimizer = build_optimizer(engine.param_groups(0.1), rec.optim)
        for step in tokens:
            inputs, targets = step[:, :-1].contiguous(), step[:, 1:].contiguous()
            resident = mem.current
            mem.reset_peak()
            extra = inputs_of(inputs) if inputs_of is not None else {}
            batch = MicroBatch(inputs, targets, extra)
            train_step(model, engine, optimizer, [batch], grad_clip=1.0, context=context)
    return resident, mem.peak - resident


@pytest.fixture(scope="module", autouse=True)
def _warm_tracker():
    with LiveTensorTracker():
        torch.zeros(1) + 1


@pytest.mark.parametrize(
    ("dtype", "layers", "seq", "masked", "cp"),
    [
        ("fp32", 0, 256, False, 2),
        ("bf16", SMALL["n_layers"], 512, True, 2),
        ("bf16", 1, 512, True, 1),  # the dense mask of one rank per window
    ],
)
def test_planner_matches_measured_memory_under_context_parallelism(dtype, layers, seq, masked, cp):
    """CP 2 on 2 ranks: the step's peak above the resident state (activations at seq / 2,
    the gathered keys and values, the masks) and the whole peak within PLANNER_TOLERANCE;
    and the document mask of a whole window on one rank (each full layer keeps its own
    additive copy: 20% of the peak missing when it was not counted)."""
    rec = small_cp_recipe(dtype, layers, seq, masked, cp)
    resident, step_peak = run_ranks(cp, _measure, rec)[0]
    planned_resident, planned_step, planned_total = planned(rec, cp, layers)
    masks = plan_for_layers(rec, cp, layers, None, 0).breakdown.get("attention_masks", 0)
    assert planned_resident - masks == pytest.approx(resident, rel=PLANNER_TOLERANCE)
    assert planned_step + masks == pytest.approx(step_peak, rel=PLANNER_TOLERANCE)
    assert planned_total == pytest.approx(resident + step_peak, rel=PLANNER_TOLERANCE)


def test_fit_check_names_context_parallelism_and_the_document_masks_longest_window():
    """The fit check's fix, by the planner: a window too long for one rank gets the
    smallest CP and its layers; a dense document mask that alone breaks the fit gets its
    size and the longest window it fits (and the run fits there with it)."""
    advice = fit_advice(long_recipe(131_072, 1), 8, 80 * GIB, None)
    assert advice == (
        "set sharding.context_parallel=2 and sharding.activation_checkpoint_layers=30"
    )
    masked = long_recipe(106_496, 1)
    masked.data.document_mask = True
    assert not plan_memory(masked, 8, 80 * GIB).fits
    longest = longest_masked_window(masked, 8, 80 * GIB, None)
    assert longest is not None and longest < 106_496
    advice = fit_advice(masked, 8, 80 * GIB, None)
    assert advice.startswith(
        f"data.document_mask builds a dense mask of 10.56 GiB per micro-batch at 106496 "
        f"tokens and fits at most {longest} tokens here"
    )
    assert "sharding.context_parallel=2" in advice and "\n" not in advice
    masked.data.seq_len = longest
    assert plan_memory(masked, 8, 80 * GIB).fits
    masked.data.seq_len = longest + 128
    assert not plan_memory(masked, 8, 80 * GIB).fits


def test_plan_command_takes_a_context_parallel_size():
    args = [
        "plan",
        str(ROOT / "recipes/llama3_1_8b.yaml"),
        "--gpus",
        "8",
        "--gpu-memory",
        "80",
        *("--set", "data.seq_len=131072", "--set", "data.micro_batch_size=1"),
        *("--set", "data.global_batch_size=8"),
    ]
    whole = CliRunner().invoke(app, args)
    assert whole.exit_code == 0, whole.output
    assert "DOES NOT FIT" in whole.output
    assert "fits with sharding.context_parallel 2 (--context-parallel 2; checkpoint 30" in (
        whole.output
    )
    cut = CliRunner().invoke(app, [*args, "--context-parallel", "8"])
    assert cut.exit_code == 0, cut.output
    assert "context parallel 8 (16384 tokens of each window a GPU)" in cut.output
    assert "checkpoint the first 18 of 32 layers" in cut.output
    assert "of it context parallelism's K/V" in cut.output


def test_gpu_count_named_under_context_parallelism_is_whole_cp_groups():
    """Llama 3 70B at 131,072 tokens, CP 8 on 8 GPUs: the count that fits is a multiple of
    8 (a world CP does not divide was an error before)."""
    plan = plan_memory(long_recipe(131_072, 8, "llama3_70b"), 8, 80 * GIB)
    assert plan.fits is False and plan.min_gpus is not None and plan.min_gpus % 8 == 0
    assert plan_for_layers(long_recipe(131_072, 8, "llama3_70b"), plan.min_gpus, 80, 80 * GIB).fits
