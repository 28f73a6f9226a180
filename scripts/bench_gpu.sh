#!/usr/bin/env bash
# One-GPU benchmark, bf16 weights with fp32 masters and fp32 gradient reduction, on a
# Llama-shaped model big enough to keep an H100/H200 busy (dim 2048, 16 layers, 16 heads /
# 8 kv heads, ffn 5632, vocab 32000: ~0.89B parameters; seq 2048 x micro-batch 4 = 8192
# tokens per step). It runs in sections, each inside its own time budget (seconds); the
# default ones (engine, pathcheck, hostcost, profile, guard) finish inside 8 minutes on one H200,
# the engine's step ratios first, so a run cut short still says what matters most:
#
# engine (200)    python -m bench.engine: yatrain (direct path), yatrain-pg (the buffered
#                 path every multi-GPU run takes), yatrain-pg-noclock (the same without the step
#                 clock yatrain pretrain always runs: its cost), a bare PyTorch step and FSDP2,
#                 each in freshly spawned processes with a one-rank NCCL group, interleaved
#                 across repeats. Prints the step ratios as soon as the timing repeats end, then
#                 the memory runs, then the table: tokens/s, MFU (vs the bf16 dense peak, 989
#                 TFLOP/s on H100/H200), peak allocated and reserved CUDA memory, ratios, and the
#                 targets (yatrain-pg step <= 1.0x FSDP2's, peak allocated <= FSDP2's). Then,
#                 for each yatrain contender, the planner's predicted tensors and total beside
#                 the measured peak allocated, peak reserved and device memory in use, with
#                 the ratios: what calibrates the planner's runtime allowance (6 GiB at 80 GB).
# pathcheck (60)  python -m bench.pathcheck, deterministic kernels (train.deterministic):
#                 the buffered path trains 4 steps from the same weights on the same batches as
#                 its direct path (bitwise equal losses required) and as a bare PyTorch step
#                 (autocast; within 1%).
# hostcost (40)   python -m bench.host_cost: host work per step counted on this machine's
#                 CPUs (world 2, gloo): collectives by kind, the engine's ATen ops in every
#                 thread and, on the CUDA path over fake streams, events and stream waits; yatrain
#                 vs FSDP2 on a dim-1024 model.
# profile (60)    python -m bench.host_profile: torch.profiler over 3 steps of the
#                 buffered path: the top 15 host ops by self CPU time, the step's wall time and
#                 the host time in ops.
# guard (90)      python -m bench.guard --device cuda: yatrain pretrain of the tiny recipe on
#                 the GPU, host waits for the device per step (between log steps and at them)
#                 and the median step time, beside the yatrain before the guard decided on
#                 the device (git revision feacf60) when the tree has its git history.
#
# Not in the default list (run them as `--sections NAME,...`):
#
# reductions      the engine section of the previous default: yatrain-chunked (the loss
#                 yatrain pretrain uses) beside yatrain and FSDP2.
# compile (230)   the same benchmark with every decoder layer compiled by inductor: yatrain and
#                 FSDP2, eager and compiled, side by side (train.compile; FSDP2 in torchtitan's
#                 order: checkpointing, torch.compile per block, fully_shard). Each repeat
#                 compiles anew (inductor's cache makes repeats after the first cheaper).
# float8 (200)    train.float8 tensorwise, compiled both: yatrain-float8 (fp8 matmuls and fp8
#                 weight gathers) vs fsdp2-float8 (torchao float8 with its FSDP2 float8
#                 all-gather, scales precomputed after each step, as torchtitan runs it), beside
#                 yatrain-compile and fsdp2-compile in bf16. Needs torchao 0.18.0, torch >= 2.11
#                 and compute capability >= 8.9; without them it says why in one line and skips.
#                 Run it as `--sections float8`.
# sanitizer (240) a few steps of a small model on the engine's CUDA stream path under
#                 TORCH_CUDA_SANITIZER=1 (PyTorch's CUDA sanitizer: each kernel's reads and
#                 writes per stream, checked against the events between streams): the
#                 buffered path of pathcheck on one GPU, two ranks (bench.engine, yatrain)
#                 with two or more. Prints whether the sanitizer reported a race. Not in the
#                 default list; without a GPU it says so in one line and is skipped.
#
# A GPU machine may have its own torch and no torchao, and nothing can be downloaded there:
# bring the wheel with the tree (`pip download torchao==0.18.0 --no-deps -d wheels` here),
# then `pip install --no-deps wheels/torchao-*.whl` there before this script.
#
#   bash scripts/bench_gpu.sh                          # every section
#   bash scripts/bench_gpu.sh --sections compile       # some of them (comma list)
#   bash scripts/bench_gpu.sh --n-layers 8 --repeats 1 # other arguments go to every section
#
# A section that outruns its budget is stopped (its partial output stays) and the next one
# runs. Installs nothing: uses the repo's yatrain if it is not installed and the benchmarks in
# scripts/bench/ (PYTHONPATH=repo root and scripts/).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"

