"""Weights & Biases: online with an API key, offline otherwise, disabled on request.

``auto`` never blocks a run on the network: without a configured key it writes an offline
run directory under the run dir that ``wandb sync`` uploads later. Only rank 0 logs.
"""

from __future__ import annotations

import netrc
import os
import secrets
from pathlib import Path

from yatrain.config import WandbConfig


def resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return "online" if _has_api_key() else "offline"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict, name: str) -> None:
        self.mode = resolve_mode(cfg.mode)
        self.run = None
        if self.mode == "disabled":
            return
        import wandb  # imported lazily: it is slow and unused when disabled

        # One W&B run per run directory: a resumed or restarted job continues it.
        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
        id_file.write_text(run_id)
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            project=cfg.project,
            entity=cfg.entity,
            name=name,
            config=config,
            dir=str(run_dir),
            mode=self.mode,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
