"""``yatrain generate``: text from a checkpoint, in one process (the CPU or one GPU).

No engine: the checkpoint's full weights are read one saved unit at a time
(``checkpoint.iter_full_weights``) into a plain model, which ``models.generate`` samples
from with a key/value cache. The prompt is encoded with the checkpoint's own tokenizer and
starts with BOS, as every training document does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from yatrain.checkpoint.manifest import CheckpointError, SavedCheckpoint, open_checkpoint, reading
from yatrain.checkpoint.store import checkpoint_tokenizer, iter_full_weights
from yatrain.common import DTYPES
from yatrain.errors import ConfigError
from yatrain.models.generate import Sampling, generate
from yatrain.models.llama import Llama
from yatrain.runtime.process import launched_world_size
from yatrain.train.build import meta_model


def load_plain_model(saved: SavedCheckpoint, device: torch.device, dtype: torch.dtype) -> Llama:
    """The checkpoint's model, whole, on ``device`` in ``dtype``, filled unit by unit."""
    model = meta_model(saved.model).to(dtype=dtype).to_empty(device=device)
    names = {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        for name, tensor in iter_full_weights(saved):
            model.get_parameter(name).copy_(tensor)
            names.discard(name)
    if names:
        raise CheckpointError(f"checkpoint {saved.path} lacks {sorted(names)[0]} (and maybe more)")
    return model.eval()


def check_sampling(max_new_tokens: int, sampling: Sampling) -> None:
    """Sampling options a user can get wrong, as one line each."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise ConfigError(
            f"--temperature must be 0 (greedy) or a finite positive number, got "
            f"{sampling.temperature}"
        )
    if sampling.top_k is not None and sampling.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {sampling.top_k}")
    if not 0 < sampling.top_p <= 1:  # NaN too
        raise ConfigError(f"--top-p must be above 0 and at most 1, got {sampling.top_p}")


def _check_request(prompt: str, seed: int) -> None:
    """The prompt, the seed and the launch a user can get wrong, as one line each, before
    the checkpoint is read."""
    if not 0 <= seed < 2**64:
        raise ConfigError(f"--seed {seed}: give a whole number from 0 to 2^64-1")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text: pass the prompt in UTF-8") from None
    if launched_world_size() > 1:
        raise ConfigError("yatrain generate runs in one process: run it without torchrun")


def generate_text(
    path: Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    device: str | None = None,
    use_cache: bool = True,
) -> dict:
    """Sample a continuation of ``prompt`` from the checkpoint at ``path``: the prompt's and
    the new token ids, the new text and why it stopped. CPU runs in fp32; a GPU in the
    run's training dtype."""
    check_sampling(max_new_tokens, sampling)
    _check_request(prompt, seed)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with reading(Path(path)):  # a running job's rotation may delete it meanwhile
        saved = open_checkpoint(Path(path))
        tokenizer = checkpoint_tokenizer(saved.path)
        trained = DTYPES[saved.manifest.get("dtype", "fp32")]
        dtype = trained if target.type == "cuda" else torch.float32
        prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        context = saved.model.max_seq_len
        if len(prompt_ids) >= context:
            raise ConfigError(
                f"the prompt is {len(prompt_ids)} tokens with BOS, the model's context is "
                f"{context}: shorten it to leave room for new tokens"
            )
        model = load_plain_model(saved, target, dtype)
    generator = torch.Generator(device=target).manual_seed(seed)
    new_ids, stop = generate(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_id=tokenizer.eos_id,
        generator=generator,
        vocab_limit=tokenizer.vocab_size,
        use_cache=use_cache,
    )
    return {
        "checkpoint": str(saved.path),
        "step": saved.step,
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "new_ids": new_ids,
        "text": tokenizer.decode(new_ids),
        "stop": stop,
        "seed": seed,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "device": str(target),
        "dtype": str(dtype).removeprefix("torch."),
    }
