"""Token files opened lazily: any number of files under a small open-file limit, no file
touched on open for large data, and a missing or resized file named when it is first read."""

import gc

import numpy as np
import pytest
from test_data import _fake_data

from yatrain.data import shards as shards_module
from yatrain.data.shards import MAX_OPEN_FILES, TokenShards
from yatrain.errors import DataError


def _mapped_files(directory) -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if str(directory) in line}


def test_at_most_max_open_files_token_files_are_mapped_at_once(tmp_path):
    data = _fake_data(tmp_path / "many", num_tokens=3 * MAX_OPEN_FILES * 11, shard_tokens=11)
    shards = TokenShards.open(data.path)
    expected = np.arange(shards.num_tokens)
    for start in range(0, shards.num_tokens, 7):
        length = min(20, shards.num_tokens - start)
        assert np.array_equal(shards.read(start, length), expected[start : start + length])
    gc.collect()
    assert 0 < len(_mapped_files(data.path)) <= MAX_OPEN_FILES


@pytest.fixture
def large(tmp_path, monkeypatch):
    """Data treated as large (over the size hashed on open): files are checked on first read."""
    monkeypatch.setattr(shards_module, "_VERIFY_MAX_BYTES", 0)
    return _fake_data(tmp_path / "large", num_tokens=1000, shard_tokens=100).path


def test_opening_large_data_touches_no_token_file(large):
    for file in sorted(large.glob("tokens-*.bin"))[1:]:
        file.unlink()
    shards = TokenShards.open(large)  # nine of ten files gone: nothing looked at them yet
    assert np.array_equal(shards.read(0, 100), np.arange(100))


def test_a_missing_token_file_is_named_when_first_read(large):
    (large / "tokens-00005.bin").unlink()
    shards = TokenShards.open(large)
    assert np.array_equal(shards.read(400, 100), np.arange(400, 500))
    with pytest.raises(DataError) as err:
        shards.read(450, 100)
    message = str(err.value)
    assert f"token file {large / 'tokens-00005.bin'} is missing" in message
    assert "re-run `yatrain prepare-data` into a new directory" in message


@pytest.mark.parametrize("change", [-2, 2])
def test_a_token_file_of_another_size_is_named_when_first_read(large, change):
    file = large / "tokens-00003.bin"
    data = file.read_bytes()
    file.write_bytes(data[:change] if change < 0 else data + bytes(change))
    shards = TokenShards.open(large)
    with pytest.raises(
        DataError, match=rf"tokens-00003\.bin has {200 + change} bytes, the manifest says 200"
    ):
        shards.read(299, 2)
