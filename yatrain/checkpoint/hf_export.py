"""Weights out: Hugging Face export (``train.init_from``, the way in, is ``init_from.py``).

Export streams units (embedding, decoder layer, head) from the checkpoint into safetensors
shards one at a time, so it never holds the whole model.

Nothing read here can run code: our checkpoints go through ``open_checkpoint`` (restricted
unpickling, checksums), Hugging Face weights are read from safetensors only (never
``pytorch_model.bin``, a pickle), and a ``config.json`` we cannot honour is refused.
An export is written to ``.tmp-OUT-PID-XXXX`` and renamed when complete; one left by a killed
export is removed by the next export to the same place. It is never written inside a
checkpoint or a directory of checkpoints (a run's ``checkpoints/``): the run's rotation
(``checkpoint.keep``) deletes old checkpoints with whatever they hold, and a save replaces
``step-N`` and removes ``.tmp-step-*`` there.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from yatrain.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpoint,
    SavedCheckpoint,
    complete_checkpoints,
    open_checkpoint,
    reading,
)
from yatrain.checkpoint.store import iter_full_weights
from yatrain.common import DTYPES, GIB
from yatrain.data import export_tokenizer
from yatrain.errors import ConfigError
from yatrain.models import hf
from yatrain.models.llama import count_parameters
from yatrain.recipe.config import ModelConfig

SHARD_BYTES = 4 * GIB  # per safetensors file (Hugging Face's hub limit is 5 GB)
BF16_ABOVE = 1e9  # parameters: larger models export in bf16 unless --dtype says otherwise


def iter_checkpoint_weights(path: Path, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of a checkpoint in fp32, one unit in memory at a time."""
    yield from iter_full_weights(open_checkpoint(path, verify=verify))


# ---------------------------------------------------------------------- export


def export_hf(
    checkpoint: Path, output: Path, dtype: str | None = None, *, verify: bool = True
) -> Path:
    """A ``LlamaForCausalLM`` directory: config.json, sharded safetensors, the tokenizer."""
    if output.is_symlink():  # replacing it would write where it points, or fail
        raise ConfigError(
            f"--output {output} is a symbolic link (to {os.readlink(output)}): name a new "
            "directory, or the directory it points to"
        )
    _outside_rotation(checkpoint, output)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file: name a new directory")
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"{output} already exists and is not empty: choose another --output")
    with reading(checkpoint):  # a running job's rotation may delete it meanwhile
        _export(checkpoint, output, dtype, verify)
    return output


def _export(checkpoint: Path, output: Path, dtype: str | None, verify: bool) -> None:
    """Write the export into a temporary directory beside ``output``, renamed when whole."""
    saved = open_checkpoint(checkpoint, verify=verify)
    cfg = saved.model
    dtype = dtype or default_export_dtype(cfg, saved.manifest.get("dtype", "fp32"))
    _remove_stale_exports(output)
    tmp = output.parent / f".tmp-{output.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
    except OSError as error:
        raise ConfigError(
            f"cannot write {output} ({error.strerror}): choose another --output"
        ) from None
    try:
        weight_map, total = _write_safetensors(saved, DTYPES[dtype], tmp)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        bos, eos = _copy_tokenizer(saved, tmp)
        (tmp / "config.json").write_text(json.dumps(hf.hf_config(cfg, dtype, bos, eos), indent=1))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=1)
        )
        _same_permissions(tmp, tmp / "config.json")
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(error.errno, error.strerror, str(output)) from None  # not our temporary
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _outside_rotation(checkpoint: Path, output: Path) -> None:
    """ConfigError when ``output`` (links resolved) is a checkpoint, inside one, or inside a
    directory of checkpoints: a run's rotation would delete it, or a save replace it."""
    target = output.resolve()
    for folder in [target, *target.parents]:
        if (folder / MANIFEST).is_file():
            what, root = f"the checkpoint {folder}", folder.parent
        elif complete_checkpoints(folder):
            what, root = f"{folder}, a directory of checkpoints", folder
        else:
            continue
        raise ConfigError(
            f"--output {output} is inside {what}, which a running job's checkpoint.keep "
            "rotation deletes with all it holds: export to a directory outside it, e.g. "
            f"{root.parent / f'hf-{checkpoint.name}'}"
        )


def default_export_dtype(cfg: ModelConfig, trained: str) -> str:
    """bf16 for models over 1B parameters (as Meta publishes them: half the bytes of fp32),
    else the dtype the run trained in."""
    return "bf16" if count_parameters(cfg) > BF16_ABOVE else trained


def _same_permissions(folder: Path, like: Path) -> None:
    """Every file of ``folder`` with the permissions of ``like`` (a file written the usual
    way): safetensors writes its files readable by their owner only."""
    mode = like.stat().st_mode & 0o777
    for file in folder.iterdir():
        os.chmod(file, mode)


def _remove_stale_exports(output: Path) -> None:
    """Delete ``.tmp-OUT-PID-XXXX`` directories whose export process no longer runs."""
    for stale in output.parent.glob(f".tmp-{output.name}-*") if output.parent.is_dir() else []:
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isascii() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _write_safetensors(
    saved: SavedCheckpoint, torch_dtype: torch.dtype, folder: Path
) -> tuple[dict[str, str], int]:
    """Stream units into files of at most SHARD_BYTES; name them once the count is known."""
    parts: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = folder / f"part-{len(parts) + 1:05d}.safetensors"
        try:
            save_file(current, str(path), metadata={"format": "pt"})
        except SafetensorError as error:  # a full disk is an I/O error inside its text
            raise _os_error(error, path) from None
        parts.append((path, list(current)))

    for name, tensor in iter_full_weights(saved):
        key, value = hf.to_hf(name, tensor.to(torch_dtype), saved.model)
        nbytes = value.numel() * value.element_size()
        if current and size + nbytes > SHARD_BYTES:
            flush()
            current, size = {}, 0
        current[key] = value.clone()
        size, total = size + nbytes, total + nbytes
    flush()
    weight_map: dict[str, str] = {}
    for number, (path, keys) in enumerate(parts, start=1):
        final = (
            "model.safetensors"
            if len(parts) == 1
            else (f"model-{number:05d}-of-{len(parts):05d}.safetensors")
        )
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    return weight_map, total


def _os_error(error: SafetensorError, path: Path) -> Exception:
    """The OSError safetensors reports as text (``... (os error 28)``), or ``error``."""
    code = re.search(r"\bos error (\d+)", str(error))
    if code is None:
        return error
    number = int(code.group(1))
    return OSError(number, os.strerror(number), str(path))


def _copy_tokenizer(saved: SavedCheckpoint, folder: Path) -> tuple[int, int]:
    """The checkpoint's tokenizer in Hugging Face form; (BOS, EOS), Llama's 1, 2 for a
    checkpoint saved without one (one whose manifest lists it must still hold it)."""
    found = export_tokenizer(saved.path, folder)
    if found is None and {"tokenizer.json", "tokenizer.model"} & set(saved.manifest["files"]):
        raise CorruptCheckpoint(f"checkpoint {saved.path} is missing its tokenizer")
    return found or (1, 2)
