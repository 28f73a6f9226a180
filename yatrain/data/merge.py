"""``prepare-data --merge DIR``: the parts of a partitioned run joined into one data set.

The merge checks that every part ``0 .. N-1`` under ``DIR/parts`` is complete (renamed into
place, its token files of the sizes its manifest says), that each folder holds the part its
name says, that all were made from the same plan (the inputs), options and tokenizer (when
they disagree, the side with fewer parts is the one to redo), and that each part ends where
the next begins. It then writes ``DIR/manifest.json`` whose file lists are the parts' token
files in part order (paths like ``parts/part-00000-of-00008/tokens-00000.bin``): no token
byte is copied or moved, only the tokenizer's files are copied next to the manifest. The
parts hold consecutive runs of the one-machine document order, each split by content into
training and held-out documents, so the merged streams are those of one ``prepare-data``
over the same inputs.

DIR holds only what prepare-data writes there (``parts.check_part_output``), and the merge
writes its files whole, never through a link, never over a file it did not write. A merge
run again checks everything again: a part lost since is named with the command that redoes
it, and prepare-data may redo it into the merged DIR.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from yatrain.data.file_index import read_file_index, write_file_index
from yatrain.data.manifest import FORMAT, MANIFEST, load_manifest, split_entry
from yatrain.data.parts import (
    FINAL,
    PARTS,
    TEMPORARY,
    check_part_output,
    comparable,
    differ,
    different,
    foreign,
    part_command,
    part_name,
)
from yatrain.data.prepare import check_tokens
from yatrain.data.shards import TokenShards
from yatrain.data.tokenizer import file_sha256
from yatrain.errors import DataError
from yatrain.files import write_whole

_ITEMSIZE = {"uint16": 2, "uint32": 4}


def merge_parts(output: Path) -> dict:
    """Check the parts under ``output`` and write its manifest (see the module docstring)."""
    output = Path(output)
    existing = None
    if (output / MANIFEST).is_file() and not (output / MANIFEST).is_symlink():
        existing = load_manifest(output)
        if not isinstance(existing.get("parts"), dict):
            raise DataError(f"{output} holds a one-machine prepare-data output, not parts to merge")
    none = DataError(
        f"no complete part under {output / PARTS}: run `yatrain prepare-data --output "
        f"{output} ... --shard I/N` for every part I of N first (scripts/prepare_data.sbatch)"
    )
    if not (output / PARTS).is_dir():
        raise none
    check_part_output(output)
    finals, killed = _part_folders(output)
    if not finals:
        raise none
    parts = [_open_part(path, index, count) for path, (index, count) in finals.items()]
    reference = _reference(output, parts)
    info = reference["part"]
    _check_all_present(output, set(finals.values()), killed, info)
    parts.sort(key=lambda p: p[1]["part"]["index"])
    _check_contiguous(output, [m for _, m in parts], info)
    manifest = _merged([m for _, m in parts], info)
    source = next(path for path, m in parts if m is reference)
    _copy_tokenizer(source, output, reference)
    if manifest == existing:
        print(f"{output} is already merged ({info['count']} parts checked): nothing to do")
    else:
        write_whole(output / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    if read_file_index(output) is None:  # a merge from before file indexes gets one too
        write_file_index(output, manifest)
    TokenShards.open(output, verify_checksums=False)  # the loader accepts what was written
    return manifest


def _part_folders(output: Path) -> tuple[dict[Path, tuple[int, int]], set[tuple[int, int]]]:
    """The complete parts' folders (index and count by their names), and the (index, count)
    of those a killed task left; anything else under ``parts/`` is refused."""
    folder = output / PARTS
    finals, killed = {}, set()
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        final, temporary = FINAL.fullmatch(path.name), TEMPORARY.fullmatch(path.name)
        if path.is_symlink() or not path.is_dir() or not (final or temporary):
            raise foreign(path, output)
        if final:
            finals[path] = (int(final[1]), int(final[2]))
        else:
            killed.add((int(temporary[1]), int(temporary[2])))
    return finals, killed


def _open_part(path: Path, index: int, count: int) -> tuple[Path, dict]:
    """A complete part's manifest, checked against its folder's name and its token files
    (that they are there, of the sizes it gives)."""
    if not (path / MANIFEST).is_file():
        raise DataError(
            f"{path} has no {MANIFEST}, so it is not a complete part (a part is renamed into "
            "place only once complete): delete it and run its task again"
        )
    manifest = load_manifest(path, part=True)
    part = manifest.get("part")
    if not isinstance(part, dict) or not isinstance(part.get("count"), int):
        raise DataError(
            f"{path} was not written by `prepare-data --shard` (no part record in its "
            f"{MANIFEST}): move it out of {path.parent}"
        )
    if (part.get("index"), part["count"]) != (index, count):
        command = part_command(part["options"], path.parent.parent, index, count)
        raise DataError(
            f"{path} holds part {part.get('index')}/{part['count']} by its {MANIFEST}, not "
            f"{index}/{count} as its name says (copied or renamed?): delete it and run "
            f"`{command}`"
        )
    itemsize = _ITEMSIZE[manifest["dtype"]]
    for split in ("train", "validation"):
        for entry in (split_entry(manifest, split) or {"files": []})["files"]:
            file = path / entry["name"]
            size = file.lstat().st_size if file.is_file() and not file.is_symlink() else None
            if size != entry["num_tokens"] * itemsize:
                raise DataError(
                    f"token file {file} is missing or not of the size its part's {MANIFEST} "
                    f"gives: delete {path} and run its task again"
                )
    return path, manifest


def _signature(manifest: dict) -> str:
    part = manifest["part"]
    return json.dumps(
        [
            part["count"],
            part.get("plan_sha256"),
            comparable(part.get("options")),
            manifest.get("tokenizer_sha256"),
        ],
        sort_keys=True,
    )


def _reference(output: Path, parts: list[tuple[Path, dict]]) -> dict:
    """The manifest of a part of the majority (the inputs, options and tokenizer most parts
    were made with); parts made otherwise are refused in one line naming the minority."""
    sides = Counter(_signature(m) for _, m in parts)
    if len(sides) == 1:
        return parts[0][1]
    (most, most_count), (other, other_count) = sides.most_common(2)

    def members(signature: str) -> list[tuple[Path, dict]]:
        return [(p, m) for p, m in parts if _signature(m) == signature]

    keep, redo = members(most), members(other)
    reference = keep[0][1]
    what = differ(different(redo[0][1], reference["part"], reference["tokenizer_sha256"]))
    if most_count == other_count:
        raise DataError(
            f"parts disagree ({what}): {_named(keep)} and {_named(redo)}: keep the side made "
            "with the inputs and options you want, delete the other side's parts and redo them "
            "with `prepare-data --shard` and those"
        )
    path, manifest = redo[0]
    count, several = reference["part"]["count"], len(redo) > 1
    index = manifest["part"]["index"]
    if manifest["part"]["count"] != count:
        fix = f"delete {'them' if several else 'it'} ({path}{', ...' if several else ''})"
    else:
        command = part_command(reference["part"]["options"], output, index, count)
        them = f"{path} and the others" if several else path
        fix = f"delete {them} and run `{command}`" + (
            f" (the same with --shard I/{count} for each)" if several else ""
        )
    raise DataError(
        f"{_named(redo)} {'do' if several else 'does'} not belong with the other "
        f"{len(keep)} ({what}): {fix}"
    )


def _named(parts: list[tuple[Path, dict]]) -> str:
    indices = [m["part"]["index"] for _, m in parts]
    label = "part" if len(indices) == 1 else f"{len(indices)} parts"
    return f"{label} {_listed(indices)}"


def _check_all_present(
    output: Path, finals: set[tuple[int, int]], killed: set[tuple[int, int]], info: dict
) -> None:
    """Every part 0..N-1 is there: one line naming the missing or killed ones otherwise."""
    count = info["count"]
    missing = [i for i in range(count) if (i, count) not in finals]
    if missing:
        i = missing[0]
        state = "was stopped while being written" if (i, count) in killed else "is missing"
        more = f" (and {len(missing) - 1} more: {_listed(missing[1:])})" if len(missing) > 1 else ""
        raise DataError(
            f"part {i}/{count} ({output / PARTS / part_name(i, count)}) {state}{more}: run "
            f"`{part_command(info['options'], output, i, count)}` (the same for each missing "
            "part, or resubmit the array job: finished parts are skipped)"
        )


def _check_contiguous(output: Path, parts: list[dict], info: dict) -> None:
    """Each part ends where the next begins (the inputs did not change between tasks)."""
    for before, after in zip(parts, parts[1:], strict=False):
        end, start = before["part"].get("cuts", [0, 0])[1], after["part"].get("cuts", [0, 0])[0]
        if end != start:
            index = after["part"]["index"]
            raise DataError(
                f"part {index - 1}/{info['count']} ends at {end} but part {index} starts at "
                f"{start} (an input changed between their tasks): delete both parts and run "
                f"`{part_command(info['options'], output, index, info['count'])}` and the same "
                f"with --shard {index - 1}/{info['count']}"
            )


def _copy_tokenizer(source: Path, output: Path, reference: dict) -> None:
    """The parts' tokenizer files next to the manifest, written whole; one already there
    must be the very same file (a merge that stopped), else nothing is written."""
    names = reference["tokenizer_files"]
    for name in names:
        target = output / name
        if target.exists() and (source / name).read_bytes() != target.read_bytes():
            raise DataError(
                f"{target} is not the parts' tokenizer (prepare-data did not write it): move "
                f"it out of {output} and rerun the merge"
            )
    if file_sha256(source / names[0]) != reference["tokenizer_sha256"]:
        raise DataError(
            f"{source / names[0]} does not match its part's tokenizer_sha256: delete {source} "
            "and run its task again"
        )
    for name in names:
        if not (output / name).exists():
            write_whole(output / name, (source / name).read_bytes())


def _listed(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:10])
    return shown + (", ..." if len(indices) > 10 else "")


def _merged(parts: list[dict], info: dict) -> dict:
    """The manifest of the whole data set: the parts' files and counts, in part order."""
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
