"""A recipe path that is not a recipe file is one line naming what it is: a directory
(``pretrain recipes/``) with a recipe in it to pass, a FIFO refused without reading it."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT

from yatrain.errors import ConfigError
from yatrain.recipe.load import load_recipe


def test_a_directory_is_named_a_directory_with_a_recipe_to_pass():
    with pytest.raises(ConfigError) as refused:
        load_recipe(ROOT / "recipes")
    message = str(refused.value)
    assert "is a directory, not a recipe file" in message and "not found" not in message
    assert f"{ROOT / 'recipes'}/" in message and message.endswith(".yaml")


def test_a_fifo_is_refused_without_being_read(tmp_path):
    os.mkfifo(tmp_path / "recipe.yaml")
    with pytest.raises(ConfigError, match="recipe.yaml is not a regular file"):
        load_recipe(tmp_path / "recipe.yaml")  # reading it would block forever


def test_a_missing_recipe_is_still_not_found(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
