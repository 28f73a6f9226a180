"""``prepare-data --shard I/N``: one part of a corpus tokenized on one machine of many.

Every task computes the same plan (``partition``) and tokenizes its part into
``OUTPUT/parts/part-IIIII-of-NNNNN``, a complete data directory of its own written like a
one-machine run (a temporary directory renamed into place when its manifest is written):
that rename is the part's completion marker. The part's manifest records the plan's digest,
the options and the command that makes it, which the merge (``merge``) checks. A rerun of a
finished part does nothing and says so; a killed part left only its temporary directory,
which the rerun removes before doing the part again.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from yatrain.data.corpus import Corpus
from yatrain.data.partition import plan_parts, plan_sha256
from yatrain.data.prepare import Options, build_into, check_workers, tokenize
from yatrain.data.shards import FORMAT, MANIFEST, load_manifest
from yatrain.data.split import DEFAULT_VAL_FRACTION
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.errors import DataError

PARTS = "parts"  # the folder of the parts inside the output directory
_SHARD = re.compile(r"(\d+)/(\d+)")


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` (0 <= I < N) as (I, N)."""
    match = _SHARD.fullmatch(text.strip())
    if match is None or not 0 <= int(match[1]) < int(match[2]):
        raise DataError(
            f"--shard {text!r}: pass I/N with 0 <= I < N, e.g. --shard $SLURM_ARRAY_TASK_ID/64 "
            "in a SLURM array of 64 tasks"
        )
    return int(match[1]), int(match[2])


def part_command(options: dict, output: Path, index: int, count: int) -> str:
    """The command that makes part ``index`` of ``count`` with these options."""
    words = ["yatrain", "prepare-data", "--output", str(output)]
    for path in options["inputs"]:
        words += ["--input", path]
    words += ["--tokenizer", options["tokenizer"]]
    if options["text_field"] != "text":
        words += ["--text-field", options["text_field"]]
    if options["skip_bad_records"]:
        words.append("--skip-bad-records")
    for flag, key in [("--bos-token", "bos_token"), ("--eos-token", "eos_token")]:
        if options[key] is not None:
            words += [flag, options[key]]
    words += ["--val-fraction", str(options["val_fraction"]), "--shard", f"{index}/{count}"]
    return shlex.join(words)


def prepare_part(
    output: Path,
    inputs: list[Path] | None,
    tokenizer: Path,
    shard: tuple[int, int],
    shard_tokens: int = 50_000_000,
    progress: bool = True,
    *,
    text_field: str = "text",
    skip_bad_records: bool = False,
    workers: int | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    encode_threads: int = 1,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> dict:
    """Tokenize part ``shard = (I, N)`` of ``inputs`` into ``output``/parts (see the module
    docstring); returns its manifest."""
    output, (index, count) = Path(output), shard
    _check_options(val_fraction, shard_tokens)
    workers = check_workers(workers)
    corpus = Corpus(inputs, text_field=text_field, skip_bad_records=skip_bad_records)
    plan = plan_parts(corpus.files, count, split_text=not skip_bad_records)
    options = dict(
        inputs=[str(p) for p in inputs] if inputs is not None else [],
        tokenizer=str(tokenizer),
        text_field=text_field,
        skip_bad_records=skip_bad_records,
        bos_token=bos_token,
        eos_token=eos_token,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
    )
    digest = plan_sha256(corpus.files, plan)
    info = {"index": index, "count": count, "plan_sha256": digest, "options": options}
    source = load_tokenizer(tokenizer, bos_token, eos_token)
    final = output / PARTS / part_name(index, count)
    if (final / MANIFEST).is_file():
        return _finished(final, info, source.sha256)
    if (output / MANIFEST).is_file():
        raise DataError(
            f"output {output} already holds prepared data without part {index}/{count}: "
            "choose another --output"
        )
    corpus.pieces = plan[index]

    def build(tmp: Path) -> dict:
        manifest = {
            "format": FORMAT,
            **source.describe(),
            "tokenizer_files": source.save(tmp),
            "part": info,
        }
        settings = Options(shard_tokens, workers, encode_threads, progress, val_fraction)
        print(f"part {index}/{count}: {len(plan[index])} piece(s) of input", file=sys.stderr)
        return tokenize(tmp, manifest, corpus, source, settings, whole=False)

    return build_into(final, build)


def _check_options(val_fraction: float, shard_tokens: int) -> None:
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be at least 0 and below 1, got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")


def _finished(final: Path, info: dict, tokenizer_sha256: str) -> dict:
    """A part that is already complete: nothing to do, if it is this very part."""
    manifest = load_manifest(final)
    differs = different(manifest, info, tokenizer_sha256)
    if differs:
        raise DataError(
            f"{final} holds part {info['index']}/{info['count']} of other inputs or options "
            f"({differs} differ): delete {final} or choose another --output"
        )
    print(f"part {info['index']}/{info['count']} is already complete at {final}: nothing to do")
    return manifest


def different(manifest: dict, info: dict, tokenizer_sha256: str) -> str:
    """What differs between a part's manifest and the part ``info`` describes ('' if
    nothing): its plan (inputs), its options or its tokenizer."""
    part = manifest.get("part")
    if not isinstance(part, dict):
        return "the part record"
    found = [
        name
        for name, same in [
            ("the number of parts", part.get("count") == info["count"]),
            ("the inputs (plan_sha256)", part.get("plan_sha256") == info["plan_sha256"]),
            ("the options", _comparable(part.get("options")) == _comparable(info["options"])),
            ("the tokenizer", manifest.get("tokenizer_sha256") == tokenizer_sha256),
        ]
        if not same
    ]
    return ", ".join(found)


def _comparable(options: object) -> object:
    """Options as compared between parts (the tokenizer's path may differ: its hash counts)."""
    if not isinstance(options, dict):
        return options
    return {k: v for k, v in options.items() if k != "tokenizer"}
