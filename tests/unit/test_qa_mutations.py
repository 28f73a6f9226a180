"""Finding 12 of issue 22: three one-line bugs a mutation audit showed the suite let through,
each now checked against a reference written out independently of the code under test."""

from __future__ import annotations

import regex
import torch
import torch.nn.functional as F
from conftest import FAST, ROOT
from tokenizer_fixtures import META_PATTERN

from yatrain.data.heldout import EvalWindows, open_held_out
from yatrain.data.tokenizer_tiktoken import PATTERN
from yatrain.models.generate import Sampling, choose
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.load import load_recipe
from yatrain.train.evaluate import Evaluator

SPLITS = {
    "'tis": ["'t", "is"],
    "it'sgood": ["it", "'s", "good"],
    "We'LL see": ["We", "'LL", " see"],
    "1234567 89": ["123", "456", "7", " ", "89"],
    "a   b": ["a", "  ", " b"],
    "x\n\n  y": ["x", "\n\n", " ", " y"],
    "end.  ": ["end", ".", "  "],
}


def test_12a_the_llama3_split_pattern_is_metas():
    assert PATTERN == META_PATTERN
    for text, pieces in SPLITS.items():
        assert regex.findall(PATTERN, text) == pieces, text


def test_12b_sampling_at_a_temperature_follows_softmax_of_logits_over_t():
    """At T = 0.5 and T = 2, the frequencies of 20,000 seeded draws are softmax(logits / T)
    (dividing twice would give softmax(logits / T^2): off by 0.1 and more)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    draws = 20_000
    for temperature in (0.5, 2.0):
        generator = torch.Generator().manual_seed(0)
        counts = torch.zeros(4)
        for _ in range(draws):
            counts[choose(logits, Sampling(temperature=temperature), generator)] += 1
        want = torch.softmax(logits / temperature, dim=0)
        assert (counts / draws - want).abs().max() < 0.015, (temperature, counts / draws, want)


def test_12c_evaluation_of_a_part_padded_micro_batch_is_the_per_token_mean(small_data):
    """5 windows in micro-batches of 2: the last holds one window and one of padding. The
    result is the mean over the 5 x 32 predicted tokens, computed here window by window."""
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={small_data}"])
    model = materialize(build_model(recipe.model), "cpu", seed=0)
    held = open_held_out(small_data)
    part = EvalWindows(held, 32, 5, 2, 0, 1)
    got = Evaluator(recipe, [part], torch.device("cpu")).evaluate(model).loss
    per_window = []
    with torch.no_grad():
        for window in range(5):
            tokens = torch.from_numpy(held.shards.read(window * 32, 33).astype("int64"))
            logits = model(tokens[None, :-1])[0]
            per_window.append(float(F.cross_entropy(logits, tokens[1:], reduction="sum")))
    want = sum(per_window) / (5 * 32)
    slots = (sum(per_window[:4]) + 2 * per_window[4]) / (6 * 32)  # padding counted as tokens
    assert abs(slots - want) > 1e-3  # the test can tell the two apart
    assert abs(got - want) < 1e-4, (got, want)
