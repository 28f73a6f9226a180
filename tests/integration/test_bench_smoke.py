"""Every benchmark's entry point runs on a tiny shape and prints what it promises.

A benchmark nobody runs rots: an import moves, a builder changes, and the next person who
needs the numbers finds a traceback. Each one here runs in seconds (a tiny model, one
repeat, two or three steps) through its own ``main(argv)``, in this process, and its output
is checked for the table, the ratio or the verdict it exists to print. Those that need a GPU
are checked to refuse in one line on a machine without one.
"""

from __future__ import annotations

import importlib
import re
import runpy
from pathlib import Path

import pytest
import torch
from bench import (
    breakdown,
    checkpoint,
    compile,
    context,
    document_mask,
    guard,
    host_cost,
    host_profile,
    init_from,
    loop,
    pathcheck,
    seed_table,
    tokenization,
)
from bench.engine import cli as engine
from bench.engine.contenders import CONTENDERS
from conftest import FAST, ROOT

TINY = ROOT / "recipes" / "tiny.yaml"
SETS = [f"--set={override}" for override in FAST]  # the tiny recipe at test size
# The engine benchmark's model flags at test size (pathcheck takes the same).
ENGINE_SHAPE = [
    *("--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2"),
    *("--ffn-dim", "128", "--vocab", "256", "--seq-len", "32", "--dtype", "fp32"),
    *("--steps", "1", "--warmup", "1", "--threads", "1"),
]
# Benchmarks whose smoke run is a test elsewhere (not repeated here: they are slow).
COVERED_ELSEWHERE = {"float8": "tests/integration/test_float8_run.py (the numerics benchmark test)"}


