"""Float8 training for Llama (``train.float8``): which matmuls run in fp8, through torchao.

The decoder layers' linear projections (q, k, v, o, gate, up, down) become torchao
``Float8Linear`` modules with dynamic scaling, ``tensorwise`` or ``rowwise`` (torchao's
recipes, as torchtitan uses them); the embedding, the output head, the norms and the loss
stay in the run's dtype. With ``tensorwise`` the engine also gathers those weights in
float8 (``sharding/float8.py``): ``float8_format`` tells it which, and how to bind the
gathered bytes as the weight torchao's matmul takes without casting again. ``rowwise``
gathers in the run dtype: its backward casts the weight along the other axis.

torchao is optional (the ``float8`` extra, pinned): ``check_float8`` refuses at start, in
one line, what cannot run it (torchao missing or of another version, a torch older than it
needs, a GPU below compute capability 8.9), and ``apply_float8`` refuses a projection whose
sizes float8 kernels cannot take. torchao's ``Float8TrainingTensor`` is not a public class;
tests/integration/test_float8.py fails the day its constructor changes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from yatrain.errors import ConfigError
from yatrain.models.llama import build_model
from yatrain.recipe.config import ModelConfig
from yatrain.sharding.float8 import Float8Format

TORCHAO_VERSION = "0.18.0"  # the float8 extra's pin (pyproject.toml)
MIN_TORCH = (2, 11)  # what that torchao needs
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper and newer
ALIGN = 16  # float8 matmul kernels need both sizes of a weight to be multiples of this
FP8 = torch.float8_e4m3fn  # torchao's forward type for weights and inputs


class Float8Error(ConfigError):
    """``train.float8`` cannot run here (the recipe or the machine)."""


def load_torchao() -> ModuleType:
    """``torchao.float8``, imported quietly (its missing-CUDA-kernel and pytree notices are
    not warnings about the run); Float8Error when it is missing or not the pinned one."""
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            torchao = importlib.import_module("torchao")
            float8 = importlib.import_module("torchao.float8")
    except ImportError as error:
        raise Float8Error(
            f"train.float8 needs torchao ({error}): pip install 'yatrain[float8]' "
            f"(torchao=={TORCHAO_VERSION}), or set train.float8: null"
        ) from None
    if torchao.__version__.split("+")[0] != TORCHAO_VERSION:
        raise Float8Error(
            f"train.float8 was tested with torchao {TORCHAO_VERSION}, found "
            f"{torchao.__version__}: pip install torchao=={TORCHAO_VERSION}"
        )
    return float8


def check_float8(name: str | None, device: torch.device, cfg: ModelConfig) -> None:
    """Refuse at start what cannot train in float8: an old torch, no torchao, an old GPU,
    projection sizes float8 kernels cannot take."""
    if name is None:
        return
    _check_sizes(build_model(cfg))
    have = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if have < MIN_TORCH:
        raise Float8Error(
            f"train.float8 needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (torchao "
            f"{TORCHAO_VERSION}); this is torch {torch.__version__}: upgrade torch, or set "
            "train.float8: null"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise Float8Error(
                f"train.float8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or "
                f"newer); {torch.cuda.get_device_name(device)} is {capability[0]}."
                f"{capability[1]}: set train.float8: null"
            )
    load_torchao()


def float8_projections(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The decoder layers' linear projections, with their names in the model."""
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, nn.Linear):
            yield name, module


def apply_float8(model: nn.Module, name: str | None) -> Float8Format | None:
    """Make the decoder layers' projections compute in float8 (``name``: torchao's recipe);
    returns how the engine gathers them in float8 (``tensorwise`` only), else None."""
    if name is None:
        return None
    float8 = load_torchao()
    targets = _check_sizes(model)
    config = float8.Float8LinearConfig.from_recipe_name(name)
    with _quiet("torchao"):
        float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: fqn in targets
        )
    return _format(config) if name == "tensorwise" else None


def _check_sizes(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections, once each is known to suit float8 kernels."""
    targets = dict(float8_projections(model))
    for fqn, linear in targets.items():
        if linear.in_features % ALIGN or linear.out_features % ALIGN:
            raise Float8Error(
                f"train.float8: {fqn} is {linear.out_features} x {linear.in_features}; float8 "
                f"kernels need both sizes to be multiples of {ALIGN}: change model.dim, "
                "model.ffn_dim or the head counts, or set train.float8: null"
            )
    return targets


def _format(config) -> Float8Format:
    """The engine's side of tensorwise float8 gathers, in torchao's numerics."""
    # torchao is an optional extra: imported here, once load_torchao has vouched for it.
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import amax_to_scale

    dtype = config.cast_config_weight.target_dtype

    def gathers_in_fp8(module: nn.Module, attr: str) -> bool:
        return isinstance(module, Float8Linear) and attr == "weight"

    def scale_of(amax: torch.Tensor) -> torch.Tensor:
        return amax_to_scale(amax, dtype, config.round_scales_to_power_of_2)

    def bind(data: torch.Tensor, scale: torch.Tensor, module: nn.Module, orig: torch.dtype):
        return Float8TrainingTensor(
            data, scale, orig, module.linear_mm_config, GemmInputRole.WEIGHT
        )

    return Float8Format(dtype, gathers_in_fp8, scale_of, bind)


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Silence these loggers below ERROR for a moment."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)
