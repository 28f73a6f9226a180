"""Regional compilation: each decoder layer's forward function is compiled, the engine stays eager.

The forward *function* is compiled, never the module: compiling a module traces its forward
hooks, which are the engine's gathers and backward gates, into the graph. Here the hooks run
eagerly around the compiled function: a layer's weights are bound as views of a gather buffer
before it runs, and its gradients leave through the engine's hooks after. ``fullgraph=True``:
a layer compiles whole or the run stops at its first step, never a silent graph break.

One graph serves every layer of the same shape. Dynamo caches compiled code per code object
(``DecoderLayer.forward``) and, with nn modules inlined (always on in torch >= 2.6), takes a
layer's weights as graph inputs guarded by shape, stride and dtype, not identity: rebinding
them to the other gather buffer, or another layer's, costs no recompile. Compile time does
not grow with depth; a no-grad evaluation compiles one more graph.

``CompileWatch`` counts and times every compilation (dynamo's compile callbacks), so the run
logs "compiled N graphs in X s" once, leaves that time out of the step time, and reports any
graph compiled after warm-up (a recompile) in its summary. While it is open inductor keeps
its code in the run's compile cache (runtime/compile_cache.py: private, never the run
directory).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch._dynamo.callback as dynamo_callback
from torch import nn

from yatrain.errors import ConfigError
from yatrain.runtime.compile_cache import cxx_compiler, restore_inductor_cache, use_inductor_cache


def compile_layers(
    layers: Iterable[nn.Module], backend: str, *, eager_attention: bool = False
) -> None:
    """Replace each layer's ``forward`` by its compiled version (the module, its hooks and its
    parameters stay as they are). With ``eager_attention`` (context parallelism: attention
    all-gathers keys and values across ranks, an eager collective that would break a full
    graph) each layer's two norms and its feed-forward are compiled instead, and its
    attention, collectives included, runs eagerly between them."""
    for layer in layers:
        parts = [layer.attention_norm, layer.ffn_norm, layer.feed_forward]
        for part in parts if eager_attention else [layer]:
            part.forward = torch.compile(
                part.forward, backend=backend, fullgraph=True, dynamic=False
            )


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse at start what would fail at the first step: inductor needs a C++ compiler to
    build CPU kernels, and Triton for GPU kernels."""
    if backend != "inductor":
        return
    if device.type == "cpu":
        compiler = cxx_compiler()
        if shutil.which(compiler) is None and shutil.which("clang++") is None:
            raise ConfigError(
                f"train.compile with the inductor backend builds C++ kernels on CPU, and no C++ "
                f"compiler ({compiler} or clang++) was found: install one (apt-get install g++), "
                "or set train.compile_backend: aot_eager, or train.compile: false"
            )
    elif device.type == "cuda" and not _has_triton():
        raise ConfigError(
            "train.compile with the inductor backend needs Triton on GPUs and it is not "
            "installed: pip install triton (the CUDA torch wheels bring it), or set "
            "train.compile: false"
        )


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401  (only its presence matters)
    except ImportError:
        return False
    return True


class CompileWatch:
    """Every compilation in this process while the watch is open: how many graphs, how long.

    Graphs compiled during the warm-up (``warming_up``: the first step, the first
    evaluation) are expected; any graph after that is a recompile, which costs seconds each
    time it happens and is counted in ``recompiles``."""

    def __init__(self, backend: str, cache_dir: Path) -> None:
        self.backend, self.cache_dir = backend, cache_dir
        self.graphs, self.seconds, self.warm_graphs = 0, 0.0, 0
        self._unreported_s, self._started = 0.0, 0.0
        # Inductor reads its cache directory from the environment at each use; importing
        # dynamo already set the variable (to the command line's private default, or to
        # torch's under /tmp): the run's cache replaces it while the run lasts.
        self._previous_cache = use_inductor_cache(cache_dir)
        dynamo_callback.callback_handler.register_start_callback(self._start)
        dynamo_callback.callback_handler.register_end_callback(self._end)

    def _start(self, args: dynamo_callback.CallbackArgs) -> None:
        self._started = time.perf_counter()

    def _end(self, args: dynamo_callback.CallbackArgs) -> None:
        seconds = time.perf_counter() - self._started
        self.seconds += seconds
        self._unreported_s += seconds
        if args.callback_trigger == dynamo_callback.CallbackTrigger.DYNAMO:
            self.graphs += 1  # one frame, one graph (fullgraph); lazy backward compiles add time

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Graphs compiled inside are warm-up, not recompiles."""
        before = self.graphs
        yield
        self.warm_graphs += self.graphs - before

    @property
    def recompiles(self) -> int:
        return self.graphs - self.warm_graphs

    def take_seconds(self) -> float:
        """Compile time since the last call (the loop leaves it out of the step time)."""
        seconds, self._unreported_s = self._unreported_s, 0.0
        return seconds

    def describe(self) -> str:
        where = f", cache {self.cache_dir}" if self.backend == "inductor" else ""
        return (
            f"compiled {self.graphs} graph{'s' * (self.graphs != 1)} in {self.seconds:.1f}s "
            f"(train.compile, backend {self.backend}{where}); left out of the step time"
        )

    def summary(self) -> dict:
        return {
            "compile_graphs": self.graphs,
            "compile_s": round(self.seconds, 3),
            "recompiles": self.recompiles,
        }

    def close(self) -> None:
        """Stop counting; give the inductor cache setting back as it was."""
        handler = dynamo_callback.callback_handler
        handler.remove_start_callback(self._start)
        handler.remove_end_callback(self._end)
        restore_inductor_cache(self._previous_cache)
