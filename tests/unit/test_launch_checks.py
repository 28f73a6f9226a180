"""The launcher's flags are bounded and checked before anything starts, the ranks get the
command without them, and its summary blames the rank that failed first (pure functions;
no ranks, no subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from typer.models import OptionInfo

from yatrain.cli import launch_options
from yatrain.errors import ConfigError
from yatrain.runtime.blame import first_failed, summary
from yatrain.runtime.launch import Launch, check_ranks, worker_args
from yatrain.runtime.rendezvous import Endpoint, parse_endpoint, waiting_line
from yatrain.train.rundir import default_run_dir


@pytest.mark.parametrize(
    "ranks,gpus,cores,oversubscribe,needle",
    [
        (0, 0, 2, False, "start at least 1 rank"),
        (-3, 0, 2, False, "start at least 1 rank"),
        (99999999999999999999, 0, 2, True, "at most 1024 ranks per node"),
        (1000, 0, 2, False, "max(8, 2 x cores) = 8"),
        (9, 0, 2, False, "--oversubscribe"),
        (33, 0, 16, False, "max(8, 2 x cores) = 32"),
        (9, 8, 64, True, "this node sees 8 GPU(s)"),
    ],
)
def test_nproc_per_node_is_bounded(ranks, gpus, cores, oversubscribe, needle):
    with pytest.raises(ConfigError, match=r"^--nproc-per-node") as refused:
        check_ranks(ranks, gpus, cores, oversubscribe)
    assert needle in str(refused.value)


@pytest.mark.parametrize(
    "ranks,gpus,cores,oversubscribe",
    [(8, 0, 2, False), (4, 0, 1, False), (32, 0, 16, False), (1000, 0, 2, True), (8, 8, 2, False)],
)
def test_nproc_per_node_within_the_bound_is_accepted(ranks, gpus, cores, oversubscribe):
    check_ranks(ranks, gpus, cores, oversubscribe)


@pytest.mark.parametrize(
    "flags,needle",
    [
        ({"rdzv_endpoint": "localhost:99999"}, "--rdzv-endpoint 'localhost:99999'"),
        ({"rdzv_endpoint": "localhost:abc"}, "--rdzv-endpoint 'localhost:abc'"),
        ({"rdzv_endpoint": ":"}, "--rdzv-endpoint ':'"),
        ({"rdzv_endpoint": "h" * 100_000 + ":1"}, "(100002 characters)"),
        ({"rdzv_id": "../../escape"}, "--rdzv-id '../../escape'"),
        ({"rdzv_id": "j" * 100_000}, "(100000 characters)"),
        ({"rdzv_id": ""}, "--rdzv-id ''"),
        ({"nnodes": "0"}, "--nnodes 0"),
        ({"nnodes": "3:2"}, "--nnodes 3:2"),
        ({"nnodes": "²"}, "--nnodes ²"),
        ({"nnodes": "2"}, "needs --rdzv-endpoint HOST:PORT"),
        ({"nnodes": "2", "rdzv_endpoint": "h:1"}, "and --rdzv-id"),
        ({"rdzv_timeout_s": 0}, "--rdzv-timeout 0"),
        ({"max_restarts": -1}, "--max-restarts -1"),
    ],
)
def test_rdzv_endpoint_and_id_are_validated(flags, needle):
    with pytest.raises(ConfigError) as refused:
        Launch(2, **flags).check(gpus=0, cores=2)
    assert needle in str(refused.value) and len(str(refused.value)) < 400


def test_valid_endpoints_and_ids_pass():
    assert parse_endpoint("node01:29500") == Endpoint("node01", 29500)
    assert str(parse_endpoint("[::1]:29500")) == "[::1]:29500"
    assert parse_endpoint("node01") == Endpoint("node01", 29400)  # torch's default port
    Launch(8, "2:4", "10.0.0.1:29500", "123456_7", 3, 60).check(gpus=8, cores=2)


def test_waiting_says_for_what_and_how_long():
    assert waiting_line(Endpoint("h", 1), 2, 2, "j", 600) == (
        "yatrain: waiting for 1 more of 2 nodes at h:1 (job j), rendezvous timeout 600 s"
    )
    assert "1 to 3 more of 2 to 4 nodes" in waiting_line(Endpoint("h", 1), 2, 4, "j", 9)


def test_a_torchrun_id_never_makes_a_run_directory_outside_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "../../escape")
    with pytest.raises(ConfigError, match="--rdzv-id '../../escape'"):
        default_run_dir("tiny", tmp_path / "runs")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert default_run_dir("tiny", tmp_path / "runs") == tmp_path / "runs/tiny-job-7"


def test_worker_args_drop_the_launch_flags_and_keep_the_global_ones():
    argv = [
        "--debug",
        "pretrain",
        "r.yaml",
        "--nproc-per-node",
        "4",
        "--nnodes=2",
        "--rdzv-endpoint",
        "h:1",
        "--rdzv-id=j",
        "--max-restarts",
        "3",
        "--steps",
        "5",
    ]
    assert worker_args(argv) == ["--debug", "pretrain", "r.yaml", "--steps", "5"]


def test_worker_args_drop_oversubscribe_and_the_rendezvous_timeout():
    argv = ["pretrain", "r.yaml", "--oversubscribe", "--rdzv-timeout", "5", "--rdzv-timeout=6"]
    assert worker_args([*argv, "--steps", "5"]) == ["pretrain", "r.yaml", "--steps", "5"]


def _failure(tmp_path: Path, pid: int, exitcode: int, error: dict | None = None) -> ProcessFailure:
    """A rank torch saw end: ``exitcode`` (negative: killed by that signal), and the error
    file it wrote (none when ``error`` is None)."""
    path = tmp_path / f"error-{pid}.json"
    if error is not None:
        path.write_text(json.dumps({"timestamp": 0, "exitcode": exitcode, **error}))
    return ProcessFailure(local_rank=pid % 10, pid=pid, exitcode=exitcode, error_file=str(path))


LOST = {"message": "lost contact with another rank at step 20 (...)", "follows_another": True}


def test_a_rank_killed_by_a_signal_failed_before_those_that_lost_it(tmp_path):
    """Rank 1 killed with SIGKILL at step 20 was reported as "rank 0 of 2 failed (exit
    code 2)" (rank 0 lost contact with it), with exit code 2 rather than 137."""
    failures = {0: _failure(tmp_path, 100, 2, LOST), 1: _failure(tmp_path, 101, -9)}
    lines, code = summary(failures, 2, tmp_path, stopped=set())
    assert lines[0].startswith("yatrain: error: rank 1 of 2 failed (killed by SIGKILL): ")
    assert "out-of-memory killer" in lines[0] and "To enable traceback" not in lines[0]
    assert lines[1].startswith("yatrain: error: rank(s) 0 stopped after it") and code == 137


