"""``yatrain plan`` refuses what ``pretrain`` would and names only fixes that work: a GPU
count the global batch cannot be split over, context-parallel sizes its own next check would
refuse, a runtime allowance that fills the GPU, and flags that are not finite positive
numbers. In-process (the CLI runner), on the planner's arithmetic: nothing is allocated."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from typer._click.exceptions import UsageError  # what yatrain.cli.main prints in one line
from typer.testing import CliRunner

from yatrain.cli import app
from yatrain.errors import ConfigError
from yatrain.plan.layout import check_planned_layout
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import job_layout

TINY = ROOT / "recipes/tiny.yaml"
LONG = ROOT / "recipes/llama3_1_8b.yaml"


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def refusal(*args: str) -> str:
    """The one line ``plan`` refuses with (a ConfigError the CLI prints as one line)."""
    result = plan(*args)
    assert result.exit_code != 0 and isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert "\n" not in message and "fits" not in result.output
    return message


def test_a_gpu_count_the_global_batch_cannot_be_split_over_is_refused_as_pretrain_would():
    """tiny: 16 sequences a step in micro-batches of 8 cannot be cut over 3 GPUs. The plan
    said "fits" and pretrain then refused the layout."""
    with pytest.raises(ConfigError):  # the independent expectation: a run's layout
        job_layout(load_recipe(TINY, []), 3, 3)
    message = refusal(str(TINY), "--gpus", "3", "--gpu-memory", "4")
    assert "'data.global_batch_size' (16)" in message and "--gpus 3" in message
    assert "--gpus 1 or 2" in message and "a multiple of 24" in message
    for gpus in ("1", "2"):  # the counts it names plan
        assert plan(str(TINY), "--gpus", gpus, "--gpu-memory", "4").exit_code == 0


def test_under_context_parallelism_the_batch_is_split_over_the_data_ranks():
    """4 GPUs in CP pairs are 2 data ranks: tiny's 2 micro-batches split; 6 GPUs are 3."""
    cp = ["--context-parallel", "2", "--gpu-memory", "4"]
    assert plan(str(TINY), "--gpus", "4", *cp).exit_code == 0
    message = refusal(str(TINY), "--gpus", "6", *cp)
    assert "data ranks" in message and "--gpus 2 or 4" in message


def cp_sizes_named(message: str) -> list[int]:
    named = re.search(r"--context-parallel (?:one of )?([\d, or]+)", message)
    assert named, message
    return [int(n) for n in re.findall(r"\d+", named.group(1))]


@pytest.mark.parametrize(
    "layout",
    [["--gpus", "3"], ["--gpus", "6", "--shard-group-size", "3"]],
    ids=["over the world", "over a shard group"],
)
def test_the_context_parallel_sizes_named_pass_the_next_check(layout):
    """131,072 tokens over CP 2 on 3 GPUs: "pass --context-parallel one of 1, 3", and CP 3
    was then refused (131,072 is not a multiple of 2 x 3). Every size named must plan."""
    seq = ["--set", "data.seq_len=131072", "--set", "data.global_batch_size=6"]
    message = refusal(str(LONG), *layout, "--context-parallel", "2", *seq)
    sizes = cp_sizes_named(message)
    assert sizes == [1], message
    gpus = int(layout[1])
    for cp in sizes:
        sets = ["data.seq_len=131072", "data.global_batch_size=6"]
        sets += [f"sharding.context_parallel={cp}"]
        if len(layout) > 2:
            sets.append(f"sharding.shard_group_size={layout[3]}")
        check_planned_layout(load_recipe(LONG, sets), gpus, "--shard-group-size N")


def test_sizes_that_cut_the_sequence_are_still_named():
    """4,096 tokens over CP 4 on 6 GPUs: of the sizes that divide 6, 2 cuts 4,096 into
    2 x CP equal chunks; 3 and 6 do not."""
    seq = ["--set", "data.seq_len=4096", "--set", "data.global_batch_size=6"]
    message = refusal(str(LONG), "--gpus", "6", "--context-parallel", "4", *seq)
    assert cp_sizes_named(message) == [1, 2], message


def test_a_runtime_allowance_that_fills_the_gpu_is_named_not_the_micro_batch():
    """1 GiB GPUs with 5 GiB kept for the runtime: no micro-batch or sequence helps."""
    result = plan(str(TINY), "--gpus", "1", "--gpu-memory", "1", "--runtime-allowance", "5")
    assert result.exit_code == 0, result.output
    answer = next(line for line in result.output.splitlines() if line.startswith("answer:"))
    assert "--runtime-allowance" in answer and "5.00 GiB" in answer
    assert "micro_batch_size" not in answer and "seq_len" not in answer


def flag_error(*args: str) -> str:
    """The message of a flag's refusal: ``yatrain.cli.main`` prints it as one line, exit 2."""
    with pytest.raises(UsageError) as refused:
        app(["plan", str(TINY), "--gpus", "1", *args], standalone_mode=False)
    return refused.value.format_message()


@pytest.mark.parametrize("flag", ["--gpu-memory", "--runtime-allowance"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_a_memory_flag_that_is_not_a_finite_number_says_so(flag, value):
    """--gpu-memory nan was "Input should be less than or equal to 1048576"."""
    message = flag_error(flag, value)
    assert f"'{flag}'" in message and "a finite number" in message, message
    assert "1048576" in message  # the bound, for the value too large


@pytest.mark.parametrize(("flag", "value"), [("--gpu-memory", "0"), ("--gpu-memory", "-1")])
def test_a_gpu_memory_that_is_not_positive_is_refused(flag, value):
    assert "a finite number of GiB above 0" in flag_error(flag, value)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "1e300"])
def test_sweep_plan_only_refuses_a_gpu_memory_in_the_same_line_as_plan(value):
    """sweep --plan-only --gpu-memory nan was typer's "less than or equal to 1048576"."""
    sweep = ["sweep", str(TINY), "--seq-len", "64", "--plan-only", "--gpu-memory", value]
    with pytest.raises(UsageError) as refused:
        app(sweep, standalone_mode=False)
    message = refused.value.format_message()
    shown = str(float(value))  # how the flag's float is written back: 0.0, 1e+300
    expected = f"{shown}: it must be a finite number of GiB above 0, from 0.001 to 1048576"
    assert message.endswith(expected) and "\n" not in message, message
    assert message == flag_error("--gpu-memory", value)


def test_no_runtime_allowance_is_a_valid_plan():
    """0 GiB kept for the runtime: a CPU's fit check plans so (the recipe's comment)."""
    result = plan(str(TINY), "--gpus", "1", "--gpu-memory", "4", "--runtime-allowance", "0")
    assert result.exit_code == 0 and ": fits" in result.output, result.output
