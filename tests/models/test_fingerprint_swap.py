"""Attack 8 of issue 31: a model swapped in place (same file, same size, same inode) with its mtime put back must not
keep the cached fingerprint, or a decoder would take KV computed by other weights as its own."""

import time

from hybridkv.connectors.identity import CACHE_NAME, model_fingerprint
from tests.models.test_fingerprint import checkpoint, rewrite_keeping_mtime, user_cache  # noqa: F401


def test_weights_swapped_in_place_with_the_mtime_restored_are_hashed_again(tmp_path, user_cache):  # noqa: F811
    folder = checkpoint(tmp_path / "m")
    first = model_fingerprint(folder)
    assert (folder / CACHE_NAME).is_file() and len(user_cache) == 3

    weights = folder / "model.safetensors"
    before = weights.stat()
    other = checkpoint(tmp_path / "other", seed=1) / "model.safetensors"
    swapped = other.read_bytes()
    assert len(swapped) == before.st_size and swapped != weights.read_bytes()
    time.sleep(0.05)  # past the file system's timestamp granularity: the rewrite's ctime differs
    rewrite_keeping_mtime(weights, swapped)
    after = weights.stat()
    same = ("st_size", "st_mtime_ns", "st_ino", "st_dev")
    assert [getattr(after, k) for k in same] == [getattr(before, k) for k in same]  # all the old key could see
    assert after.st_ctime_ns != before.st_ctime_ns

    swapped_print = model_fingerprint(folder)
    assert swapped_print != first and len(user_cache) == 6  # hashed again, not read from the cache
    assert model_fingerprint(folder) == swapped_print and len(user_cache) == 6  # the new entry is used at once
