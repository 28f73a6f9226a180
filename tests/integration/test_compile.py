"""train.compile: compiled decoder layers train like eager ones, with the engine around them.

Inductor costs 20-70 s per graph on this machine, so most tests use the ``aot_eager`` backend
(the same dynamo tracing, guards and autograd graphs, eager kernels): what they check -- the
engine outside the graph, one graph for every layer, no recompiles as buffers rotate, exact
resume -- does not depend on the kernels. One test compiles with inductor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from conftest import FAST, ROOT
from distributed import run_ranks
from engine_reference import CFG, batches, engine_for, max_rel, optimizer_for, train_sharded

from yatrain.errors import ConfigError
from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint
from yatrain.inference.generate_text import generate_text
from yatrain.models.llama import build_model
from yatrain.recipe.load import load_recipe
from yatrain.runtime.compile import check_backend, compile_layers
from yatrain.train import loop
from yatrain.train.loop import pretrain
from yatrain.train.setup import Checks
from yatrain.train.step import train_step

# Relative distance allowed between compiled and eager losses and gradient norms over 20
# steps. aot_eager runs the eager kernels: measured 0.0. Inductor fuses and reorders fp32
# arithmetic: measured over these 20 steps (accumulation, one checkpointed layer, clipping)
# 2.2e-6 (loss) and 5.0e-6 (gradient norm) at world size 1, 1.2e-6 and 2.9e-6 at world size
# 2; test_inductor_matches_eager checks 3 steps to keep CI short.
COMPILE_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path, monkeypatch):
    """Each test starts with no compiled code: graphs compiled by earlier tests (other
    shapes) would otherwise count against dynamo's per-function cache limit. The private
    compile cache (runtime/compile_cache.py) lives under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _train(rank, world, data, micro, clip, ckpt, backend):
    """Losses and norms of the engine's training; and how many graphs dynamo compiled."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses, norms, _ = train_sharded(rank, world, data, micro, clip, ckpt, compile=backend)
    return losses, norms, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("world,micro", [(1, 2), (2, 1)])
def test_compiled_matches_eager_with_accumulation_checkpointing_and_clipping(world, micro):
    """20 steps, 2 micro-batches per rank, the first of 3 layers checkpointed, clipping on:
    the compiled layers give eager's losses and norms, and one graph serves all layers
    (checkpointed or not) on every rank while the gather buffers rotate."""
    data = batches(4, steps=20)
    eager = run_ranks(world, _train, data, micro, 0.5, 1, None)
    compiled = run_ranks(world, _train, data, micro, 0.5, 1, "aot_eager")
    for (e_loss, e_norm, e_graphs), (c_loss, c_norm, c_graphs) in zip(eager, compiled, strict=True):
        assert e_graphs == 0
        assert c_graphs == 1  # the training graph; 3 layers x 20 steps reuse it
        assert max_rel(c_loss, e_loss) < COMPILE_TOLERANCE
        assert max_rel(c_norm, e_norm) < COMPILE_TOLERANCE


def test_inductor_matches_eager():
    """The real backend: generated C++ kernels, fp32, one process, a checkpointed layer."""
    data = batches(4, steps=3)
    e_loss, e_norm, _ = _train(0, 1, data, 2, 0.5, 1, None)
    c_loss, c_norm, graphs = _train(0, 1, data, 2, 0.5, 1, "inductor")
    assert graphs == 1
    assert max_rel(c_loss, e_loss) < COMPILE_TOLERANCE
    assert max_rel(c_norm, e_norm) < COMPILE_TOLERANCE


def _hybrid(rank, world, backend):
    from yatrain.sharding.groups import hybrid_mesh

    mesh = hybrid_mesh("cpu", 2)
    losses, norms, _ = train_sharded(
        rank, world, batches(8, 4), 1, 0.5, 1, compile=backend, mesh=mesh
    )
    return losses, norms


def test_compiled_hybrid_sharding_matches_eager():
    """2 replicas of shard groups of 2: the replicas' all-reduce stays outside the graph."""
    eager = run_ranks(4, _hybrid, None)
    compiled = run_ranks(4, _hybrid, "aot_eager")
    for (e_loss, e_norm), (c_loss, c_norm) in zip(eager, compiled, strict=True):
        assert max_rel(c_loss, e_loss) < COMPILE_TOLERANCE
        assert max_rel(c_norm, e_norm) < COMPILE_TOLERANCE


