"""The command line answers at once: ``--help``, a mistyped command or a bad flag import no
torch (checked by the modules a real ``python -m yatrain`` holds when it exits, not by time),
while a command that runs still points inductor's cache away first."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

# Runs ``python -m yatrain ARGS`` and, at exit, prints the torch modules it imported.
PROBE = (
    "import atexit, runpy, sys\n"
    "def said():\n"
    "    torch = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
    "    print('TORCH_MODULES', len(torch), file=sys.stderr)\n"
    "atexit.register(said)\n"
    "sys.argv = ['yatrain', *sys.argv[1:]]\n"
    "runpy.run_module('yatrain', run_name='__main__')\n"
)


def run_cli(*args: str, env: dict) -> tuple[int, str, str, int]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    *said, count = result.stderr.rstrip("\n").split("\n")
    assert count.startswith("TORCH_MODULES "), result.stderr
    return result.returncode, result.stdout, "\n".join(said), int(count.split()[1])


COMMANDS = ["prepare-data", "pretrain", "plan", "sweep", "report", "export", "eval", "generate"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_no_torch(command, isolated_env):
    code, out, err, torch_modules = run_cli(
        *([command] if command else []), "--help", env=isolated_env
    )
    assert code == 0, err
    assert "Usage: yatrain" in out
    assert torch_modules == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pretrian"], "No such command 'pretrian'. Did you mean 'pretrain'? (see yatrain --help)"),
        (["pretrain", "--bogus"], "No such option: --bogus (see yatrain pretrain --help)"),
        (["plan", "recipes/tiny.yaml", "--gpus", "0"], "Invalid value for '--gpus'"),
        (["sweep", "recipes/tiny.yaml"], "Missing option '--seq-len'"),
    ],
)
def test_a_mistake_is_one_line_without_torch(args, message, isolated_env):
    code, out, err, torch_modules = run_cli(*args, env=isolated_env)
    assert code == 2
    assert err.startswith("yatrain: error: ") and message in err
    assert "\n" not in err and out == ""
    assert torch_modules == 0


def test_a_command_that_runs_imports_torch_after_protecting_the_cache(isolated_env, tmp_path):
    """``plan`` imports the library (and torch) inside the command, after the command line
    pointed inductor's cache at the user's private directory."""
    env = dict(isolated_env, XDG_CACHE_HOME=str(tmp_path / "cache"))
    code, out, err, torch_modules = run_cli("plan", "recipes/tiny.yaml", "--gpus=2", env=env)
    assert code == 0, err
    assert "GiB" in out
    assert torch_modules > 0
    assert (tmp_path / "cache" / "yatrain" / "inductor").is_dir()
