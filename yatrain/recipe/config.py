"""The recipe schema: one YAML file fully describes a training run.

A recipe is parsed into plain dataclasses and validated completely before any work starts, so a
typo or an impossible shape fails in a second with one line naming the key, instead of an hour
into a job. The schema is the dataclasses below: field names are the YAML keys, field types
drive the type checks (``schema.build_dataclass``), and ``_limit`` gives the allowed ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from yatrain.recipe.schema import limit as _limit
from yatrain.recipe.schema import to_dict

LOSS_CHUNK_TOKENS = 512  # train.loss_chunk_tokens: 0.37 GiB of bf16-run logits at 128K vocab

# ----------------------------------------------------------------------------- schema


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (rope_type llama3), keys spelled as in config.json:
    wavelengths above original / low_freq_factor are divided by factor, those below
    original / high_freq_factor are kept, the band between is interpolated."""

    factor: float = _limit(gt=0)  # Llama 3.1: 8, Llama 3.2: 32
    low_freq_factor: float = _limit(1.0, gt=0)
    high_freq_factor: float = _limit(4.0, gt=0)  # > low_freq_factor
    # The pretraining context; bounded so the rotary arithmetic stays in int64 and fp32.
    original_max_position_embeddings: int = _limit(8192, ge=1, le=2**31)
    rope_type: Literal["llama3"] = "llama3"  # config.json's spelling; the only type read


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of a Llama 2/3 decoder."""

    # Upper bounds: shapes no device holds fail here, not in the allocator (the largest
    # Llama, 405B, has dim 16384, 126 layers, ffn 53248, vocab 128256).
    dim: int = _limit(ge=1, cap=2**17)
    n_layers: int = _limit(ge=1, cap=2**11)
    n_heads: int = _limit(ge=1, cap=2**12)
    n_kv_heads: int = _limit(ge=1, cap=2**12)  # < n_heads means grouped-query attention
    ffn_dim: int = _limit(ge=1, cap=2**20)
    vocab_size: int = _limit(ge=1, cap=2**24)
    rope_theta: float = _limit(10000.0, gt=0)
    norm_eps: float = _limit(1e-5, gt=0)
    max_seq_len: int = _limit(ge=1)
    rope_scaling: RopeScaling | None = None  # null = plain RoPE (Llama 2/3); Llama 3.1/3.2 set it
    # true: the output head is the embedding matrix (one weight; Llama 3.2 1B/3B)
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(kw_only=True)
class DataSource:
    """One prepared data directory of a weighted mixture."""

    path: str
    weight: float = _limit(gt=0)  # share of training windows (weights are normalised)
    name: str | None = None  # its name in logs (val_loss/NAME); default: the directory's name

    @property
    def label(self) -> str:
        return self.name if self.name is not None else Path(self.path).name


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokenized data lives and how it is batched (batch sizes are in sequences)."""

    # tokenized data dir; relative paths are relative to the current directory
    path: str | None = None
    sources: list[DataSource] | None = None  # instead of path: a weighted mixture of dirs
    # Held-out data for evaluation: a data directory (its validation split, or all of it if
    # it has none); None = the validation split of path (of each source in a mixture).
    val_path: str | None = None
    tokenizer: str | None = None  # None = the tokenizer stored with the data
    seq_len: int = _limit(ge=1)
    micro_batch_size: int = _limit(ge=1)  # sequences per GPU per forward/backward
    global_batch_size: int = _limit(ge=1)  # sequences per optimizer step, all GPUs together
    document_mask: bool = False  # attention stays within each document of a packed window
    restart_positions: bool = False  # with document_mask: positions restart at 0 per document

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches each rank runs per optimizer step (see topology.validate_world_size)."""
        return self.global_batch_size // (self.micro_batch_size * world_size)


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = _limit(ge=1)  # total optimizer steps of the run
    seed: int = _limit(0, ge=0)
    dtype: Literal["bf16", "fp32"] = "bf16"
    log_every: int = _limit(1, ge=1)
    # On a non-finite loss or gradient norm: stop (false) or skip that step's update (true).
    skip_nonfinite_steps: bool = False
    # Start from these weights instead of random init: a Hugging Face Llama directory or a
    # yatrain checkpoint (weights only; optimizer and data position start fresh).
    init_from: str | None = None
    # Tokens per chunk of the fused output head + loss: logits of one chunk at a time.
    loss_chunk_tokens: int = _limit(LOSS_CHUNK_TOKENS, ge=1)
    # Trace N steps (after 2) with torch.profiler into RUN_DIR/profile/; 0 = off.
    profile: int = _limit(0, ge=0)
    # torch.compile each decoder layer's forward (the engine's gathers and reductions stay
    # eager around it); the first step pays the compile (docs/compile_and_float8.md)
    compile: bool = False
    # The torch.compile backend: inductor generates kernels (C++ on CPU, Triton on GPUs);
    # aot_eager traces the same graphs with the same guards but runs eager kernels (debugging).
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # Where inductor keeps the code it compiles; null = a private per-user cache (0700,
    # ~/.cache/yatrain/inductor), never the run directory. A compile cache is code: share it
    # only with people you would let run code as you (runtime/compile_cache.py).
    compile_cache: str | None = None
    # The decoder layers' projections compute in float8 through torchao (models/float8.py):
    # null = off; tensorwise also gathers those weights in float8 (half a bf16 gather).
    float8: Literal["tensorwise", "rowwise"] | None = None
    # Under torchrun: a step (or a save) stuck this long in a collective (a rank hung or
    # died) ends the run with one line naming the step and the rank, instead of hanging.
    collective_timeout_s: float = _limit(600.0, gt=0)
    # Deterministic kernels (torch.use_deterministic_algorithms, strict; cuBLAS and cuDNN
    # settings made before CUDA starts): the same bits run after run on a GPU, a little
    # slower; a CPU is deterministic anyway (runtime/determinism.py).
    deterministic: bool = False


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up then a decay from lr to min_lr (train/schedule.py)."""

    lr: float = _limit(gt=0)
    min_lr: float = _limit(0.0, ge=0)
    warmup_steps: int = _limit(0, ge=0)  # may exceed train.steps: the run just stays in warm-up
    # After warm-up: cosine to min_lr; wsd: lr, then decay over the last decay_fraction of
    # the steps; constant: lr throughout (continued pretraining at a fixed rate)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = _limit(0.2, gt=0, le=1)  # wsd: share of train.steps spent decaying
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"  # wsd: the decay's curve
    weight_decay: float = _limit(0.1, ge=0)
    beta1: float = _limit(0.9, ge=0, lt=1)
    beta2: float = _limit(0.95, ge=0, lt=1)
    eps: float = _limit(1e-8, gt=0)
    grad_clip: float = _limit(1.0, ge=0)  # max global grad norm; 0 = off
    # adamw: AdamW for every weight; muon: Muon for each decoder layer's seven projection
    # matrices, AdamW (the keys above) for the embedding, the output head and the norms
    name: Literal["adamw", "muon"] = "adamw"
    # Muon's keys (name: muon only; null = the default in MUON_DEFAULTS):
    muon_lr: float | None = _limit(None, gt=0)  # null = lr; the schedule scales both alike
    muon_momentum: float | None = _limit(None, ge=0, lt=1)  # null = 0.95
    muon_nesterov: bool | None = None  # null = true
    muon_ns_steps: int | None = _limit(None, ge=1, le=99)  # Newton-Schulz iterations; null = 5
    muon_ns_dtype: Literal["bf16", "fp32"] | None = None  # orthogonalise in; null = bf16
    # match_rms_adamw (null): lr and weight_decay carry over from AdamW; original: Keller
    # Jordan's, which wants a muon_lr near 0.02
    muon_adjust_lr: Literal["match_rms_adamw", "original"] | None = None
    # Hybrid sharding: split (null): one owner per matrix in the world sends its result to
    # every replica; repeat: each replica orthogonalises every matrix (no traffic across)
    muon_hsdp: Literal["split", "repeat"] | None = None
    # Muon's exchange in buckets of consecutive decoder layers, about this many MiB of whole
    # matrices each in muon_ns_dtype (one layer at least), overlapped with the Newton-Schulz
    # of the bucket before; null = 256
    muon_bucket_mib: float | None = _limit(None, gt=0, le=2**20)  # <= 1 TiB

    def muon(self) -> dict:
        """Muon's settings, the nulls resolved (``MUON_DEFAULTS``; ``lr``: ``muon_lr``)."""
        keys = {k: getattr(self, f"muon_{k}") for k in MUON_DEFAULTS}
        resolved = {k: MUON_DEFAULTS[k] if v is None else v for k, v in keys.items()}
        return {**resolved, "lr": self.lr if self.muon_lr is None else self.muon_lr}


