"""``prepare-data --shard I/N``: one part of a corpus tokenized on one machine of many.

Every task computes the same plan (``partition``) and tokenizes its part into
``OUTPUT/parts/part-IIIII-of-NNNNN``, a complete data directory of its own written like a
one-machine run (a temporary directory renamed into place when its manifest is written):
that rename is the part's completion marker. The part's manifest records the plan's digest,
the options and the part's two cuts, which the merge (``merge``) checks. A task looks only
at its own two cuts, so planning costs the same for any N (at most ``MAX_PARTS``). A rerun
of a finished part does nothing and says so, and so does a task that finds its part renamed
into place by another task of the same part meanwhile; a killed part left only its
temporary directory, which the rerun removes before doing the part again.

OUTPUT holds only what prepare-data writes there (``check_part_output``): ``parts/``, then
the merge's ``manifest.json`` and tokenizer files. Anything else there, or a link in their
place, is refused before any work, so the merge never writes over a user's file.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from yatrain.data.corpus import Corpus
from yatrain.data.file_index import INDEX_FILES
from yatrain.data.manifest import FORMAT, MANIFEST, load_manifest
from yatrain.data.partition import part_cuts, part_pieces, plan_sha256
from yatrain.data.prepare import (
    Options,
    OutputAppeared,
    build_into,
    check_outside_inputs,
    check_workers,
    tokenize,
)
from yatrain.data.split import DEFAULT_VAL_FRACTION
from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.errors import DataError

PARTS = "parts"  # the folder of the parts inside the output directory
MAX_PARTS = 99_999  # part folders are numbered in 5 digits (part-IIIII-of-NNNNN)
FINAL = re.compile(r"part-(\d{5})-of-(\d{5})")
TEMPORARY = re.compile(r"\.tmp-part-(\d{5})-of-(\d{5})-[0-9a-f]+")
# What the merge writes at the top of OUTPUT (a tokenizer's files are one of the three
# kinds' names), and the temporary names it writes them under.
WRITTEN = {MANIFEST, "tokenizer.model", "tokenizer.json", "tokenizer_config.json", *INDEX_FILES}
_WRITING = re.compile(r"\.(.+)\.tmp-\d+")
_SHARD = re.compile(r"(\d+)/(\d+)")


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` (0 <= I < N <= ``MAX_PARTS``) as (I, N)."""
    match = _SHARD.fullmatch(text.strip())
    if match is None or not 0 <= int(match[1]) < int(match[2]):
        raise DataError(
            f"--shard {text!r}: pass I/N with 0 <= I < N, e.g. --shard $SLURM_ARRAY_TASK_ID/64 "
            "in a SLURM array of 64 tasks"
        )
    if int(match[2]) > MAX_PARTS:
        raise DataError(
            f"--shard {text!r}: at most {MAX_PARTS:,} parts (part folders are numbered in 5 "
            "digits): pass a smaller N; a part may hold many input files"
        )
    return int(match[1]), int(match[2])


def check_part_output(output: Path) -> None:
    """A ``--shard`` OUTPUT holds only what prepare-data writes there (``parts/``, then the
    merge's manifest and tokenizer): anything else, or a link in their place, is refused
    in one line before any work. (The merge checks the entries of ``parts/``.)"""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file, not a directory: pass a directory")
    if not output.is_dir():
        return
    for entry in sorted(output.iterdir()):
        writing = _WRITING.fullmatch(entry.name)
        if entry.name == PARTS:
            ours = entry.is_dir() and not entry.is_symlink()
        elif entry.name in WRITTEN or (writing and writing[1] in WRITTEN):
            ours = entry.is_file() and not entry.is_symlink()
        else:
            ours = False
        if not ours:
            raise foreign(entry, output)


def foreign(entry: Path, output: Path) -> DataError:
    what = "a symbolic link" if entry.is_symlink() else "not written by prepare-data"
    return DataError(
        f"{entry} is {what}: a --shard output holds only what prepare-data writes there "
        f"(parts/, then manifest.json and the tokenizer); move it out of {output} or choose "
        "another --output"
    )


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
    merged = _checked_output(output, inputs, index, count)
    corpus = Corpus(inputs, text_field=text_field, skip_bad_records=skip_bad_records)
    split_text = not skip_bad_records
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
    info = _part_record(output, corpus, options, shard, split_text, merged)
    source = load_tokenizer(tokenizer, bos_token, eos_token)
    final = output / PARTS / part_name(index, count)
    if (final / MANIFEST).is_file():
        return _finished(final, info, source.sha256)
    corpus.pieces = part_pieces(corpus.files, count, index, split_text)
    settings = Options(shard_tokens, workers, encode_threads, progress, val_fraction)
    return _write_part(final, info, corpus, source, settings)


