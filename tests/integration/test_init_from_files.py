"""``train.init_from`` a Hugging Face directory whose files are malformed or crafted:
every one is refused in one line naming the file and the field, before a wrong weight loads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from safetensors.torch import save_file

from yatrain.checkpoint import store as ckpt
from yatrain.checkpoint.init_from import init_from_source
from yatrain.errors import ConfigError
from yatrain.models import hf
from yatrain.models.llama import build_model, materialize
from yatrain.recipe.load import load_recipe
from yatrain.sharding import ShardedEngine

WEIGHTS = "model.safetensors"


def tiny():
    return load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, "data.path=unused"]).model


@pytest.fixture
def folder(tmp_path) -> Path:
    """The tiny model as a Hugging Face directory: config.json and one F32 safetensors."""
    cfg, path = tiny(), tmp_path / "hf"
    path.mkdir()
    model = materialize(build_model(cfg), "cpu", 0)
    tensors = dict(hf.to_hf(name, t, cfg) for name, t in model.state_dict().items())
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf.hf_config(cfg, "fp32", 1, 2)))
    return path


def load(folder: Path) -> dict[str, torch.Tensor]:
    """What a one-rank run starting from ``folder`` trains from."""
    cfg = tiny()
    model = build_model(cfg)
    init = init_from_source(folder, cfg, model)
    return ShardedEngine.from_model(model, device="cpu", init=init).full_state_dict()


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        header, data = split(folder / WEIGHTS)
        change(header)
        join(folder / WEIGHTS, header, data)

    return apply


def edit_config(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(change(config) or config))

    return apply


def set_length(length: Callable[[int], int]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(struct.pack("<Q", length(len(raw))) + raw[8:])

    return apply


def truncate(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(raw[: keep(len(raw))])

    return apply


EMBED, NORM, LAST = (
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.1.mlp.up_proj.weight",
)


def _entry(name: str, **fields) -> Callable[[dict], None]:
    return lambda header: header[name].update(fields)


def _overlap(header: dict) -> None:
    """The final norm's bytes said to start where the embedding's do."""
    begin, end = header[NORM]["data_offsets"]
    start = header[EMBED]["data_offsets"][0]
    header[NORM]["data_offsets"] = [start, start + end - begin]


def _past_end(header: dict) -> None:
    begin, end = header[NORM]["data_offsets"]
    header[NORM]["data_offsets"] = [begin + 10**6, end + 10**6]


def _gap(folder: Path) -> None:
    """The last tensor moved 4 bytes on, 4 bytes appended: a hole safetensors refuses."""
    header, data = split(folder / WEIGHTS)
    named = [(k, v) for k, v in header.items() if k != "__metadata__"]
    name, last = max(named, key=lambda item: item[1]["data_offsets"][0])
    begin, end = last["data_offsets"]
    last["data_offsets"] = [begin + 4, end + 4]
    join(folder / WEIGHTS, header, data[:begin] + bytes(4) + data[begin:])


def _index_naming(file: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        header, _ = split(folder / WEIGHTS)
        names = [k for k in header if k != "__metadata__"]
        index = {"weight_map": dict.fromkeys(names, file)}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return apply


def _nested(folder: Path) -> None:
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _nested_index(folder: Path) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    (folder / "model.safetensors.index.json").write_text(f'{{"weight_map": {nested}}}')


def _fifo_weights(folder: Path) -> None:
    """A FIFO once read as "has no model.safetensors" (and reading one would block)."""
    (folder / WEIGHTS).unlink()
    os.mkfifo(folder / WEIGHTS)


def _rope_string(config: dict) -> None:
    config.pop("rope_theta")
    config.pop("rope_scaling", None)
    config["rope_parameters"] = "llama3"


def _huge_original(config: dict) -> None:
    config["rope_parameters"] = {
        **hf.rope_parameters(tiny()),
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 10**20,
    }


# (what is wrong, how to make it so, what the one line must name besides the directory)
MALFORMED = [
    ("header_length_absurd", set_length(lambda size: 2**62), [WEIGHTS, "header length"]),
    ("header_length_zero", set_length(lambda size: 0), [WEIGHTS, "header length 0"]),
    ("header_length_past_end", set_length(lambda size: size), [WEIGHTS, "header length"]),
    ("truncated_file", truncate(lambda size: size - 100), [WEIGHTS, "data_offsets", "truncated"]),
    ("empty_file", truncate(lambda size: 0), [WEIGHTS, "0 bytes"]),
    ("overlapping_offsets", edit_header(_overlap), [WEIGHTS, NORM, "overlap"]),
    ("past_end_offsets", edit_header(_past_end), [WEIGHTS, NORM, "data_offsets"]),
    ("gap_between_tensors", _gap, [WEIGHTS, "leave a gap"]),
    ("unknown_dtype", edit_header(_entry(NORM, dtype="Q9")), [WEIGHTS, NORM, "dtype 'Q9'"]),
    ("relabelled_i32", edit_header(_entry(EMBED, dtype="I32")), [WEIGHTS, EMBED, "dtype 'I32'"]),
    ("negative_shape", edit_header(_entry(NORM, shape=[-64])), [WEIGHTS, NORM, "shape [-64]"]),
    ("size_mismatch", edit_header(_entry(NORM, shape=[63])), [WEIGHTS, NORM, "data_offsets"]),
    (
        "non_string_metadata",
        edit_header(lambda header: header["__metadata__"].update(format=3)),
        [WEIGHTS, "__metadata__ 'format' is 3"],
    ),
    ("index_naming_config_json", _index_naming("config.json"), ["config.json", "weight_map"]),
    ("rope_parameters_string", edit_config(_rope_string), ["config.json", "rope_parameters"]),
    ("deeply_nested_config", _nested, ["config.json", "nested too deeply"]),
    ("deeply_nested_index", _nested_index, ["model.safetensors.index.json", "nested too deeply"]),
    ("weights_not_a_regular_file", _fifo_weights, [WEIGHTS, "is not a regular file"]),
    (
        "tie_word_embeddings_string",
        edit_config(lambda config: config.update(tie_word_embeddings="true")),
        ["config.json", "'tie_word_embeddings' is 'true', not true or false"],
    ),
    (
        "mistyped_field_named_as_config_json_names_it",
        edit_config(lambda config: config.update(rms_norm_eps="abc")),
        ["config.json", "'rms_norm_eps' must be a finite number"],
    ),
    (
        "huge_original_max_position_embeddings",
        edit_config(_huge_original),
        ["config.json", "original_max_position_embeddings"],
    ),
]


@pytest.mark.parametrize("case,make,named", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_each_malformed_file_is_one_line_naming_the_file_and_field(folder, case, make, named):
    load(folder)  # the file as written loads
    make(folder)
    with pytest.raises(ConfigError) as refused:
        load(folder)
    line = str(refused.value)
    assert "\n" not in line and str(folder) in line
    for part in named:
        assert part in line, (case, line)


def test_tensors_config_json_does_not_describe_are_refused_by_name(folder):
    """A config.json that understates the depth (1 layer, the file holds 2) and a recipe
    that agrees with it once trained the first layer only, the second silently ignored."""
    edit_config(lambda config: config.update(num_hidden_layers=1))(folder)
    cfg = dataclasses.replace(tiny(), n_layers=1)
    with pytest.raises(ConfigError) as refused:
        init_from_source(folder, cfg, build_model(cfg))
    line = str(refused.value)
    assert "\n" not in line and str(folder) in line
    assert "holds tensors its config.json does not describe" in line
    assert "model.layers.1.input_layernorm.weight" in line and "and 6 more" in line


def _nan_weight(folder: Path) -> None:
    header, data = split(folder / WEIGHTS)
    begin, _ = header[LAST]["data_offsets"]
    nan = struct.pack("<f", math.nan)
    join(folder / WEIGHTS, header, data[:begin] + nan + data[begin + 4 :])


def test_nan_weights_are_refused_naming_the_tensor(folder):
    _nan_weight(folder)
    with pytest.raises(ConfigError, match=f"{WEIGHTS}: tensor {LAST} holds NaN or infinite"):
        load(folder)


def test_a_relabelled_dtype_is_one_line_from_the_cli(folder, small_data, isolated_env, tmp_path):
    """The F32 tensor relabelled I32 once loaded as 1,065,353,216.0 and trained: now exit 2,
    one line, no run directory."""
    edit_header(_entry(EMBED, dtype="I32"))(folder)
    sets = [f"--set={s}" for s in [*FAST, f"data.path={small_data}", f"train.init_from={folder}"]]
    command = [sys.executable, "-m", "yatrain", "pretrain", "recipes/tiny.yaml", *sets]
    command += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(
        command, env=isolated_env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{WEIGHTS}: tensor {EMBED}: dtype 'I32'" in line


def test_nan_weights_in_a_yatrain_checkpoint_are_refused_naming_the_tensor(tmp_path):
    """A checkpoint's checksums guard against accidents, not against whoever rewrote them:
    its weights are checked finite as they load too."""
    cfg = tiny()
    model = build_model(cfg)
    engine = ShardedEngine.from_model(model, device="cpu", seed=0)
    opt = torch.optim.AdamW(engine.param_groups(0.1), lr=1e-3)
    with torch.no_grad():
        engine.param_groups(0.1)[0]["params"][0][5] = math.nan
    meta = {"model": dataclasses.asdict(cfg)}
    path = ckpt.save_checkpoint(tmp_path, 1, engine, opt, None, meta, is_main=True, keep=1)
    with pytest.raises(ConfigError, match=r"holds NaN or infinite values") as refused:
        load(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
