"""Generation: the KV-cache path computes what a full forward computes, greedy is the argmax
at every step, sampling is seeded, and ``yatrain eval``/``generate`` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT

from yatrain.checkpoint.manifest import open_checkpoint
from yatrain.errors import ConfigError
from yatrain.inference.generate_text import generate_text, load_plain_model
from yatrain.models.generate import KVCache, Sampling, choose, generate, next_logits
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def checkpoint(small_data, tmp_path_factory) -> Path:
    """A few training steps, so the model prefers some tokens to others."""
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    cfg = load_recipe(
        ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}", "eval.at_end=true"]
    )
    pretrain(cfg, run_dir=run_dir, steps=6, progress=False)
    return run_dir / "checkpoints/step-6"


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_plain_model(open_checkpoint(checkpoint), torch.device("cpu"), torch.float32)


PROMPT = [1, 100, 200, 300, 17, 42, 7]


def test_cached_logits_equal_a_full_forward_at_every_step(model):
    """Prefill in two pieces (the second attends over the first through a mask), then one
    token at a time; every position's logits as the full forward computes them."""
    tokens = torch.tensor([PROMPT])
    cache = KVCache(model, 1, 20)
    next_logits(model, tokens[:, :3], cache)
    with torch.no_grad():
        got = next_logits(model, tokens[:, 3:], cache)
        for _ in range(8):
            want = model(tokens)[:, -1]
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            token = torch.tensor([[int(want.argmax())]])
            tokens = torch.cat([tokens, token], dim=1)
            got = next_logits(model, token, cache)


def test_greedy_is_the_argmax_of_the_full_forward_with_and_without_cache(model):
    cached, why = generate(model, PROMPT, max_new_tokens=24, sampling=GREEDY)
    full, _ = generate(model, PROMPT, max_new_tokens=24, sampling=GREEDY, use_cache=False)
    assert cached == full and len(cached) == 24 and why == "max_new_tokens"
    tokens = list(PROMPT)
    with torch.no_grad():
        for token in cached:  # the definition, step by step
            assert token == int(model(torch.tensor([tokens]))[0, -1].argmax())
            tokens.append(token)
    assert len(set(cached)) > 1  # trained weights: not one token repeated


def test_sampling_is_seeded_and_its_cuts_behave(model):
    def sample(seed: int, **options):
        sampling = Sampling(**{"temperature": 1.0, **options})
        generator = torch.Generator().manual_seed(seed)
        return generate(model, PROMPT, max_new_tokens=16, sampling=sampling, generator=generator)

    greedy, _ = generate(model, PROMPT, max_new_tokens=16, sampling=GREEDY)
    assert sample(3) == sample(3)
    assert sample(3)[0] != greedy
    assert sample(3, top_k=1)[0] == greedy  # one candidate left: the argmax
    assert sample(3, top_p=1e-6)[0] == greedy  # the likeliest token alone reaches p
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0])
    picks = {
        choose(logits, Sampling(1.0, top_k=2), torch.Generator().manual_seed(s)) for s in range(50)
    }
    assert picks == {1, 2}
    assert choose(logits, GREEDY, None, vocab_limit=1) == 0  # ids the tokenizer lacks: never


def test_generation_stops_at_eos_and_at_the_context(model):
    greedy, _ = generate(model, PROMPT, max_new_tokens=16, sampling=GREEDY)
    stopped, why = generate(model, PROMPT, max_new_tokens=16, sampling=GREEDY, eos_id=greedy[4])
    assert (stopped, why) == (greedy[: greedy.index(greedy[4]) + 1], "eos")
    long_prompt = [1] * (model.cfg.max_seq_len - 3)
    new, why = generate(model, long_prompt, max_new_tokens=16, sampling=GREEDY)
    assert (len(new), why) == (3, "context")


def test_generate_text_encodes_with_the_checkpoints_tokenizer(checkpoint):
    result = generate_text(checkpoint, "def main():", max_new_tokens=12, sampling=GREEDY)
    assert result["prompt_ids"][0] == 1  # BOS first
    assert result["step"] == 6 and len(result["new_ids"]) == 12
    assert isinstance(result["text"], str) and result["stop"] == "max_new_tokens"
    with pytest.raises(ConfigError, match="--top-p must be"):
        generate_text(checkpoint, "x", sampling=Sampling(top_p=0))
    with pytest.raises(ConfigError, match="the model's context is 64"):
        generate_text(checkpoint, "word " * 200)


def yatrain(*args: str, env: dict, launcher: list[str] | None = None):
    command = launcher or [sys.executable, "-m"]
    return subprocess.run(
        [*command, "yatrain", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )


def test_eval_and_generate_commands(checkpoint, isolated_env):
    logged = [json.loads(line) for line in (checkpoint.parents[1] / "metrics.jsonl").open()][-1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    for launcher in (None, torchrun):
        done = yatrain("eval", str(checkpoint), "--json", env=isolated_env, launcher=launcher)
        assert done.returncode == 0, done.stderr
        (line,) = done.stdout.strip().splitlines()  # one object, from rank 0 only
        result = json.loads(line)
        assert result["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6, abs=0)
        assert result.keys() >= {"val_loss", "val_ppl", "val_tokens", "step"}
        assert "Warning" not in done.stderr
    done = yatrain(
        "generate",
        str(checkpoint),
        "--prompt",
        "import os",
        "--temperature",
        "0",
        "--max-new-tokens",
        "5",
        "--json",
        env=isolated_env,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["new_ids"]) == 5 and result.keys() >= {"prompt_ids", "new_ids", "text"}
    assert done.stderr == ""
    bad = yatrain("eval", str(checkpoint.parent), env=isolated_env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "is not a complete yatrain checkpoint" in bad.stderr