def _checked_output(output: Path, inputs: list[Path] | None, index: int, count: int) -> dict | None:
    """The parts record of a data set already merged in ``output`` (or None), once
    ``output`` is found fit for part ``index`` of ``count``: outside the inputs, and holding
    only what prepare-data writes there."""
    check_outside_inputs(output, inputs)
    merged = _merged_record(output, index, count)
    check_part_output(output)
    return merged


def _part_record(
    output: Path,
    corpus: Corpus,
    options: dict,
    shard: tuple[int, int],
    split_text: bool,
    merged: dict | None,
) -> dict:
    """The part's record for its manifest (what the merge and a rerun compare): its place
    in the plan, the plan's digest, the options and its two cuts. A data set merged in
    ``output`` must come from the same plan."""
    index, count = shard
    digest = plan_sha256(corpus.files, count, split_text)
    if merged is not None and merged.get("plan_sha256") != digest:
        raise DataError(
            f"output {output} holds a data set merged from parts of other inputs: choose "
            "another --output"
        )
    lo, hi, _, _ = part_cuts(corpus.files, count, index, split_text)
    return {
        "index": index,
        "count": count,
        "plan_sha256": digest,
        "options": options,
        "cuts": [list(lo), list(hi)],
    }


def _write_part(
    final: Path, info: dict, corpus: Corpus, source: Tokenizer, settings: Options
) -> dict:
    """Tokenize the part's pieces into a temporary directory renamed to ``final``; when
    another task of the same part renamed its own there first, that one is the part."""
    index, count = info["index"], info["count"]

    def build(tmp: Path) -> dict:
        manifest = {
            "format": FORMAT,
            **source.describe(),
            "tokenizer_files": source.save(tmp),
            "part": info,
        }
        print(f"part {index}/{count}: {len(corpus.pieces)} piece(s) of input", file=sys.stderr)
        return tokenize(tmp, manifest, corpus, source, settings, whole=False)

    try:
        return build_into(final, build)
    except OutputAppeared:
        if not (final / MANIFEST).is_file():
            raise
        return _finished(final, info, source.sha256)  # another task of this part finished


def _merged_record(output: Path, index: int, count: int) -> dict | None:
    """The parts record of the data set already merged in ``output`` (a lost part may be
    made again into it), or None when there is none; another data set is refused."""
    if not (output / MANIFEST).is_file() or (output / MANIFEST).is_symlink():
        return None
    record = load_manifest(output).get("parts")
    if not isinstance(record, dict) or record.get("count") != count:
        raise DataError(
            f"output {output} already holds prepared data without part {index}/{count}: "
            "choose another --output"
        )
    return record


def _check_options(val_fraction: float, shard_tokens: int) -> None:
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be at least 0 and below 1, got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")


def _finished(final: Path, info: dict, tokenizer_sha256: str) -> dict:
    """A part that is already complete: nothing to do, if it is this very part."""
    manifest = load_manifest(final, part=True)
    differs = different(manifest, info, tokenizer_sha256)
    if differs:
        raise DataError(
            f"{final} holds part {info['index']}/{info['count']} of other inputs or options "
            f"({differ(differs)}): delete {final} or choose another --output"
        )
    print(f"part {info['index']}/{info['count']} is already complete at {final}: nothing to do")
    return manifest


def different(manifest: dict, info: dict, tokenizer_sha256: str) -> list[str]:
    """What differs between a part's manifest and the part ``info`` describes (nothing:
    an empty list): its plan (inputs), its options or its tokenizer."""
    part = manifest.get("part")
    if not isinstance(part, dict):
        return ["the part record"]
    return [
        name
        for name, same in [
            ("the number of parts", part.get("count") == info["count"]),
            ("the inputs (plan_sha256)", part.get("plan_sha256") == info["plan_sha256"]),
            ("the options", comparable(part.get("options")) == comparable(info["options"])),
            ("the tokenizer", manifest.get("tokenizer_sha256") == tokenizer_sha256),
        ]
        if not same
    ]


def differ(found: list[str]) -> str:
    """``['the options']`` as 'the options differ', one thing as 'the tokenizer differs'."""
    text = ", ".join(found[:-1]) + (" and " if len(found) > 1 else "") + found[-1]
    plural = len(found) > 1 or found[0] in ("the options", "the inputs (plan_sha256)")
    return f"{text} {'differ' if plural else 'differs'}"


def comparable(options: object) -> object:
    """Options as compared between parts (the tokenizer's path may differ: its hash counts)."""
    if not isinstance(options, dict):
        return options
    return {k: v for k, v in options.items() if k != "tokenizer"}