# What a null Muon key means (torch.optim.Muon's defaults, Moonshot's rate adjustment).
MUON_DEFAULTS = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_dtype": "bf16",
    "adjust_lr": "match_rms_adamw",
    "hsdp": "split",
    "bucket_mib": 256,
}
MUON_KEYS = ("muon_lr", *(f"muon_{k}" for k in MUON_DEFAULTS))


# A smaller reduce-scatter staging budget cuts each unit's gradient into so many collectives
# (one per column at a byte) that a step never ends; 1 MiB is still thousands per layer.
STAGING_MIN_MIB = 1
# sharding.gpu_memory_gib's bounds, as ``yatrain plan --gpu-memory``'s (a MiB to a PiB):
# beyond them a value is a typo, and 5% of 1e30 GiB is a fragmentation allowance.
GPU_GIB_MIN, GPU_GIB_MAX = 0.001, 2**20


@dataclass(kw_only=True)
class ShardingConfig:
    # Checkpoint the FIRST N decoder layers; "auto" = the fewest that fit the device memory
    # (the memory planner decides at start-up and logs its choice).
    activation_checkpoint_layers: int | Literal["auto"] = _limit(0, ge=0)
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # dtype of the gradient reduce-scatter
    prefetch_depth: int = _limit(1, ge=1)  # how many units ahead to all-gather
    # Reduce-scatter staging budget in MiB: one reduce-scatter per unit wherever its gradient
    # in the reduce dtype fits, else the fewest equal pieces that do; "auto" = max(256 MiB,
    # 1% of the device's memory) (sharding/sizes.py); at least STAGING_MIN_MIB.
    reduce_staging_mib: float | Literal["auto"] = _limit("auto", gt=0, le=2**20)  # <= 1 TiB
    # Device memory "auto" plans against; None = the GPU's total memory (a CPU has no limit).
    # From GPU_GIB_MIN to GPU_GIB_MAX, checked by checks._check_gpu_memory (one line naming
    # both bounds, which a schema bound cannot for a value below its lower one).
    gpu_memory_gib: float | None = None
    # true: one process also runs the multi-rank path in a one-rank group (checks it on one
    # GPU; same results as its direct path, slower).
    force_process_group: bool = False
    # Hybrid sharding: shard each layer within groups of N ranks, replicate across groups
    # (N = GPUs per node; "auto" = torchrun's local world size); None = the whole world.
    shard_group_size: int | Literal["auto"] | None = _limit(None, ge=1)
    # Context parallelism: each window is cut into 2 x N chunks over N ranks (Llama 3's
    # all-gather method: K/V gathered per layer); the world is data x N, weights stay sharded
    # over all ranks. N divides the world and the shard group; seq_len a multiple of 2 x N.
    context_parallel: int = _limit(1, ge=1)


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "checkpoints"  # relative to the run dir
    every: int = _limit(0, ge=0)  # save every N steps; 0 = only at the end
    keep: int = _limit(2, ge=1)  # how many recent checkpoints to keep
    enabled: bool = True  # false: never save (measurement runs such as sweeps)
    # true: a save blocks only while the state is copied to host memory (YAML key: async)
    async_: bool = _limit(False, key="async")

    @property
    def background(self) -> bool:
        """Saves are written in the background (a run that saves at all, asynchronously)."""
        return self.async_ and self.enabled


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out loss during training: the first ``batches`` global batches of windows of the
    held-out stream, in order, every ``every`` steps (docs/evaluation.md)."""

    every: int = _limit(0, ge=0)  # evaluate every N steps; 0 = never during the run
    batches: int = _limit(8, ge=1)  # global batches (x data.global_batch_size windows) per eval
    at_end: bool = False  # also evaluate after the last step


@dataclass(kw_only=True)
class WandbConfig:
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "yatrain"
    entity: str | None = None


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Also write TensorBoard event files to RUN_DIR/tensorboard (the same fields as W&B;
    # needs the optional extra: pip install 'yatrain[tensorboard]').
    tensorboard: bool = False


@dataclass(kw_only=True)
class Recipe:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def evaluates(self) -> bool:
        """Does the run evaluate on held-out data (periodically or at the end)?"""
        return self.eval.every > 0 or self.eval.at_end


# ----------------------------------------------------------------------------- loading


def recipe_to_dict(r: Recipe) -> dict:
    """Plain nested dicts of a Recipe; recipe_from_dict(recipe_to_dict(r)) == r."""
    return to_dict(r)


def recipe_to_yaml(r: Recipe) -> str:
    """The fully resolved recipe as YAML, keys in schema order (a run's config.yaml)."""
    return yaml.safe_dump(recipe_to_dict(r), sort_keys=False)