def test_every_layer_runs_compiled():
    """Each step's forward runs the compiled graph once per decoder layer (a layer left out
    of ``compile_layers`` would run eagerly, unseen by the graph counts)."""
    calls = []

    def counting(graph, example_inputs):
        def run(*args):
            calls.append(1)
            return graph.forward(*args)

        return run

    model = build_model(CFG)
    engine = engine_for(model)
    compile_layers(model.layers, counting)
    opt = optimizer_for(engine.param_groups(0.1))
    for step in batches(2, steps=3):
        before = len(calls)
        train_step(model, engine, opt, [(step[:, :-1], step[:, 1:])], grad_clip=0.0)
        assert len(calls) - before == CFG.n_layers


def test_a_graph_compiled_after_warm_up_is_a_recompile(small_data, tmp_path, monkeypatch):
    """Step 2's micro-batches one token shorter: a new shape, a graph compiled after the
    warm-up, which the summary must count."""
    calls = []

    def shorter_from_step_2(model, engine, optimizer, micro_batches, **kwargs):
        calls.append(1)
        if len(calls) >= 2:
            micro_batches = [(b.inputs[:, :-1], b.targets[:, :-1]) for b in micro_batches]
        return train_step(model, engine, optimizer, micro_batches, **kwargs)

    monkeypatch.setattr(loop, "train_step", shorter_from_step_2)
    summary = pretrain(recipe(small_data), run_dir=tmp_path / "run", steps=3, progress=False)
    assert summary["recompiles"] >= 1
    assert summary["compile_graphs"] == summary["recompiles"] + 1


def test_no_grad_forward_compiles_its_own_graph_once():
    """An evaluation between steps: one more graph (no grad), then nothing new."""
    model = build_model(CFG, 1)
    engine = engine_for(model)
    compile_layers(model.layers, "aot_eager")
    opt = optimizer_for(engine.param_groups(0.1))
    data = batches(2, steps=4)
    graphs = torch._dynamo.utils.counters["stats"]
    start = graphs["unique_graphs"]
    for step in data:
        train_step(model, engine, opt, [(step[:, :-1], step[:, 1:])], grad_clip=0.0)
        with torch.no_grad():
            model(step[:, :-1])
    assert graphs["unique_graphs"] - start == 2


def recipe(data: Path, *extra: str):
    return load_recipe(
        ROOT / "recipes/tiny.yaml",
        [
            *FAST,
            f"data.path={data}",
            "train.compile=true",
            "train.compile_backend=aot_eager",
            *extra,
        ],
    )


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_a_run_compiles_once_and_never_again(small_data, tmp_path, capfd):
    """20 steps with an asynchronous checkpoint save, two evaluations, document masking and
    a profiled step: two graphs (training, evaluation) in warm-up and none after."""
    cfg = recipe(
        small_data,
        "eval.every=10",
        "eval.batches=1",
        "checkpoint.every=10",
        "checkpoint.async=true",
        "data.document_mask=true",
        "train.profile=1",
    )
    graphs = torch._dynamo.utils.counters["stats"]
    start = graphs["unique_graphs"]
    summary = pretrain(cfg, run_dir=tmp_path / "run", steps=20, progress=False)
    assert summary["recompiles"] == 0
    assert summary["compile_graphs"] == 2 == graphs["unique_graphs"] - start
    assert summary["compile_s"] > 0
    err = capfd.readouterr().err
    assert err.count("compiled 1 graph in") == 1  # said once, after the first step
    assert "warning" not in err.lower()
    records = metrics(tmp_path / "run")
    assert records[10]["val_loss"] is not None and records[20]["val_loss"] is not None
    # step 1 compiled, left out of its step time and so out of its breakdown's parts
    first = records[1]
    assert 0 < first["compute_s"] < first["step_time_s"]
    assert abs(first["unattributed_s"]) < 0.05 * first["step_time_s"]
    # yatrain eval and generate run a compiled run's checkpoint eagerly: eval agrees
    checkpoint = tmp_path / "run" / "checkpoints" / "step-20"
    evaluated = evaluate_checkpoint(checkpoint)
    assert evaluated["val_loss"] == pytest.approx(records[20]["val_loss"], rel=1e-6, abs=0)
    assert 1 <= len(generate_text(checkpoint, "def ", max_new_tokens=4)["new_ids"]) <= 4


