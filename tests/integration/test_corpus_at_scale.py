"""A corpus of 100,000 token files trains under `ulimit -n 256`, and a token file that goes
missing mid-corpus stops the run in one line with its last checkpoint intact.

End to end because the limit applies to the whole process (torch, the loader, the
checkpointer): one run of one step, then one resume that meets the damaged file."""

import resource
import subprocess

import numpy as np
import yaml
from test_failures import one_line_error, pretrain_args, yatrain

from yatrain.data.loader import GlobalBatchLoader
from yatrain.data.shards import TokenShards
from yatrain.testing.sparse_corpus import write_sparse_corpus

FILES = 100_000
TOKENS_PER_FILE = 4096  # 800 MB of uint16 on paper, over the size hashed on open; 0 on disk
OPEN_FILES = 256


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def _yatrain_limited(*args: str, env: dict) -> subprocess.CompletedProcess:
    return yatrain(*args, env=env, timeout=300, preexec_fn=_limited)


def test_a_hundred_thousand_token_files_train_under_a_small_open_file_limit(
    small_data, isolated_env, tmp_path
):
    data = tmp_path / "sparse"
    write_sparse_corpus(data, FILES, TOKENS_PER_FILE, tokenizer_from=small_data)
    run = tmp_path / "run"
    args = pretrain_args(data, run, "--set=checkpoint.every=1")
    first = _yatrain_limited(*args, "--steps", "1", env=isolated_env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    saved = run / "checkpoints" / "step-1"
    before = {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}

    recipe = yaml.safe_load((run / "config.yaml").read_text())
    config = recipe["data"]
    loader = GlobalBatchLoader(
        TokenShards.open(data),
        config["seq_len"],
        config["global_batch_size"],
        config["micro_batch_size"],
        seed=recipe["train"]["seed"],
    )
    window = int(loader.global_batch(1)[0])  # the second step's first window
    lost = data / f"tokens-{window * config['seq_len'] // TOKENS_PER_FILE:05d}.bin"
    lost.unlink()
    second = _yatrain_limited(*args, "--steps", "2", "--resume", "auto", env=isolated_env)
    one_line_error(second, f"token file {lost} is missing", "yatrain prepare-data")
    after = {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}
    assert after == before and not (run / "checkpoints" / "step-2").exists()
    assert np.array_equal(loader.shards.read(0, 10), np.zeros(10))
