"""Recipe schema: every shipped recipe loads, and every user mistake is one clear ConfigError."""

import copy

import pytest
import yaml
from conftest import ROOT

from yatrain.cli import sweep_options
from yatrain.errors import ConfigError
from yatrain.recipe.checks import check_vocab
from yatrain.recipe.config import Recipe, recipe_to_dict
from yatrain.recipe.load import load_recipe, recipe_from_dict
from yatrain.recipe.topology import JobLayout, job_layout, validate_world_size

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny.yaml"


def tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def set_key(d: dict, dotted: str, value) -> dict:
    d = copy.deepcopy(d)
    *parents, leaf = dotted.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[leaf] = value
    return d


def drop_key(d: dict, dotted: str) -> dict:
    d = copy.deepcopy(d)
    *parents, leaf = dotted.split(".")
    node = d
    for p in parents:
        node = node[p]
    del node[leaf]
    return d


def error(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    expected = {"llama2_7b", "llama2_13b", "llama2_34b", "llama2_70b", "llama3_8b", "llama3_70b"}
    assert expected | {"tiny"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.optim.min_lr == pytest.approx(r.optim.lr / 10)
    # Trained at the full context, or (rotary scaling) at the original one
    scaling = r.model.rope_scaling
    original = scaling.original_max_position_embeddings if scaling else r.model.max_seq_len
    assert r.data.seq_len in (original, r.model.max_seq_len) or path.stem == "tiny"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_key_is_commented(path):
    """litgpt-style: each key line has a comment on it or on the line above."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#") and line.rstrip().endswith(":"):
            continue  # a section header
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line or lines[i - 1].lstrip().startswith("#"), f"{path.name}: {line}"


def test_llama3_8b_values():
    r = load_recipe(RECIPES[0].parent / "llama3_8b.yaml")
    assert (r.model.n_kv_heads, r.model.vocab_size, r.model.rope_theta) == (8, 128256, 5e5)
    assert r.data.global_batch_size * r.data.seq_len == 512 * 8192
    assert (r.optim.beta2, r.optim.eps, r.optim.weight_decay) == (0.95, 1e-5, 0.1)


def test_round_trip():
    r = load_recipe(TINY)
    d = recipe_to_dict(r)
    assert recipe_from_dict(d) == r
    assert recipe_from_dict(yaml.safe_load(yaml.safe_dump(d))) == r


def test_a_keyword_key_checkpoint_async():
    """``async`` is a Python keyword: the field is ``async_``, the recipe's key ``async``."""
    r = load_recipe(TINY, ["checkpoint.async=true"])
    assert r.checkpoint.async_ is True and load_recipe(TINY).checkpoint.async_ is False
    d = recipe_to_dict(r)
    assert d["checkpoint"]["async"] is True and "async_" not in d["checkpoint"]
    assert recipe_from_dict(yaml.safe_load(yaml.safe_dump(d))) == r
    with pytest.raises(ConfigError, match=r"unknown key 'checkpoint\.async_'"):
        load_recipe(TINY, ["checkpoint.async_=true"])
    with pytest.raises(ConfigError, match=r"'checkpoint\.async' must be"):
        load_recipe(TINY, ["checkpoint.async=3"])


def test_defaults_fill_optional_sections():
    d = tiny()
    for section in ("sharding", "checkpoint", "logging"):
        del d[section]
    r = recipe_from_dict(d)
    assert r.sharding.reduce_dtype == "fp32" and r.sharding.prefetch_depth == 1
    assert r.checkpoint.dir == "checkpoints" and r.checkpoint.keep == 2
    assert r.logging.wandb.mode == "auto" and r.logging.wandb.entity is None


def test_float_written_without_dot_is_accepted():
    # PyYAML reads 3e-4 (no dot) as the string "3e-4".
    d = yaml.safe_load("lr: 3e-4")
    assert d["lr"] == "3e-4"
    r = recipe_from_dict(set_key(tiny(), "optim.lr", d["lr"]))
    assert r.optim.lr == 3e-4 and isinstance(r.optim.lr, float)
    r = recipe_from_dict(set_key(tiny(), "optim.grad_clip", 1))
    assert r.optim.grad_clip == 1.0 and isinstance(r.optim.grad_clip, float)


def test_overrides_are_typed(tmp_path):
    r = load_recipe(
        TINY,
        [
            "model.n_layers=2",
            "train.dtype=bf16",
            "logging.wandb.mode=disabled",
            "optim.lr=1e-3",
            "data.tokenizer=tok/x.model",
            "sharding.activation_checkpoint_layers=0",
        ],
    )
    assert r.model.n_layers == 2 and isinstance(r.model.n_layers, int)
    assert r.train.dtype == "bf16"
    assert r.logging.wandb.mode == "disabled"
    assert r.optim.lr == 1e-3
    assert r.data.tokenizer == "tok/x.model"
    # An override may create a section the file leaves out.
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(drop_key(tiny(), "logging")))
    assert load_recipe(f, ["logging.wandb.project=p"]).logging.wandb.project == "p"


@pytest.mark.parametrize("bad", ["model.n_layers", "=3", "model..dim=3", "model.dim 3"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="override"):
        load_recipe(TINY, [bad])


def test_override_into_a_value():
    with pytest.raises(ConfigError, match="model.dim"):
        load_recipe(TINY, ["model.dim.x=3"])


def test_override_unknown_key_suggests():
    with pytest.raises(ConfigError, match=r"model\.n_layer'; did you mean 'model\.n_layers'"):
        load_recipe(TINY, ["model.n_layer=2"])


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_recipe("nope.yaml")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model:\n  dim: 4\n  n_layers: [1, 2\ndata:\n  path: x\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml line \d+"):
        load_recipe(f)


def test_file_errors_name_the_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(set_key(tiny(), "model.dim", "wide")))
    with pytest.raises(ConfigError, match=r"r\.yaml: 'model\.dim'"):
        load_recipe(f)


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("model.n_layer", "model.n_layers"),
        ("optim.warmup", "optim.warmup_steps"),
        ("logging.wandb.projct", "logging.wandb.project"),
        ("modle", "model"),
    ],
)
def test_unknown_key_suggests_closest(key, suggestion):
    d = tiny()
    *parents, leaf = key.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[leaf] = 1
    msg = error(d)
    assert f"unknown key '{key}'; did you mean '{suggestion}'?" in msg