def test_ranks_the_launcher_stopped_are_never_blamed_first(tmp_path):
    own = {"message": "tokens-00003.bin is unreadable", "follows_another": False}
    failures = {
        0: _failure(tmp_path, 100, -9),  # stuck, SIGKILLed by the launcher after its grace
        1: _failure(tmp_path, 101, 2, LOST),
        2: _failure(tmp_path, 102, 2, own),
        3: _failure(tmp_path, 103, -15),  # stopped by the launcher
    }
    assert first_failed(failures, stopped={100, 103}) == 2
    lines, code = summary(failures, 4, tmp_path, stopped={100, 103})
    assert lines[0] == "yatrain: error: rank 2 of 4 failed (exit code 2): " + own["message"]
    assert code == 2
    del failures[2]  # only a lost peer, and ranks the launcher stopped: the lost peer first
    assert first_failed(failures, stopped={100, 103}) == 1


def test_a_watchdog_exit_says_what_the_hang_report_says(tmp_path):
    """A rank ended by its watchdog (its peer SIGSTOPped) wrote no error file and the
    summary showed torch's "To enable traceback see"."""
    stuck = {
        "message": "step 3 has made no progress for 2 s (...) (the hang report, RUN/hang/"
        "report.txt, says: rank 1 sent nothing (dead, or cannot run Python)); stopping",
        "follows_another": True,
    }
    failures = {0: _failure(tmp_path, 100, 3, stuck), 1: _failure(tmp_path, 101, -9)}
    lines, code = summary(failures, 2, tmp_path, stopped={101})  # SIGKILLed: it was stopped
    assert lines[0] == f"yatrain: error: rank 0 of 2 failed (exit code 3): {stuck['message']}"
    assert code == 3


@pytest.mark.parametrize(
    "nnodes,complaint",
    [
        ("999999:9999999", "--nnodes 999999:9999999: at most 999,999 nodes"),
        ("9" * 5000, "at most 999,999 nodes"),
        ("0:4", "--nnodes 0:4: a job has at least 1 node"),
        ("3:2", "--nnodes 3:2: MIN (3) exceeds MAX (2)"),
        ("2:x", "--nnodes 2:x: pass a number of nodes, or MIN:MAX"),
    ],
)
def test_nnodes_out_of_range_gets_its_own_complaint(nnodes, complaint):
    """999999:9999999 is MIN:MAX, too many nodes: it was told to pass MIN:MAX."""
    with pytest.raises(ConfigError) as refused:
        Launch(2, nnodes=nnodes).check(gpus=0, cores=2)
    assert complaint in str(refused.value) and len(str(refused.value)) < 200
    assert Launch(2, nnodes="1:999999").nodes == (1, 999_999)


def test_each_launcher_flags_help_is_a_sentence_naming_its_value():
    """``--help`` showed ``<int>`` beside "Start N ranks" and "up to K times": sentences
    about a value the table never named."""
    found = [getattr(launch_options, name) for name in dir(launch_options)]
    options = [option for option in found if isinstance(option, OptionInfo)]
    assert len(options) == 7
    for option in options:
        assert option.help[0].isupper() and option.help.endswith("."), option.help
        if option.default is not False:  # a switch has no value
            words = option.metavar.replace("|", ":").split(":")
            assert all(word in option.help for word in words), (option.metavar, option.help)