SECTIONS="engine,pathcheck,hostcost,profile,guard"
if [ "${1:-}" = "--sections" ]; then
  SECTIONS="$2"
  shift 2
fi

wanted() { [[ ",$SECTIONS," == *",$1,"* ]]; }

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
  if wanted sanitizer; then echo "== sanitizer: skipped: no CUDA device"; fi
  if [ "$SECTIONS" = sanitizer ]; then exit 0; fi
  echo "no CUDA device: this script needs a GPU"
  exit 1
fi

"$PYTHON" - <<'PY'
import torch
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
PY

SHAPE=(--device cuda --dtype bf16 --reduce-dtype fp32
  --dim 2048 --n-layers 16 --n-heads 16 --n-kv-heads 8 --ffn-dim 5632 --vocab 32000
  --seq-len 2048 --micro-batch 4 --accum 1 --ac-layers 0)

# section NAME BUDGET_S COMMAND...: run it under its budget; 124 = stopped at the budget.
section() {
  local name=$1 budget=$2
  shift 2
  echo "== $name (budget ${budget}s)"
  timeout --signal=INT --kill-after=15 "$budget" "$@"
  local rc=$?
  if [ "$rc" -eq 124 ]; then echo "== $name: stopped at its ${budget}s budget"; fi
  return "$rc"
}

status=0
if wanted engine; then
  section engine 200 "$PYTHON" -m bench.engine --world-size 1 \
    --contenders yatrain,yatrain-pg,yatrain-pg-noclock,bare,fsdp2 \
    --warmup 3 --steps 10 --repeats 2 --mem-steps 2 "${SHAPE[@]}" "$@" || status=1
fi
if wanted pathcheck; then
  section pathcheck 60 "$PYTHON" -m bench.pathcheck "${SHAPE[@]}" "$@" \
    --warmup 0 --steps 4 || status=1
fi
if wanted hostcost; then  # on the CPUs: counts do not depend on the device
  section hostcost 40 "$PYTHON" -m bench.host_cost || status=1
fi
if wanted profile; then
  section profile 60 "$PYTHON" -m bench.host_profile "${SHAPE[@]}" "$@" \
    --warmup 3 --steps 3 || status=1
fi
if wanted guard; then
  baseline=()
  if git cat-file -e feacf60 2>/dev/null; then baseline=(--baseline feacf60); fi
  section guard 90 "$PYTHON" -m bench.guard --device cuda "${baseline[@]}" || status=1
fi
if wanted reductions; then
  section reductions 170 "$PYTHON" -m bench.engine --world-size 1 \
    --contenders yatrain,yatrain-chunked,fsdp2 \
    --warmup 3 --steps 10 --repeats 2 "${SHAPE[@]}" "$@" || status=1
fi
if wanted compile; then
  section compile 230 "$PYTHON" -m bench.engine --world-size 1 \
    --contenders yatrain,yatrain-compile,fsdp2,fsdp2-compile \
    --warmup 3 --steps 10 --repeats 2 "${SHAPE[@]}" "$@" || status=1
fi
if wanted float8; then
  if "$PYTHON" - <<'PY'
import sys

import torch

from yatrain.recipe.config import ModelConfig
from yatrain.models.float8 import Float8Error, check_float8

shape = ModelConfig(dim=2048, n_layers=1, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                    vocab_size=32000, max_seq_len=2048)
try:
    check_float8("tensorwise", torch.device("cuda", 0), shape)
except Float8Error as error:
    print(f"== float8: skipped: {error}")
    sys.exit(1)
PY
  then
    section float8 200 "$PYTHON" -m bench.engine --world-size 1 \
      --contenders yatrain-compile,yatrain-float8,fsdp2-compile,fsdp2-float8 \
      --warmup 3 --steps 10 --repeats 2 "${SHAPE[@]}" "$@" || status=1
  fi
fi
if wanted sanitizer; then
  SMALL=(--device cuda --dtype bf16 --reduce-dtype fp32 --dim 256 --n-layers 2 --n-heads 4
    --n-kv-heads 2 --ffn-dim 512 --vocab 2048 --seq-len 128 --micro-batch 2 --accum 2)
  gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -ge 2 ]; then
    checked=(-m bench.engine --world-size 2 --contenders yatrain --repeats 1)
  else
    checked=(-m bench.pathcheck)  # its yatrain-pg: a one-rank NCCL group
  fi
  log=$(mktemp)
  section sanitizer 240 env TORCH_CUDA_SANITIZER=1 "$PYTHON" "${checked[@]}" "${SMALL[@]}" \
    "$@" --warmup 0 --steps 3 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if grep -q "CSAN detected" "$log"; then
    echo "== sanitizer: a race was reported (CSAN, above)"
    status=1
  elif [ "$rc" -ne 0 ]; then
    echo "== sanitizer: the run failed (rc $rc) without a race report"
    status=1
  else
    echo "== sanitizer: no race reported ($gpus GPU(s))"
  fi
  rm -f "$log"
fi
exit "$status"
