"""Launcher variables (``WORLD_SIZE``, ``RANK``, ...) left in the environment of a command
that no launcher started, or not numbers, are one line saying what to unset, before any
process group is made: not torch's rendezvous traceback, an ``int()`` traceback, or
``generate`` blaming a torchrun that was never used."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from yatrain.cli import main as cli_main
from yatrain.errors import ConfigError
from yatrain.inference.generate_text import generate_text
from yatrain.runtime.launch import Launch, launch
from yatrain.runtime.process import init_runtime, launched_world_size

LAUNCHED_BY = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture()
def no_launcher(monkeypatch):
    for name in (*LAUNCHED_BY, *VARIABLES):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env,needles",
    [
        ({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "no launcher", "unset WORLD_SIZE"]),
        ({"WORLD_SIZE": "4", "RANK": "1"}, ["WORLD_SIZE=4, RANK=1", "unset WORLD_SIZE RANK"]),
        ({"RANK": "3"}, ["RANK=3", "unset RANK"]),
        ({"LOCAL_RANK": "1"}, ["LOCAL_RANK=1", "unset LOCAL_RANK"]),
        ({"WORLD_SIZE": "abc"}, ["WORLD_SIZE='abc'", "not a whole number", "unset WORLD_SIZE"]),
        ({"WORLD_SIZE": "9" * 40}, ["WORLD_SIZE='99999", "not a whole number"]),
        ({"LOCAL_WORLD_SIZE": "x"}, ["LOCAL_WORLD_SIZE='x'", "not a whole number"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0", "at least 1"]),
    ],
)
def test_launcher_variables_left_without_a_launcher_are_one_line(no_launcher, env, needles):
    for name, value in env.items():
        no_launcher.setenv(name, value)
    for call in (init_runtime, launched_world_size):
        with pytest.raises(ConfigError) as refused:
            call()
        message = str(refused.value)
        assert all(n in message for n in needles), message
        assert "\n" not in message and len(message) < 400
    assert not dist.is_initialized()


def test_a_rank_beyond_the_world_is_one_line_under_a_launcher(no_launcher):
    """MASTER_ADDR/MASTER_PORT name a rendezvous (srun with the variables set by hand)."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2"}.items():
        no_launcher.setenv(name, value)
    no_launcher.setenv("RANK", "2")
    with pytest.raises(ConfigError, match=r"RANK=2 is not below WORLD_SIZE=2"):
        init_runtime(2.0)  # torch's rendezvous would give up (with a traceback) after 2 s
    assert not dist.is_initialized()


def test_a_world_of_one_left_in_the_environment_is_harmless(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "1")
    no_launcher.setenv("RANK", "0")
    assert launched_world_size() == 1
    runtime = init_runtime()
    assert (runtime.rank, runtime.world_size, runtime.distributed) == (0, 1, False)


def test_generate_does_not_blame_a_torchrun_that_was_not_used(no_launcher, tmp_path):
    no_launcher.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as refused:
        generate_text(str(tmp_path / "step-1"), "def ")
    assert "unset WORLD_SIZE" in str(refused.value)
    assert "without torchrun" not in str(refused.value)


@pytest.mark.parametrize("torchrun", [False, True], ids=["stale LOCAL_RANK", "under torchrun"])
def test_only_a_real_launch_stops_the_launcher_starting_ranks(no_launcher, monkeypatch, torchrun):
    """``--nproc-per-node`` refuses to start ranks from inside torchrun, but a ``LOCAL_RANK``
    an earlier job left in the shell is no launch: it goes on to its own checks (here a
    refused ``--max-restarts``)."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(ConfigError) as error:
        launch(Launch(nproc_per_node=2, max_restarts=-1), ["pretrain", "recipes/tiny.yaml"])
    wanted = "starts the ranks itself" if torchrun else "--max-restarts -1"
    assert wanted in str(error.value)


def test_an_error_names_a_rank_only_under_a_launcher(no_launcher, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for launched_here in (False, True):
        if launched_here:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        monkeypatch.setattr(sys, "argv", ["yatrain", "pretrain", "no-such-recipe.yaml"])
        with pytest.raises(SystemExit):
            cli_main()
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("yatrain: error (rank 2):" if launched_here else "yatrain: error:")
