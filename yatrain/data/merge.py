"""``prepare-data --merge DIR``: the parts of a partitioned run joined into one data set.

The merge checks that every part ``0 .. N-1`` under ``DIR/parts`` is complete (renamed into
place, its token files of the sizes its manifest says), and that all were made from the same
plan (the inputs), options and tokenizer. It then writes ``DIR/manifest.json`` whose file
lists are the parts' token files in part order (paths like
``parts/part-00000-of-00008/tokens-00000.bin``): no token byte is copied or moved, only the
tokenizer's files are copied next to the manifest. The parts hold consecutive runs of the
one-machine document order, each split by content into training and held-out documents, so
the merged streams are those of one ``prepare-data`` over the same inputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from yatrain.data.parts import PARTS, different, part_command, part_name
from yatrain.data.prepare import check_tokens
from yatrain.data.shards import FORMAT, MANIFEST, TokenShards, has_validation, load_manifest
from yatrain.errors import DataError

_FINAL = re.compile(r"part-(\d{5})-of-(\d{5})")
_TEMPORARY = re.compile(r"\.tmp-part-(\d{5})-of-(\d{5})-[0-9a-f]+")


def merge_parts(output: Path) -> dict:
    """Check the parts under ``output`` and write its manifest (see the module docstring)."""
    output = Path(output)
    if (output / MANIFEST).is_file():
        manifest = load_manifest(output)
        if isinstance(manifest.get("parts"), dict):
            print(f"{output} is already merged: nothing to do")
            return manifest
        raise DataError(f"{output} holds a one-machine prepare-data output, not parts to merge")
    folder = output / PARTS
    found = sorted(folder.iterdir()) if folder.is_dir() else []
    finals = {p.name: p for p in found if _FINAL.fullmatch(p.name)}
    if not finals:
        raise DataError(
            f"no complete part under {folder}: run `yatrain prepare-data --output {output} "
            "... --shard I/N` for every part I of N first (scripts/prepare_data.sbatch)"
        )
    parts = [_open_part(path) for path in finals.values()]
    first_path, first = parts[0]
    info = first["part"]
    count = info["count"]
    for path, manifest in parts[1:]:
        differs = different(manifest, info, first["tokenizer_sha256"])
        if differs:
            command = part_command(info["options"], output, manifest["part"]["index"], count)
            raise DataError(
                f"part {path} does not belong with {first_path} ({differs} differ): delete it "
                f"and run `{command}`"
            )
    _check_all_present(output, found, finals, info)
    manifest = _merged(output, [m for _, m in parts], info)
    for name in first["tokenizer_files"]:
        shutil.copyfile(first_path / name, output / name)
    tmp = output / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, output / MANIFEST)
    TokenShards.open(output, verify_checksums=False)  # the loader accepts what was written
    return manifest


def _open_part(path: Path) -> tuple[Path, dict]:
    """A complete part's manifest, its token files checked against it (sizes, tokenizer)."""
    if not (path / MANIFEST).is_file():
        raise DataError(
            f"{path} has no {MANIFEST}, so it is not a complete part (a part is renamed into "
            "place only once complete): delete it and run its task again"
        )
    manifest = load_manifest(path)
    part = manifest.get("part")
    if not isinstance(part, dict) or not isinstance(part.get("count"), int):
        raise DataError(
            f"{path} was not written by `prepare-data --shard` (no part record in its "
            f"{MANIFEST}): move it out of {path.parent}"
        )
    TokenShards.open(path, verify_checksums=False)
    if has_validation(manifest):
        TokenShards.open(path, verify_checksums=False, split="validation")
    return path, manifest


def _check_all_present(output: Path, found: list[Path], finals: dict, info: dict) -> None:
    """Every part 0..N-1 is there: one line naming the missing or killed ones otherwise."""
    count = info["count"]
    stray = [name for name in finals if name.rsplit("-", 1)[1] != f"{count:05d}"]
    if stray:
        raise DataError(
            f"{output / PARTS / stray[0]} is a part of another partition than "
            f"{count} parts: delete it"
        )
    killed = {
        int(m[1]) for p in found if (m := _TEMPORARY.fullmatch(p.name)) and int(m[2]) == count
    }
    missing = [i for i in range(count) if part_name(i, count) not in finals]
    if missing:
        i = missing[0]
        state = "was stopped while being written" if i in killed else "is missing"
        more = f" (and {len(missing) - 1} more: {_listed(missing[1:])})" if len(missing) > 1 else ""
        raise DataError(
            f"part {i}/{count} ({output / PARTS / part_name(i, count)}) {state}{more}: run "
            f"`{part_command(info['options'], output, i, count)}` (the same for each missing "
            "part, or resubmit the array job: finished parts are skipped)"
        )


def _listed(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:10])
    return shown + (", ..." if len(indices) > 10 else "")


def _merged(output: Path, parts: list[dict], info: dict) -> dict:
    """The manifest of the whole data set: the parts' files and counts, in part order."""
    parts = sorted(parts, key=lambda m: m["part"]["index"])
    first = parts[0]

    def split(entries: list[dict]) -> dict:
        files = [
            {**f, "name": f"{PARTS}/{part_name(m['part']['index'], info['count'])}/{f['name']}"}
            for m, entry in zip(parts, entries, strict=True)
            for f in (entry["files"] if entry else [])
        ]
        return {
            "num_documents": sum(e["num_documents"] for e in entries if e),
            "num_tokens": sum(f["num_tokens"] for f in files),
            "files": files,
        }

    train = split(parts)
    val = split([m.get("validation") for m in parts])
    check_tokens(
        train["num_tokens"] + val["num_tokens"],
        train["num_tokens"],
        info["options"]["val_fraction"],
    )
    keys = ("tokenizer_kind", "tokenizer_sha256", "vocab_size", "bos_id", "eos_id")
    first_bad = next((m["first_bad_record"] for m in parts if m["first_bad_record"]), None)
    return {
        "format": FORMAT,
        **{k: first[k] for k in keys},
        "tokenizer_files": first["tokenizer_files"],
        "dtype": first["dtype"],
        **train,
        "val_fraction": first["val_fraction"],
        "validation": val if val["num_tokens"] else None,
        "skipped_bad_records": sum(m["skipped_bad_records"] for m in parts),
        "first_bad_record": first_bad,
        "skipped_files": [f for m in parts for f in m["skipped_files"]],
        "empty_documents": sum(m["empty_documents"] for m in parts),
        "parts": {"count": info["count"], "plan_sha256": info["plan_sha256"]},
    }
