"""How an --input directory is walked: a linked directory inside it is followed like a
linked file (a loop, or one directory reached twice, is refused in one line), and a
subdirectory that cannot be listed stops the run instead of vanishing from the corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from yatrain.data import iter_documents
from yatrain.data.corpus import expand_inputs
from yatrain.errors import DataError


def _corpus(tmp_path: Path) -> Path:
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / "a.md").write_text("first")
    (root / "sub" / "b.md").write_text("second")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.md").write_text("linked")
    return root


def test_a_linked_directory_inside_an_input_is_read_in_sorted_order(tmp_path):
    root = _corpus(tmp_path)
    (root / "m-link").symlink_to(tmp_path / "elsewhere")
    (root / "z.md").symlink_to(tmp_path / "elsewhere" / "c.md")  # a linked file, as before
    assert list(iter_documents([root])) == ["first", "linked", "second", "linked"]
    names = [p.relative_to(root).as_posix() for p, _ in expand_inputs([root])]
    assert names == ["a.md", "m-link/c.md", "sub/b.md", "z.md"]


@pytest.mark.parametrize("target", ["in", "in/sub", "elsewhere"])
def test_a_link_loop_or_a_directory_reached_twice_is_refused(tmp_path, target):
    root = _corpus(tmp_path)
    (root / "sub" / "back").symlink_to(tmp_path / target)
    if target == "elsewhere":
        (root / "again").symlink_to(tmp_path / target)  # the same directory twice
    with pytest.raises(DataError) as error:
        expand_inputs([root])
    message = str(error.value)
    assert "is the directory" in message and "remove the link" in message and "\n" not in message


def test_a_subdirectory_that_cannot_be_listed_stops_the_run(tmp_path, monkeypatch):
    root = _corpus(tmp_path)
    real = os.scandir

    def refusing(path="."):
        if Path(path) == root / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(DataError) as error:
        expand_inputs([root])
    message = str(error.value)
    assert f"cannot list {root / 'sub'}" in message and "Permission denied" in message
