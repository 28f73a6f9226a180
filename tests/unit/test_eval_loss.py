"""The held-out loss (``train.evaluate.Evaluator``) is the mean over the predicted tokens of
real windows: a micro-batch part padded is checked against a loss computed here window by
window, independently of the code under test."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import FAST, ROOT

from yatrain.data.heldout import EvalWindows, open_held_out
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.load import load_recipe
from yatrain.train.evaluate import Evaluator


def test_evaluation_of_a_part_padded_micro_batch_is_the_per_token_mean(small_data):
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