def test_unknown_key_without_close_match_lists_keys():
    assert "valid keys" in error(set_key(tiny(), "train.zzzz", 1))


@pytest.mark.parametrize("key", ["model.dim", "data.path", "optim.lr", "train.steps", "model"])
def test_missing_required_key(key):
    assert f"missing required key '{key}'" in error(drop_key(tiny(), key))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model.n_layers", 2.5),  # int fields reject floats,
        ("model.n_layers", "4"),  # strings,
        ("model.n_layers", True),  # and bools
        ("optim.lr", "fast"),  # float fields reject non-numeric strings
        ("optim.lr", True),
        ("optim.lr", ".inf"),
        ("data.path", 3),  # str fields reject numbers
        ("logging.wandb.project", 1.5),
        ("data", [1, 2]),  # sections must be mappings
    ],
)
def test_wrong_type(key, value):
    assert f"'{key}'" in error(set_key(tiny(), key, value))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train.dtype", "fp16"),
        ("sharding.reduce_dtype", "fp16"),
        ("logging.wandb.mode", False),  # YAML `off`
        ("logging.wandb.mode", "on"),
    ],
)
def test_bad_enum(key, value):
    msg = error(set_key(tiny(), key, value))
    assert f"'{key}'" in msg and "choose one of" in msg


def test_sharding_checkpoint_layers_accepts_auto():
    recipe = recipe_from_dict(set_key(tiny(), "sharding.activation_checkpoint_layers", "auto"))
    assert recipe.sharding.activation_checkpoint_layers == "auto"
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    limited = recipe_from_dict(set_key(tiny(), "sharding.gpu_memory_gib", 40))
    assert limited.sharding.gpu_memory_gib == 40.0


@pytest.mark.parametrize("value", ["aut", "all", 2.5, True])
def test_sharding_checkpoint_layers_rejects_other_values(value):
    msg = error(set_key(tiny(), "sharding.activation_checkpoint_layers", value))
    assert "'sharding.activation_checkpoint_layers' must be a whole number or 'auto'" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model.dim", 0),
        ("model.vocab_size", -1),
        ("model.norm_eps", 0),
        ("data.micro_batch_size", 0),
        ("train.steps", 0),
        ("train.log_every", 0),
        ("optim.lr", 0),
        ("optim.min_lr", -1e-5),
        ("optim.beta2", 1.0),
        ("optim.grad_clip", -1.0),
        ("sharding.activation_checkpoint_layers", -1),
        ("sharding.prefetch_depth", 0),
        ("checkpoint.every", -1),
        ("checkpoint.keep", 0),
    ],
)
def test_out_of_range(key, value):
    assert f"'{key}'" in error(set_key(tiny(), key, value))