def test_compiled_resume_is_bitwise_exact(small_data, tmp_path):
    """A compiled run stopped at step 3 and resumed gives the uninterrupted compiled run's
    losses and gradient norms, float for float."""
    cfg = recipe(small_data, "checkpoint.every=3", "data.global_batch_size=8")
    pretrain(cfg, run_dir=tmp_path / "full", steps=6, progress=False)
    pretrain(cfg, run_dir=tmp_path / "half", steps=3, progress=False)
    torch.compiler.reset()  # as a new process would start
    pretrain(cfg, run_dir=tmp_path / "half", steps=6, progress=False)
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "half")
    for step in range(4, 7):
        assert resumed[step]["loss"] == full[step]["loss"]
        assert resumed[step]["grad_norm"] == full[step]["grad_norm"]


def test_tensor_peak_step_runs_eagerly(small_data, tmp_path):
    """The live-tensor tracker (the sweep's --tensor-peak-step) cannot see inside compiled
    code: that step runs eagerly and still counts its tensors."""
    summary = pretrain(
        recipe(small_data),
        run_dir=tmp_path / "run",
        steps=3,
        progress=False,
        checks=Checks(tensor_step=2),
    )
    assert summary["recompiles"] == 0
    assert metrics(tmp_path / "run")[2]["peak_tensor_bytes"] > 0


def test_inductor_without_a_cpp_compiler_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        check_backend("inductor", torch.device("cpu"))
    check_backend("aot_eager", torch.device("cpu"))  # needs no compiler


def test_unknown_backend_is_one_line():
    with pytest.raises(ConfigError, match="train.compile_backend"):
        recipe(Path("data"), "train.compile_backend=tensorrt")


def test_engine_benchmark_runs_compiled_contenders(capsys):
    """bench_engine's yatrain-compile and fsdp2-compile on a tiny shape: same final loss as
    their eager twins, and the compile targets and the blocks' share are reported."""
    from bench.engine.cli import main

    shape = "--dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 128 --vocab 256"
    shape += " --seq-len 32 --dtype fp32 --repeats 1 --steps 1 --warmup 1 --mem-steps 1"
    contenders = "yatrain,yatrain-compile,fsdp2,fsdp2-compile"
    assert main([*shape.split(), "--contenders", contenders, "--compile-backend", "aot_eager"]) == 0
    out = capsys.readouterr().out
    results_table = out.split("planned vs measured")[0]  # the later tables repeat the names
    rows = {
        row.split("|")[1].strip(): row for row in results_table.splitlines() if row.startswith("| ")
    }
    loss = {name: rows[name].split("|")[9].strip() for name in contenders.split(",")}
    assert loss["yatrain-compile"] == loss["yatrain"] == loss["fsdp2-compile"] == loss["fsdp2"]
    assert "compile: yatrain-compile step time <= 0.80x yatrain" in out
    assert "compile: yatrain-compile peak memory <= fsdp2-compile" in out
    assert "decoder blocks (forward + backward, eager, alone):" in out
