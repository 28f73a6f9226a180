"""What the engine needs of a model, named once.

The engine shards any ``nn.Module`` that lists its *units* (the modules gathered one at a
time, in forward order: for Llama the embedding, each decoder layer, the output head), its
*norm modules* (gathered once per step as one small group), and can initialise one unit at
a time. A model satisfies ``ShardableModel`` by having these methods; it never imports the
engine.

A unit whose backward does not read its own weights (an embedding: its gradient is a
scatter-add of the output gradient) is not gathered again for its backward. A unit module
declares it with a ``backward_reads_weights = False`` attribute; ``nn.Embedding`` needs no
declaration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn


class ShardableModel(Protocol):
    """An ``nn.Module`` the engine can shard (see the module docstring)."""

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...

    def units(self) -> Sequence[nn.Module]:
        """The modules gathered one at a time, in forward order."""
        ...

    def norm_modules(self) -> Sequence[nn.Module]:
        """Modules whose weights form the small group, gathered once per step."""
        ...

    def init_unit_(self, index: int, seed: int) -> None:
        """Initialise unit ``index`` (not its norms) in place; the values may depend only on
        (seed, index), so that every world size builds the same model."""
        ...

    def init_norms_(self) -> None:
        """Initialise every norm module's weights in place."""
        ...


def backward_reads_weights(unit: nn.Module) -> bool:
    """Whether ``unit``'s backward reads its weights (see the module docstring)."""
    declared = getattr(unit, "backward_reads_weights", None)
    if declared is not None:
        return bool(declared)
    return not isinstance(unit, nn.Embedding)


Kept = Mapping[str, tuple[int, int]]  # parameter name -> [lo, hi) of its flat elements


@dataclass(frozen=True)
class InitHooks:
    """How the engine fills freshly materialised parameters: ``unit(i, kept)`` fills unit
    ``i`` (norms excluded), ``norms()`` the norm weights. Called with one unit materialised
    at a time, so a loader (``train.init_from``) can stream weights unit by unit. ``kept``
    names the elements of each parameter this rank keeps (parameters it keeps nothing of
    are absent): a loader may read only those; a random init fills everything (its values
    must not depend on the world size). ``report``: one line on what the fill did (a
    loader: the bytes this rank read), asked once the engine is built."""

    unit: Callable[[int, Kept], None]
    norms: Callable[[], None]
    report: Callable[[], str] | None = None

    @classmethod
    def from_seed(cls, model: ShardableModel, seed: int) -> InitHooks:
        """The model's own random initialisation from ``seed``."""
        return cls(lambda index, kept: model.init_unit_(index, seed), model.init_norms_)