def test_a_share_above_one_is_refused_with_its_range_not_as_a_model_size():
    message = error(set_key(tiny(), "optim.decay_fraction", 1.5))
    assert "'optim.decay_fraction' must be above 0 and at most 1, got 1.5" in message
    assert "hardware" not in message
    assert "far beyond any model" in error(set_key(tiny(), "model.n_layers", 10**6))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.dim": 250}, "model.dim"),  # not divisible by 8 heads
        ({"model.n_kv_heads": 3}, "model.n_kv_heads"),  # 8 heads % 3
        ({"model.n_kv_heads": 16}, "model.n_kv_heads"),  # more kv heads than heads
        ({"model.dim": 40, "model.n_heads": 8, "model.n_kv_heads": 8}, "model.n_heads"),  # hd 5
        ({"data.seq_len": 512}, "data.seq_len"),
        ({"data.global_batch_size": 20}, "data.global_batch_size"),
        ({"sharding.activation_checkpoint_layers": 5}, "sharding.activation_checkpoint_layers"),
        ({"optim.min_lr": 1.0}, "optim.min_lr"),
    ],
)
def test_impossible_shapes(changes, key):
    d = tiny()
    for k, v in changes.items():
        d = set_key(d, k, v)
    assert f"'{key}'" in error(d)


def test_long_warmup_is_allowed():
    r = recipe_from_dict(set_key(tiny(), "optim.warmup_steps", 10_000))
    assert r.optim.warmup_steps > r.train.steps


def test_validate_world_size():
    r = load_recipe(TINY)  # global 16, micro 8
    validate_world_size(r, 1)
    validate_world_size(r, 2)
    assert r.data.grad_accum_steps(1) == 2 and r.data.grad_accum_steps(2) == 1
    with pytest.raises(ConfigError, match=r"'data\.global_batch_size'.*24 or 48") as e:
        validate_world_size(r, 3)
    assert "\n" not in str(e.value)


def test_an_evaluation_layout_takes_any_world_a_training_layout_refuses():
    """``yatrain eval`` lays its job out without the batch check (its ranks split the
    windows): 3 ranks evaluate a recipe whose 16 sequences do not split over 3."""
    r = load_recipe(TINY)  # global 16, micro 8
    assert job_layout(r, 3, 3, batch=False) == JobLayout(3, 3, 1, 3)
    with pytest.raises(ConfigError, match=r"'data\.global_batch_size' \(16\).*24 or 48"):
        job_layout(r, 3, 3)


def test_check_vocab():
    r = load_recipe(TINY)
    check_vocab(r, 4096)
    check_vocab(r, 4000)
    with pytest.raises(ConfigError, match=r"'model\.vocab_size'.*at least 5000"):
        check_vocab(r, 5000)


@pytest.mark.parametrize(
    "value,expected",
    [
        (0, "must be positive"),
        (-5, "must be positive"),
        (1e308, "must be above 0 and at most 1048576"),
        ("lots", "must be a number or 'auto'"),
        (True, "must be a number or 'auto'"),
    ],
)
def test_reduce_staging_budget_refusals(value, expected):
    msg = error(set_key(tiny(), "sharding.reduce_staging_mib", value))
    assert "sharding.reduce_staging_mib" in msg and expected in msg


def test_reduce_staging_budget_accepts_auto_and_mebibytes():
    default = recipe_from_dict(drop_key(tiny(), "sharding.reduce_staging_mib"))
    assert default.sharding.reduce_staging_mib == "auto"
    for value in ("auto", 64, 1.5):
        recipe = recipe_from_dict(set_key(tiny(), "sharding.reduce_staging_mib", value))
        assert recipe.sharding.reduce_staging_mib == value


@pytest.mark.parametrize("value", [1e30, 2**20 + 1, 1e-9, 0.0009, 0, -1])
def test_gpu_memory_gib_is_bounded_as_the_planners_gpu_memory_flag(value):
    """1e30 planned a 5e28 GiB peak (5% of it kept for fragmentation); 1e-9 planned nothing
    that fits. The bounds are ``yatrain plan --gpu-memory``'s: 0.001 to 1048576 GiB (0 and
    -1 were the schema's "must be positive", without them)."""
    msg = error(set_key(tiny(), "sharding.gpu_memory_gib", value))
    assert msg.startswith(f"'sharding.gpu_memory_gib' ({value:g}) must be from 0.001 to 1048576 ")
    assert "e.g. 80" in msg, msg
    assert (sweep_options.MIN_GPU_GIB, sweep_options.MAX_GIB) == (0.001, 1048576)  # the flag's


def test_gpu_memory_gib_takes_its_bounds_and_null():
    for value in (0.001, 80, 2**20, None):
        recipe = recipe_from_dict(set_key(tiny(), "sharding.gpu_memory_gib", value))
        assert recipe.sharding.gpu_memory_gib == value
