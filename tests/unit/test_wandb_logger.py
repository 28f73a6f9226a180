"""The W&B logger against a server that answers and refuses: refusing the run is one
``YatrainError`` line; refusing a record once the run started is one warning, then logging
stops (``log`` and ``finish`` raise nothing)."""

from __future__ import annotations

import sys
import types

import pytest

from yatrain.errors import YatrainError
from yatrain.output import wandb_logger
from yatrain.recipe.config import WandbConfig


class ServerResponseError(Exception):
    """What wandb raises when its server answers but refuses."""


class _RefusingWandb(types.ModuleType):
    """A wandb whose server answers and refuses every run; ``refuse_log``: starts, then
    refuses the first record."""

    def __init__(self, refuse_log: bool) -> None:
        super().__init__("wandb")
        self.refuse_log, self.Settings = refuse_log, lambda **_: None

    def init(self, **_):
        if not self.refuse_log:
            raise ServerResponseError("run ID abc is in use")
        return types.SimpleNamespace(log=self.init_failed, finish=lambda: None)

    def init_failed(self, *_, **__):
        raise ServerResponseError("run ID abc is in use")


def test_a_wandb_server_that_refuses_is_one_line_or_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(wandb_logger, "resolve_mode", lambda mode: ("online", None))
    monkeypatch.setitem(sys.modules, "wandb", _RefusingWandb(refuse_log=False))
    with pytest.raises(YatrainError, match="W&B could not start an? offline run .*in use"):
        wandb_logger.WandbLogger(WandbConfig(mode="auto"), tmp_path, {}, "run", say=print)
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "wandb", _RefusingWandb(refuse_log=True))
    logger = wandb_logger.WandbLogger(WandbConfig(mode="auto"), tmp_path, {}, "r", said.append)
    logger.log({"loss": 1.0}, step=1)
    logger.log({"loss": 1.0}, step=2)
    logger.finish()
    assert len(said) == 1 and "W&B logging stopped" in said[0], said
