"""The planner and the sweep against hostile and careless inputs: a recipe that
already runs context parallel, absurd GPU counts and memories, digits ``int`` cannot read,
huge worlds; each answer is a plan or one line, at once."""

from __future__ import annotations

import errno

import pytest
from conftest import FAST, ROOT
from tokenizer_fixtures import write_hf
from typer.testing import CliRunner

from yatrain.checkpoint.hf_export import _remove_stale_exports
from yatrain.checkpoint.manifest import MANIFEST, complete_checkpoints
from yatrain.checkpoint.store import PendingSave, save_failure
from yatrain.cli import app
from yatrain.data import load_tokenizer
from yatrain.errors import ConfigError, DataError
from yatrain.plan.search import context_parallel_sizes
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import context_parallel, divisors, shard_group_size
from yatrain.runtime.launcher_link import LAUNCHER_PID, die_with_launcher
from yatrain.sweep.configs import expand_configs

TINY = ROOT / "recipes/tiny.yaml"


def test_a_recipe_that_runs_context_parallel_can_be_swept():
    """The sweep's probe of the recipe used data.seq_len=1, which CP 2 refuses."""
    sets = [*FAST, "sharding.context_parallel=2"]
    configs = expand_configs(TINY, sets, [32, 64], ["0"], 3, 2, False)
    assert [(c.seq_len, c.context_parallel) for c in configs] == [(32, 2), (64, 2)]


def test_a_reduce_staging_budget_of_bytes_is_refused_in_one_line():
    """1e-9 MiB reduced each gradient a column at a time: step 1 never ended, and plan
    printed millions of reduce-scatters per unit without a word."""
    result = CliRunner().invoke(
        app, ["plan", str(TINY), "--gpus", "8", "--set", "sharding.reduce_staging_mib=1e-9"]
    )
    assert result.exit_code != 0
    assert "'sharding.reduce_staging_mib' (1e-09) is below 1 MiB" in str(result.exception)
    with pytest.raises(ConfigError, match="set it to 1 or more, or auto"):
        load_recipe(TINY, ["sharding.reduce_staging_mib=0.999"])
    assert load_recipe(TINY, ["sharding.reduce_staging_mib=1"]).sharding.reduce_staging_mib == 1


def test_plan_only_sweep_refuses_a_gpu_count_plan_refuses():
    """--gpus 4294967296 spun in context_parallel_sizes (a loop to the GPU count); --gpu-memory
    inf or 1e300 was a traceback. plan and the sweep share one bound."""
    sweep = ["sweep", str(TINY), "--plan-only", "--seq-len", "64", "--output", "unused"]
    for flags in (["--gpus", "4294967296"], ["--gpu-memory", "inf"], ["--gpu-memory", "1e300"]):
        result = CliRunner().invoke(app, [*sweep, *flags])
        assert result.exit_code == 2 and "1048576" in result.output, flags
        plan = CliRunner().invoke(app, ["plan", str(TINY), "--gpus", "8", *flags])
        assert plan.exit_code == 2 and "1048576" in plan.output, flags


def test_context_parallel_sizes_of_a_huge_group_are_found_to_its_square_root():
    recipe = load_recipe(TINY, ["data.seq_len=64", "sharding.context_parallel=2"])
    assert context_parallel_sizes(recipe, 2**40) == [4, 8, 16, 32]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(1) == [1]


def test_a_cp_size_that_does_not_divide_a_huge_world_is_one_short_line():
    """1,023,998,976 ranks (1024 x 999,999 nodes): the line listed every divisor, found by
    a loop to n (54 s); now a few, the closest to the size asked, of those that also cut
    the sequence into 2 x CP chunks (11, 13 and 22 divide the world, not 205,632 / 2)."""
    world = 1024 * 999_999
    seq = 2 * 17 * 2**4 * 3**3 * 7  # 205,632 tokens: shares 2**4 x 3**3 x 7 with the world
    sets = [f"model.max_seq_len={seq}", f"data.seq_len={seq}", "sharding.context_parallel=17"]
    with pytest.raises(ConfigError) as refused:
        context_parallel(load_recipe(TINY, sets), world)
    named = "set it to a divisor of 1023998976 such as 8, 9, 12, 14, 16, 18, 21, 24 (the"
    assert named in str(refused.value)
    short = load_recipe(TINY, ["data.seq_len=238", "sharding.context_parallel=17"])
    with pytest.raises(ConfigError, match=r"set it to one of 1, 7 \(the world"):
        context_parallel(short, world)  # 238 = 2 x 7 x 17: of the world's divisors, 1 and 7
    grouped = load_recipe(TINY, ["sharding.shard_group_size=7"])
    with pytest.raises(ConfigError, match=r"such as 1, 2, 3, 4, 6, 8, 9, 12 \(usually"):
        shard_group_size(grouped, 2**10 * 3**4, 8)


