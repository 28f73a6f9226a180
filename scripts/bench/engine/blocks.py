"""How much of a step the decoder blocks take: the bound on what compiling them can gain.

The blocks' forward and backward are timed alone, eagerly, in one process with a rank's
thread budget, on an input of one micro-batch's shape, once per decoder layer of a step
(micro-batches x layers); the share is that time over the eager yatrain step's median. The
rest of the step (embedding, output head and loss, gathers, reductions, the optimizer) is
what compile leaves as it is.
"""

from __future__ import annotations

import time

import torch

from bench.engine.contenders import model_config
from bench.measure import median
from yatrain.common import DTYPES
from yatrain.models.llama import DecoderLayer, rope_cos_sin


def block_seconds(o: dict, repeats: int = 5) -> float:
    """Median seconds of one step's worth of decoder-block forward + backward, eager."""
    torch.set_num_threads(o["threads"])
    cfg = model_config(o)
    dtype = DTYPES[o["dtype"]]
    layer = DecoderLayer(cfg).to(dtype)
    cos, sin = rope_cos_sin(cfg.head_dim, o["seq_len"], cfg.rope_theta, "cpu")
    x = torch.randn(o["micro_batch"], o["seq_len"], cfg.dim, dtype=dtype, requires_grad=True)
    calls = o["accum"] * cfg.n_layers
    times = []
    for _ in range(repeats + 1):  # the first warms the allocator and kernels up
        start = time.perf_counter()
        for _ in range(calls):
            layer(x, cos, sin).sum().backward()
        times.append(time.perf_counter() - start)
    return median(times[1:])