def table_rows(out: str, first: str) -> list[list[str]]:
    """The cells of each Markdown table row of ``out`` whose first cell is ``first``."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    return [row for row in rows if row and row[0] == first]


def ratio(cell: str) -> float:
    """``1.234x`` -> 1.234."""
    return float(cell.removesuffix("x"))


def run_loop(tmp_path: Path, data: Path) -> None:
    args = ["--recipe", str(TINY), "--data", str(data), "--steps", "2", "--repeats", "1", *SETS]
    assert loop.main(args) == 0


def check_loop(out: str) -> None:
    (yatrain,) = table_rows(out, loop.YATRAIN)
    (bare,) = table_rows(out, loop.BARE)
    assert ratio(bare[4]) == 1.0 and ratio(yatrain[4]) > 0
    assert table_rows(out, "yatrain loop step time within 5% of bare (<= 1.05x)")


def run_engine(tmp_path: Path, data: Path) -> None:
    args = ["--world-size", "1", "--contenders", "yatrain,bare", "--repeats", "1"]
    assert engine.main([*args, "--mem-steps", "1", *ENGINE_SHAPE]) == 0


def check_engine(out: str) -> None:
    yatrain, planned = table_rows(out, "yatrain")  # the results table, then the planner's
    (bare,) = table_rows(out, "bare")
    assert bare[-2] == "1.000x" and ratio(yatrain[-2]) > 0  # step time vs bare
    assert table_rows(out, "world 1: yatrain step time <= 1.03x bare")
    # the planner beside the measurement (on a GPU: peak allocated / reserved, device in use)
    assert "planned vs measured memory per rank" in out
    header = next(line for line in out.splitlines() if "planned tensors" in line)
    assert "planned total" in header and "loss planned as" in header
    assert planned[1].startswith("plain (one chunk of")
    assert planned[2].endswith("iB") and planned[3].endswith("iB")


def run_pathcheck(tmp_path: Path, data: Path) -> None:
    assert pathcheck.main(ENGINE_SHAPE) == 0


def check_pathcheck(out: str) -> None:
    steps = table_rows(out, "1") + table_rows(out, "2")
    assert [row[4] for row in steps] == ["yes", "yes"]  # the buffered path = the direct one
    assert [row[5] for row in steps] == ["0.00e+00", "0.00e+00"]
    assert "deterministic kernels" in out and "pathcheck: PASS" in out


def test_pathcheck_without_deterministic_kernels_reports_the_drift(capsys, quiet_process):
    assert pathcheck.main([*ENGINE_SHAPE, "--nondeterministic", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "nondeterministic kernels" in out and "pg ~ direct" in out
    assert not torch.are_deterministic_algorithms_enabled()  # the rank's, not this process's


def run_host_cost(tmp_path: Path, data: Path) -> None:
    assert host_cost.main([*ENGINE_SHAPE, "--dtype", "bf16", "--accum", "2"]) == 0


def check_host_cost(out: str) -> None:
    (scatters,) = table_rows(out, "reduce-scatters per step")
    assert scatters[1:3] == ["9", "6"]  # 2 micro-batches x 4 units + the norms; FSDP2: 3 x 2
    assert "reduce-scatters per micro-batch <= units: 4.0 vs 4: ok" in out
    assert re.search(r"engine ops per step <= FSDP2's: [0-9,.]+ vs [0-9,]+: ok", out)


def run_host_profile(tmp_path: Path, data: Path) -> None:
    assert host_profile.main(ENGINE_SHAPE) == 0


def check_host_profile(out: str) -> None:
    assert re.search(r"host_profile: yatrain-pg .* [0-9.]+ s a step \(profiled\)", out)
    assert "Self CPU" in out and "aten::" in out  # torch.profiler's own table


def run_checkpoint(tmp_path: Path, data: Path) -> None:
    args = [str(TINY), *SETS, "--repeats", "1", "--stall-repeats", "1", "--after", "1"]
    checkpoint.main(args)


def check_checkpoint(out: str) -> None:
    assert re.search(r"checkpoint size: [0-9.]+ MiB \([0-9.]+ bytes/parameter\)", out)
    assert re.search(r"DCP write, median: [0-9.]+ s hashing .* \([0-9.]+x\)", out)
    assert table_rows(out, "sync") and table_rows(out, "async")  # checkpoint_stall's table
    assert re.search(r"async blocks [0-9.]+x as long as sync", out)


def run_guard(tmp_path: Path, data: Path) -> None:
    sets = [*SETS, f"--set=data.path={data}"]
    guard.main(["--recipe", str(TINY), *sets, "--steps", "4", "--log-every", "2", "--repeats", "1"])


def check_guard(out: str) -> None:
    (row,) = table_rows(out, "this tree")
    assert float(row[1]) == 0.0 and float(row[2]) > 0  # no host wait between logs
    assert re.search(r"\| [0-9.]+ ms \|", out)


def run_tokenization(tmp_path: Path, data: Path) -> None:
    args = ["--repeats", "1", "--passes", "1", "--max-bytes", "200000", "--sp-vocab", "512"]
    tokenization.main([*args, "--tiktoken-vocab", "512", "--work-dir", str(tmp_path / "tok")])


def check_tokenization(out: str) -> None:
    assert table_rows(out, "sentencepiece, 2 workers") and table_rows(out, "tiktoken, 1 worker")
    assert re.search(r"tiktoken: 2 workers / 1 worker = [0-9.]+x", out)


def run_document_mask(tmp_path: Path, data: Path) -> None:
    args = ["--recipe", str(TINY), "--data", str(data), "--steps", "2", "--repeats", "1"]
    document_mask.main([*args, *SETS])


def check_document_mask(out: str) -> None:
    assert table_rows(out, "causal (default)")[0][-1] == "1.000x"
    assert ratio(table_rows(out, "document_mask + restart_positions")[0][-1]) > 0


def run_context(tmp_path: Path, data: Path) -> None:
    assert context.main(["--seq-len", "64", *SETS]) == 0


def check_context(out: str) -> None:
    (one,) = table_rows(out, "CP 1")
    (two,) = table_rows(out, "CP 2")
    assert one[3] == "1.000x" and 0 < ratio(two[3]) < 1.5  # live peak vs CP 1
    assert two[11] == "yes"  # K/V bytes: counted = formula = torch.distributed on the CP group


def run_breakdown(tmp_path: Path, data: Path) -> None:
    args = ["--data", str(data), "--steps", "2", "--shapes", "tiny recipe", *SETS]
    assert breakdown.main(args) == 0


def check_breakdown(out: str) -> None:
    (row,) = table_rows(out, "tiny recipe")
    assert float(row[1]) > 0 and row[-2].endswith("%")  # step s, the added code's share
    assert table_rows(out, "unattributed <= 5% (tiny recipe)")


def run_compile(tmp_path: Path, data: Path) -> None:
    # dynamo's eager backend: the same capture and CompileWatch count, no kernel generation
    args = ["--recipe", str(TINY), "--data", str(data), "--steps", "2", "--log-every", "1"]
    args += ["--repeats", "1", "--threads", "1", "--set=train.compile_backend=eager"]
    assert compile.main([*args, *SETS]) == 0


def check_compile(out: str) -> None:
    (row,) = table_rows(out, "fp32")
    assert ratio(row[3]) > 0 and float(row[4]) > 0  # compiled/eager, compile s (cold)


def run_init_from(tmp_path: Path, data: Path) -> None:
    args = ["--dim", "256", "--layers", "2", "--ffn", "256", "--vocab", "512", "--shard-mb", "1"]
    args += ["--worlds", "1", "2"]
    assert init_from.main(args) == 0


def check_init_from(out: str) -> None:
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12]\s+[01]\s", line)]
    assert [(row[0], row[1]) for row in rows] == [("1", "0"), ("2", "0"), ("2", "1")]
    assert all(abs(float(row[4]) - 1) < 0.05 for row in rows)  # each rank reads its share


def run_seed_table(tmp_path: Path, data: Path) -> None:
    seed_table.main([])


def check_seed_table(out: str) -> None:
    rows = [line for line in out.splitlines() if line.startswith("| Llama")]
    assert len(rows) == len(seed_table.SEED_ROWS)


SMOKE = {
    "loop": (run_loop, check_loop),
    "engine": (run_engine, check_engine),
    "pathcheck": (run_pathcheck, check_pathcheck),
    "host_cost": (run_host_cost, check_host_cost),
    "host_profile": (run_host_profile, check_host_profile),
    "checkpoint": (run_checkpoint, check_checkpoint),
    "guard": (run_guard, check_guard),
    "tokenization": (run_tokenization, check_tokenization),
    "document_mask": (run_document_mask, check_document_mask),
    "context": (run_context, check_context),
    "breakdown": (run_breakdown, check_breakdown),
    "compile": (run_compile, check_compile),
    "init_from": (run_init_from, check_init_from),
    "seed_table": (run_seed_table, check_seed_table),
}


@pytest.fixture()
def quiet_process(isolated_env, monkeypatch):
    """What the benchmarks set for their own process, given back afterwards: W&B off (its
    files under tmp_path), and torch's thread count."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(SMOKE))
