"""The data path's start-up at corpus sizes users train on, measured on one CPU.

    .venv/bin/python scripts/bench_data_scale.py                 # 1e9 .. 1.5e13 tokens
    .venv/bin/python scripts/bench_data_scale.py --tokens 1e9 1e11
    .venv/bin/python scripts/bench_data_scale.py --baseline 4926443  # beside an older yatrain

For each size a sparse corpus is written (``prepare-data``'s 50M tokens a file, zeros, no
disk used: ``yatrain/testing/sparse_corpus.py``); then a fresh process imports yatrain and
torch, and becomes the last rank of ``recipes/llama3_70b.yaml`` at world 256 (seq 8192): it
builds its loader through ``build_loader`` (what ``pretrain`` calls) and reads its first
batch. Printed per size, over ``--repeats`` processes: the seconds from after the imports to
the first batch (the least, as ``timeit`` reports, and the median: this CPU is shared), the
least CPU time the process spent on it (what neighbours on a shared CPU do not change), and
the median peak RSS beyond the RSS after the imports. Target: both
flat across the range (the largest within 1.2x of the smallest) and under 2 s and 300 MiB.
``--baseline REV`` runs the same rank with the yatrain of git revision REV beside it, up to
``--baseline-max-tokens`` (the code before the lazy files and the per-index order needs 8
bytes a window and a file handle a file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import yatrain_at

REPO = Path(__file__).resolve().parents[1]
TOKENS_PER_FILE = 50_000_000  # prepare-data's default --shard-tokens
WORLD, RANK = 256, 255
RECIPE = REPO / "recipes" / "llama3_70b.yaml"

_RANK = """
import json, sys, time
import torch  # the imports a rank has anyway
from yatrain.data.build import build_loader
from yatrain.recipe.load import load_recipe

def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

recipe = load_recipe(sys.argv[1], [f"data.path={sys.argv[2]}"])
base = status_mib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts here
began, cpu = time.perf_counter(), time.process_time()
loader = build_loader(recipe.data, seed=recipe.train.seed, rank=int(sys.argv[3]),
                      world_size=int(sys.argv[4]))
batches = loader.next_batch()
seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
peak = status_mib("VmHWM") - base
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": peak,
                  "windows": loader.num_windows, "micro_batches": len(batches),
                  "shape": list(batches[0].inputs.shape)}))
"""


def measure(data: Path, package_root: Path = REPO, repeats: int = 1) -> dict:
    """One rank's start-up in fresh processes, importing yatrain from ``package_root``: the
    median of ``repeats`` (milliseconds on a shared CPU are noisy)."""
    results = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", _RANK, str(RECIPE), str(data), str(RANK), str(WORLD)],
            capture_output=True,
            text=True,
            check=True,
            cwd=package_root,  # `python -c` puts the working directory first on sys.path
            env={**os.environ, "PYTHONPATH": str(package_root)},
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    middle = len(results) // 2
    seconds = sorted(r["seconds"] for r in results)
    return {
        **results[0],
        "seconds": seconds[0],  # the least disturbed process: what the code costs
        "median_seconds": seconds[middle],
        "cpu_seconds": min(r["cpu_seconds"] for r in results),  # its own CPU time
        "peak_mib": sorted(r["peak_mib"] for r in results)[middle],
    }


def main() -> None:
    from yatrain.data import default_corpus_files, prepare_data
    from yatrain.testing.sparse_corpus import write_sparse_corpus

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", nargs="*", type=float, default=[1e9, 1e10, 1e11, 1e12, 1.5e13])
    parser.add_argument("--baseline", help="a git revision to measure beside this one")
    parser.add_argument("--baseline-max-tokens", type=float, default=1e12)
    parser.add_argument("--repeats", type=int, default=5, help="processes per size (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="yatrain-data-scale-") as scratch:
        root = Path(scratch)
        source = root / "tokenizer-source"
        prepare_data(source, default_corpus_files(max_bytes=50_000), vocab_size=512, progress=False)
        print(
            f"rank {RANK} of {WORLD}, {RECIPE.name} (seq 8192), {TOKENS_PER_FILE:,} tokens a file"
        )
        baseline = yatrain_at(args.baseline, root / "baseline") if args.baseline else None
        extra = f" | {args.baseline} s | {args.baseline} MiB" if baseline else ""
        print(
            f"| tokens | files | windows | write s | start to first batch s (least) | "
            f"(median) | CPU s (least) | peak RSS MiB{extra} |"
        )
        print("|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|" if baseline else ""))
        rows = []
        for tokens in args.tokens:
            files = max(1, round(tokens / TOKENS_PER_FILE))
            data = root / f"corpus-{files}"
            began = time.perf_counter()
            write_sparse_corpus(data, files, TOKENS_PER_FILE, tokenizer_from=source)
            written = time.perf_counter() - began
            result = measure(data, repeats=args.repeats)
            rows.append(result)
            old = ""
            if baseline is not None and tokens <= args.baseline_max_tokens:
                try:
                    then = measure(data, baseline, args.repeats)
                    old = f" {then['seconds']:.3f} | {then['peak_mib']:.1f} |"
                except subprocess.CalledProcessError as failed:
                    last = (failed.stderr.strip().splitlines() or ["?"])[-1][:60]
                    old = f" failed: {last} | |"
            elif baseline is not None:
                old = " not run | not run |"
            print(
                f"| {files * TOKENS_PER_FILE:.3g} | {files:,} | {result['windows']:,} | "
                f"{written:.1f} | {result['seconds']:.3f} | {result['median_seconds']:.3f} | "
                f"{result['cpu_seconds']:.3f} | {result['peak_mib']:.1f} |{old}",
                flush=True,
            )
            shutil.rmtree(data)  # inodes back before the next size
        slow, fast = max(r["seconds"] for r in rows), min(r["seconds"] for r in rows)
        big, small = max(r["peak_mib"] for r in rows), min(r["peak_mib"] for r in rows)
        cpu = [r["cpu_seconds"] for r in rows]
        print(
            f"largest / smallest: time {slow / fast:.2f}x, CPU time {max(cpu) / min(cpu):.2f}x, "
            f"peak RSS {big / max(small, 1):.2f}x"
        )


if __name__ == "__main__":
    main()
