"""Weights & Biases: online with an API key and a network, offline otherwise, or disabled.

The mode is the more restrictive of ``logging.wandb.mode`` and the ``WANDB_MODE`` variable
(disabled > offline > online), so ``WANDB_MODE=offline`` is never overridden by a recipe.
``auto`` logs online only with an API key and when the W&B host answers within a few
seconds (one TCP connect, in a thread so a hanging DNS lookup cannot stall the run); else,
or when starting the online run fails, it logs offline to a directory under the run dir
that ``wandb sync`` uploads later, and says so. Only rank 0 logs.
"""

from __future__ import annotations

import netrc
import os
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from yatrain.errors import YatrainError
from yatrain.files import write_whole
from yatrain.recipe.config import WandbConfig

PROBE_TIMEOUT_S = 3.0  # how long auto waits for the W&B host before logging offline
INIT_TIMEOUT_S = 20.0  # how long auto lets wandb.init take online before falling back
_STRICTNESS = ("online", "offline", "disabled")
_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}


def resolve_mode(mode: str) -> tuple[str, str | None]:
    """(the mode to log in, a note for the console when auto went offline for lack of a
    network, else None)."""
    env = _ENV_MODES.get(os.environ.get("WANDB_MODE", "").strip().lower())
    if mode != "auto":
        return max(mode, env or mode, key=_STRICTNESS.index), None
    if env is not None:
        return env, None
    if not _has_api_key():
        return "offline", None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    problem = _unreachable(host or "api.wandb.ai")
    if problem is None:
        return "online", None
    return "offline", f"wandb: {host} is unreachable ({problem}): logging offline instead"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _unreachable(host: str) -> str | None:
    """Why ``host``:443 cannot be reached within PROBE_TIMEOUT_S, or None if it can."""
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except OSError as error:
            result.append(str(error) or type(error).__name__)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    return result[0] if result else f"no answer in {PROBE_TIMEOUT_S:.0f} s"


class WandbLogger:
    def __init__(
        self,
        cfg: WandbConfig,
        run_dir: Path,
        config: dict,
        name: str,
        say: Callable[[str], None] = print,
    ) -> None:
        self.mode, note = resolve_mode(cfg.mode)
        self.run, self.say = None, say
        if note:
            say(note + f" (upload later: wandb sync {run_dir}/wandb/offline-run-*)")
        if self.mode == "disabled":
            return
        if not os.environ.get("HOME") and not os.environ.get("XDG_CACHE_HOME"):
            # wandb-core prints its own log to stderr when it has no cache directory
            os.environ["XDG_CACHE_HOME"] = str(run_dir / "wandb" / "cache")
        import wandb  # imported lazily: it is slow and unused when disabled

        # One W&B run per run directory: a resumed or restarted job continues it.
        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
        write_whole(id_file, run_id)
        args = dict(
            id=run_id,
            resume="allow",
            project=cfg.project,
            entity=cfg.entity,
            name=name,
            config=config,
            dir=str(run_dir),
        )
        try:
            self.run = self._init(wandb, args, cfg.mode == "auto")
        except Exception as error:  # wandb raises its own CommError, UsageError, ...
            if self.mode != "online" or cfg.mode != "auto":
                raise _start_failure(self.mode, error) from None
            say(f"wandb: online start failed ({_first_line(error)}): logging offline instead")
            self.mode = "offline"
            try:
                self.run = self._init(wandb, args, False)
            except Exception as error:  # a server that answers but refuses, a wandb bug
                raise _start_failure(self.mode, error) from None

    def _init(self, wandb, args: dict, bounded: bool):
        options = {"init_timeout": INIT_TIMEOUT_S} if bounded and self.mode == "online" else {}
        settings = wandb.Settings(silent=True, console="off", **options)
        return wandb.init(mode=self.mode, settings=settings, **args)

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            values = {k: v for k, v in metrics.items() if v is not None}
            self._guarded(lambda: self.run.log(values, step=step))

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self._guarded(lambda: self.run.summary.update(values))

    def finish(self) -> None:
        if self.run is not None:
            self._guarded(self.run.finish)
            self.run = None

    def _guarded(self, call: Callable[[], object]) -> None:
        """A W&B failure mid-run stops W&B logging with one line, never the training
        (metrics.jsonl keeps every record)."""
        try:
            call()
        except Exception as error:  # wandb raises its own ServerResponseError, CommError, ...
            self.run = None
            self.say(
                f"warning: wandb failed ({_first_line(error)}): W&B logging stopped; "
                "metrics.jsonl keeps every record"
            )


def _start_failure(mode: str, error: BaseException) -> YatrainError:
    return YatrainError(
        f"W&B could not start a {mode} run ({_first_line(error)}): check WANDB_API_KEY and "
        "the network, or set logging.wandb.mode=offline (or disabled)"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]
