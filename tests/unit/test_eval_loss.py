"""The held-out loss (``train.evaluate.Evaluator``) is the mean over the predicted tokens of
real windows: a micro-batch part padded is checked against a loss computed here window by
window, independently of the code under test. The held-out windows carry the model inputs
of training (restarted positions), and held-out data of another tokenizer is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, ROOT

from yatrain.data import TokenShards
from yatrain.data.heldout import (
    EvalWindows,
    HeldOut,
    attention_inputs,
    check_same_tokenizer,
    open_held_out,
)
from yatrain.errors import DataError
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.config import DataConfig
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


def _held_out(path: Path, tokens: list[int], bos_id: int = 1, eos_id: int = 2) -> HeldOut:
    """A data directory of ``tokens`` written in the on-disk format (tokenizer: stand-in bytes)."""
    path.mkdir()
    (path / "tokenizer.model").write_bytes(b"stand-in tokenizer")
    data = np.asarray(tokens, dtype="<u2").tobytes()
    (path / "tokens-00000.bin").write_bytes(data)
    manifest = {
        "format": "yatrain-tokens-v1",
        "dtype": "uint16",
        "tokenizer_sha256": hashlib.sha256(b"stand-in tokenizer").hexdigest(),
        "vocab_size": 512,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "num_documents": 1,
        "num_tokens": len(tokens),
        "files": [
            {
                "name": "tokens-00000.bin",
                "num_tokens": len(tokens),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ],
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return HeldOut("", 1.0, TokenShards.open(path))


def test_held_out_windows_carry_restarted_positions_when_asked(tmp_path):
    # Documents [1] text [2] of 3 to 8 tokens back to back: bos 1, eos 2, text 10..
    tokens = [t for n in [1, 4, 6, 2, 5, 3] * 6 for t in [1, *range(10, 10 + n), 2]]
    held = _held_out(tmp_path / "docs", tokens)
    data = DataConfig(seq_len=12, micro_batch_size=2, global_batch_size=4, document_mask=True)
    masked_only = attention_inputs(data, 1, 2)
    data.restart_positions = True
    restarted = attention_inputs(data, 1, 2)
    assert restarted is not None and masked_only is not None
    windows = EvalWindows(held, 12, 6, 2, 0, 1, model_inputs=restarted)
    batches = list(windows.micro_batches())
    assert len(batches) == 3
    for batch in batches:
        want = []
        for row in batch.inputs.tolist():  # 0 at the window's start and each BOS after an EOS
            want.append([])
            for i, token in enumerate(row):
                start = i == 0 or (token == 1 and row[i - 1] == 2)
                want[-1].append(0 if start else want[-1][-1] + 1)
        assert batch.extra["positions"].tolist() == want
        assert set(masked_only(batch.inputs)) == {"document_ids"}
    assert any(0 in row[1:] for b in batches for row in b.extra["positions"].tolist())


def test_held_out_data_with_another_bos_or_eos_id_is_refused(tmp_path):
    held = [_held_out(tmp_path / "held", list(range(3, 40)), bos_id=1, eos_id=2)]
    sha256 = held[0].shards.tokenizer_sha256
    check_same_tokenizer(held, sha256, 1, 2)  # the model's tokenizer: accepted
    for bos_id, eos_id in [(3, 2), (1, 3), (2, 1)]:
        with pytest.raises(DataError, match="prepared with another tokenizer than the model's"):
            check_same_tokenizer(held, sha256, bos_id, eos_id)
    with pytest.raises(DataError, match="another tokenizer"):
        check_same_tokenizer(held, "0" * 64, 1, 2)
