"""Optimizers over the engine's flat shards that need more than elementwise arithmetic.

AdamW is elementwise, so torch's own runs on the shards (``train/optim.py``); any of them
may be skipped by a device flag (``skip.py``). Muon
orthogonalises each whole weight matrix: ``ShardedMuon`` keeps its elementwise parts on the
shards and lets one owner rank per matrix run the Newton-Schulz iteration (``exchange.py``).
"""

from yatrain.optim.adamw import fused_adamw
from yatrain.optim.muon import MOMENTUM, ShardedMuon, muon_for
from yatrain.optim.newton_schulz import ADJUST_LR, adjusted_lr, zeropower
from yatrain.optim.skip import step_unless

__all__ = [
    "ADJUST_LR",
    "MOMENTUM",
    "ShardedMuon",
    "adjusted_lr",
    "fused_adamw",
    "muon_for",
    "step_unless",
    "zeropower",
]
