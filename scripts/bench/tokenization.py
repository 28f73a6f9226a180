"""Tokenization throughput of `prepare-data`: 1 vs 2 worker processes, sentencepiece and
tiktoken, side by side on the stdlib corpus, against sentencepiece's own multithreaded
batch encode in one process.

Every contender runs prepare-data's tokenizing stage (read the corpus, tokenize it, write
the shards, worker start-up included) into a fresh directory; tokens/s = tokens written /
wall time of that stage, as its progress bar shows. Loading the tokenizer, once per run, is
timed separately. Each run reads the corpus `--passes` times (default 3: a single pass of
this 11 MB corpus lasts well under a second with tiktoken, so start-up would dominate).
Contenders run interleaved, `--repeats` rounds, and the table shows medians (min..max).
Workers encode on one thread each.

No download: the sentencepiece model (Llama 2's size, 32,000 pieces) is trained on the
corpus, and the tiktoken ranks file is made the same way: a byte-level BPE with Llama 3's
pre-tokenization pattern trained with `tokenizers` on the corpus, written in tiktoken's
`base64 rank` format (Llama 3's own file has 128,000 ranks; `--tiktoken-vocab`). Both are
cached in `--work-dir`.

    python scripts/bench_tokenize.py --repeats 5 [--passes 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from yatrain.data import Corpus, Tokenizer, default_corpus_files, load_tokenizer, train_tokenizer
from yatrain.data.parallel import default_workers
from yatrain.data.prepare import tokenize_into
from yatrain.testing.bpe import byte_level_bpe, write_tiktoken_ranks

REPO = Path(__file__).resolve().parents[2]


def run(files: list[Path], tokenizer: Tokenizer, workers: int, threads: int, tmp: Path) -> float:
    """tokens/s of reading, tokenizing and writing the corpus (prepare-data's main stage)."""
    out = tmp / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    return tokenize_into(out, Corpus(files), tokenizer, 50_000_000, workers, threads).tokens_per_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-bytes", type=int, default=24_000_000, help="stdlib corpus size")
    p.add_argument(
        "--passes",
        type=int,
        default=3,
        help="read the corpus this many times per run, so the ~50 ms of worker start-up and "
        "the last chunk's tail weigh as little as on a real corpus (1: a single pass)",
    )
    p.add_argument("--sp-vocab", type=int, default=32_000)
    p.add_argument("--tiktoken-vocab", type=int, default=128_000)
    p.add_argument("--work-dir", type=Path, default=REPO / "data" / "bench-tokenize")
    return p.parse_args(argv)


def tokenizer_files(args: argparse.Namespace, files: list[Path], size: int) -> tuple[Path, Path]:
    """The sentencepiece model and the tiktoken ranks file, trained once and cached."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    sp = args.work_dir / f"sp-{args.sp_vocab}-{size}.model"
    if not sp.is_file():
        print(f"training a {args.sp_vocab}-piece sentencepiece model ...", flush=True)
        train_tokenizer(Corpus(files).documents(), sp.with_suffix(""), args.sp_vocab)
    tt = args.work_dir / f"tiktoken-{args.tiktoken_vocab}-{size}.model"
    if not tt.is_file():
        print(f"training a {args.tiktoken_vocab}-rank tiktoken BPE file ...", flush=True)
        write_tiktoken_ranks(byte_level_bpe(Corpus(files).documents(), args.tiktoken_vocab), tt)
    return sp, tt


def report(rates: dict[str, list[float]], default: str, baseline: str, cores: int) -> None:
    med = {name: statistics.median(values) for name, values in rates.items()}
    print("\n| contender | tokens/s (median) | min..max |\n|---|--:|--:|")
    for name, values in rates.items():
        print(f"| {name} | {med[name]:,.0f} | {min(values):,.0f}..{max(values):,.0f} |")
    for kind in ("sentencepiece", "tiktoken"):
        ratio = med[f"{kind}, 2 workers"] / med[f"{kind}, 1 worker"]
        print(f"{kind}: 2 workers / 1 worker = {ratio:.2f}x (target >= 1.6x)")
    print(
        f"sentencepiece: default --workers ({cores}) / its own {cores}-thread batch encode in "
        f"one process = {med[default] / med[baseline]:.2f}x (target >= 1.0x)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    files = default_corpus_files(max_bytes=args.max_bytes)
    size = sum(f.stat().st_size for f in files)
    sp, tt = tokenizer_files(args, files, size)
    ranks = sum(1 for _ in tt.open())
    loaded = {}
    for path in (sp, tt):
        start = time.perf_counter()
        loaded[path] = load_tokenizer(path)
        print(f"loading {path.name}: {time.perf_counter() - start:.2f}s (once per run)")
    cores = default_workers()
    baseline = f"sentencepiece, 1 process, own batch encode on {cores} threads"
    default = f"sentencepiece, {cores} workers" if cores != 2 else "sentencepiece, 2 workers"
    contenders = {
        "sentencepiece, 1 worker": (sp, 1, 1),
        "sentencepiece, 2 workers": (sp, 2, 1),
        default: (sp, cores, 1),  # the default --workers (the same row on 2 cores)
        baseline: (sp, 1, cores),
        "tiktoken, 1 worker": (tt, 1, 1),
        "tiktoken, 2 workers": (tt, 2, 1),
    }
    print(
        f"bench_tokenize: stdlib corpus {len(files)} files, {size / 1e6:.1f} MB | sentencepiece "
        f"{args.sp_vocab} pieces | tiktoken {ranks} ranks + 256 specials | {cores} cores "
        f"(default --workers {cores}) | {args.passes} pass(es) per run | {args.repeats} "
        "interleaved rounds",
        flush=True,
    )
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        for round_ in range(args.repeats):
            for name, (tok, workers, threads) in contenders.items():
                inputs = files * args.passes
                rates[name].append(run(inputs, loaded[tok], workers, threads, Path(tmp)))
                print(f"  round {round_ + 1} {name}: {rates[name][-1]:,.0f} tokens/s", flush=True)
    report(rates, default, baseline, cores)


if __name__ == "__main__":
    sys.exit(main())