def test_digits_int_cannot_read_are_one_line_not_a_traceback(tmp_path, monkeypatch):
    """'²' passes str.isdigit and int() refuses it: flags, sweep lists, a checkpoint
    directory's step, a stale export's pid and a --bos-token id each raised ValueError."""
    plan_only = ["sweep", str(TINY), "--plan-only", "--output", str(tmp_path / "s")]
    for args, line in [
        ([*plan_only, "--seq-len", "6²"], "--seq-len: '6²' is not a positive whole number"),
        ([*plan_only, "--seq-len", "64", "--context-parallel", "1,²"], "'²' is not a positive"),
        ([*plan_only, "--seq-len", "9" * 5000], "is too large a number"),
        (["plan", str(TINY), "--gpus", "8", "--shard-group-size", "²"], "pass a number of GPUs"),
    ]:
        result = CliRunner().invoke(app, args)
        assert isinstance(result.exception, ConfigError) and line in str(result.exception), args
    with pytest.raises(ConfigError, match="'²' is not 'auto' or a layer count in 0..4"):
        expand_configs(TINY, [], [128], ["²"], 3, 1, False)
    step = tmp_path / "checkpoints" / "step-²"
    step.mkdir(parents=True)
    (step / MANIFEST).write_text("{}")
    assert complete_checkpoints(step.parent) == []
    stale = tmp_path / ".tmp-export-²-abcd"
    stale.mkdir()
    _remove_stale_exports(tmp_path / "export")
    assert stale.is_dir()
    bare = write_hf(tmp_path / "tokenizer")
    tok = load_tokenizer(bare, bos_token="<s>", eos_token="²")  # a token (a byte), not an id
    assert tok.eos_id == tok.token_id("²") is not None
    with pytest.raises(DataError, match="is not a token of"):
        load_tokenizer(bare, bos_token="<s>", eos_token="9" * 5000)
    monkeypatch.setenv(LAUNCHER_PID, "²")  # not a launcher's pid: no launcher to die with
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    die_with_launcher()


def test_out_of_space_advice_at_keep_1_does_not_say_lower_keep(tmp_path):
    """checkpoint.keep cannot go below 1 (the newest stays until the next is whole)."""
    full = OSError(errno.ENOSPC, "No space left on device")
    lines = []
    for keep in (1, 2):
        save = PendingSave(
            tmp_path, 4, tmp_path / ".tmp-step-4", {"unit_numels": [8]}, keep, (), True
        )
        lines.append(save_failure(save, full))
    assert "checkpoint.keep" not in lines[0] and "free space there, then resume" in lines[0]
    assert "free space there (or lower checkpoint.keep), then resume" in lines[1]


def test_plan_only_sweep_refuses_a_shard_group_it_cannot_see():
    """shard_group_size auto is the node's GPUs: the sweep planned full sharding silently."""
    args = ["sweep", str(TINY), "--plan-only", "--gpus", "8", "--seq-len", "128"]
    result = CliRunner().invoke(app, [*args, "--set", "sharding.shard_group_size=auto"])
    assert "pass --set sharding.shard_group_size=N" in str(result.exception)


def test_context_parallel_errors_in_plan_name_plans_flags():
    """They named yatrain pretrain --nproc-per-node, a flag plan does not have."""
    for gpus, cp, words in [
        ("1", "2", "plan for 2 or a multiple (--gpus 2), or pass --context-parallel 1"),
        ("6", "4", "does not divide --gpus 6: pass --context-parallel 1 or 2, or plan"),
    ]:
        result = CliRunner().invoke(
            app, ["plan", str(TINY), "--gpus", gpus, "--context-parallel", cp]
        )
        assert words in str(result.exception) and "pretrain" not in str(result.exception)


def test_a_huge_cp_size_is_never_told_a_length_beyond_the_context():
    """CP 1,000,000 at 131,072 tokens was told to use 2,000,000 tokens (max_seq_len 131,072)."""
    recipe = ROOT / "recipes/llama3_1_8b_long.yaml"
    with pytest.raises(ConfigError) as refused:
        load_recipe(recipe, ["sharding.context_parallel=1000000"])
    assert str(refused.value).endswith(
        "= 2000000 (each rank holds 2 of 2000000 equal chunks of "
        "a window); use e.g. sharding.context_parallel 64"
    )
    with pytest.raises(ConfigError, match=r"use e\.g\. 132$"):  # a length that fits: as before
        load_recipe(TINY, ["sharding.context_parallel=3"])


def test_the_gpu_count_named_takes_the_global_batch():
    """Llama 3 70B on 8 GPUs fits on 21, which cannot split 512 sequences: 32 is named."""
    result = CliRunner().invoke(app, ["plan", str(ROOT / "recipes/llama3_70b.yaml"), "--gpus", "8"])
    assert "needs at least 32 GPUs\n" in result.output
    eight = ["--set", "data.micro_batch_size=1", "--set", "data.global_batch_size=8"]
    long = ["plan", str(ROOT / "recipes/llama3_1_8b.yaml"), "--gpus", "8", "--gpu-memory", "80"]
    result = CliRunner().invoke(app, [*long, "--set", "data.seq_len=131072", *eight])
    assert "needs at least 15 GPUs (and data.global_batch_size a multiple of 15)" in result.output
