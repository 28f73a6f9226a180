#!/usr/bin/env bash
# One-GPU benchmark: yatrain engine vs a bare PyTorch step vs PyTorch FSDP2, world size 1,
# bf16 weights with fp32 masters and fp32 gradient reduction, on a Llama-shaped model big
# enough to keep an H100/H200 busy (dim 2048, 16 layers, 16 heads / 8 kv heads, ffn 5632,
# vocab 32000: ~0.89B parameters; seq 2048 x micro-batch 4 = 8192 tokens per step).
#
# Each contender runs in a freshly spawned process with its own one-rank NCCL process group
# (so FSDP2 has a group to shard over), contenders interleaved across repeats. Prints
# tokens/s, MFU (flops_per_token / bf16 dense peak 989 TFLOP/s for H100/H200, from
# yatrain/train/metrics.py), peak allocated and reserved CUDA memory, and ratios vs FSDP2.
#
# Installs nothing: uses the repo's yatrain if it is not installed (PYTHONPATH=repo root).
# Budget: well under 8 minutes on one H200 (hard limit below); extra arguments are passed
# to scripts/bench_engine.py, e.g.  bash scripts/bench_gpu.sh --n-layers 8 --repeats 1
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
  echo "no CUDA device: this script needs a GPU"
  exit 1
fi

"$PYTHON" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
EOF

exec timeout --signal=INT --kill-after=20 470 "$PYTHON" scripts/bench_engine.py \
  --device cuda --world-size 1 --contenders yatrain,bare,fsdp2 \
  --dtype bf16 --reduce-dtype fp32 \
  --dim 2048 --n-layers 16 --n-heads 16 --n-kv-heads 8 --ffn-dim 5632 --vocab 32000 \
  --seq-len 2048 --micro-batch 4 --accum 1 --ac-layers 0 \
  --warmup 3 --steps 15 --repeats 3 \
  "$@"