def test_benchmark_runs_tiny_and_prints_its_result(
    name, small_data, tmp_path, capsys, quiet_process
):
    run, check = SMOKE[name]
    run(tmp_path, small_data)
    check(capsys.readouterr().out)


def test_bench_optimizers_runs_tiny_and_prints_both_tables(capsys, quiet_process):
    """scripts/bench_optimizers.py (a script, not a bench module): both optimizers measured
    side by side at world 2, Muon's counted all-to-all equal to its exchange's own count,
    and the paper part for the tiny recipe where matrices outnumber ranks and where not."""
    import bench_optimizers

    paper = ["--paper", f"{TINY}:2", f"{TINY}:32", "--set", "data.global_batch_size=256"]
    assert bench_optimizers.main([*ENGINE_SHAPE, "--repeats", "1", *paper]) == 0
    out = capsys.readouterr().out
    (adamw,) = table_rows(out, "adamw")
    (muon,) = table_rows(out, "muon")
    assert adamw[3] == "1.000x" and ratio(muon[3]) > 0  # step time vs AdamW's
    assert adamw[-2] == "0 x, 0 B" and muon[-2].startswith("2 x, ")  # Muon's two all-to-alls
    assert re.search(r"counted [0-9,]+, its exchange's bytes_sent [0-9,]+: equal", out)
    traffic_two, compute_two = table_rows(out, "tiny.yaml @ 2")
    _, compute_many = table_rows(out, "tiny.yaml @ 32")
    # shard group and buckets; the decoder's 4 x 7 matrices
    assert traffic_two[1] == "2, 1 bucket(s)" and compute_two[1] == "28"
    assert compute_two[-1] == "PASS" and compute_two[-4] == "1.000x (1.000x)"  # 14 a rank
    assert compute_many[-1].startswith("ranks > matrices: the largest matrix")
    assert compute_many[-4].split()[0] == compute_many[-2]  # its owner has the largest load


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize(
    "entry",
    [engine.main, pathcheck.main, host_profile.main],
    ids=["engine", "pathcheck", "profile"],
)
def test_gpu_benchmarks_refuse_in_one_line_without_a_gpu(entry, capsys):
    assert entry(["--device", "cuda", *ENGINE_SHAPE]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == "no CUDA device: --device cuda needs a GPU"


def test_every_benchmark_has_a_smoke_test():
    """A new benchmark with a ``main`` gets a smoke test here (or names the test that runs
    it), so none can be added untested."""
    found = {
        path.stem if path.parent.name == "bench" else path.parent.name
        for path in (ROOT / "scripts" / "bench").rglob("*.py")
        if "def main(" in path.read_text()
    }
    assert found == set(SMOKE) | set(COVERED_ELSEWHERE)


@pytest.mark.parametrize(
    "script", sorted(path.name for path in (ROOT / "scripts").glob("*.py")), ids=str
)
def test_script_shims_import_their_benchmark(script):
    """``python scripts/bench_*.py`` is the benchmark's ``main``: the shim's import works."""
    names = runpy.run_path(str(ROOT / "scripts" / script), run_name="smoke")
    assert callable(names["main"])


def test_the_gpu_script_runs_the_engine_first_and_names_real_modules():
    """bench_gpu.sh (run only where a GPU is lent, so checked here on paper): its default
    sections each have a handler, the engine's ratios come first, every module it runs
    exists, and every contender it names is one."""
    script = (ROOT / "scripts" / "bench_gpu.sh").read_text()
    defaults = re.search(r'^SECTIONS="([^"]+)"', script, re.M).group(1).split(",")
    assert defaults[0] == "engine" and {"pathcheck", "hostcost", "profile"} <= set(defaults)
    for name in defaults:
        assert f"if wanted {name}; then" in script
    modules = set(re.findall(r"-m (bench\.[a-z_.]+)", script))
    assert {"bench.engine", "bench.pathcheck", "bench.host_cost"} <= modules
    for module in modules:
        importlib.import_module(module)
    for listed in re.findall(r"--contenders ([a-z0-9,-]+)", script):
        assert set(listed.split(",")) <= set(CONTENDERS), listed
