"""model_fingerprint: every weight byte counts, files cannot trade bytes, and the cache is keyed and trusted right."""

import hashlib
import json
import logging
import os
import shutil
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridkv.connectors import identity as fp
from hybridkv.connectors.identity import CACHE_NAME, model_fingerprint

SAMPLE = 64 << 10  # what the old sampler read at the start, middle and end of each weight file


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """Keep the fallback cache inside the test's folder, and count how many files get hashed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(fp, "_warned_no_cache", False)
    calls = []
    real = fp._hash_file
    monkeypatch.setattr(fp, "_hash_file", lambda path: calls.append(path.name) or real(path))
    return calls


def checkpoint(folder, seed=0):
    """About 1.5 MiB of float32 weights in one safetensors file, a config and a tokenizer file."""
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.self_attn.k_proj.weight": torch.randn(256, 512, generator=g) for i in range(3)}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 512}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    return folder


def rewrite_keeping_mtime(path, data):
    """Change a file's bytes in place (same inode) and put its mtime back, as a careless copy tool might."""
    st = path.stat()
    with path.open("r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_one_changed_element_far_from_the_samples_changes_it(tmp_path):
    a = checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)  # a copy is the same model

    weights = b / "model.safetensors"
    size = weights.stat().st_size
    at = size // 4  # inside the second tensor, nowhere near what the sampler read
    assert size > 3 * SAMPLE and SAMPLE < at < size // 2 - SAMPLE
    data = bytearray(weights.read_bytes())
    data[at] ^= 0x01
    rewrite_keeping_mtime(weights, bytes(data))

    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(weights, "pt") as fb:
        diffs = [(n, int((fa.get_tensor(n) != fb.get_tensor(n)).sum())) for n in fa.keys()]  # noqa: SIM118
    assert sorted(d for _, d in diffs) == [0, 0, 1] and weights.stat().st_size == size

    (b / CACHE_NAME).unlink()  # the mtime was kept on purpose: that the cache then sticks is tested below
    assert model_fingerprint(a) != model_fingerprint(b)


def test_tokenizer_and_config_are_covered(tmp_path):
    folder = checkpoint(tmp_path / "m")
    before = model_fingerprint(folder)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 1, "b": 0}}}))
    after = model_fingerprint(folder)
    assert after != before
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 511}))
    assert model_fingerprint(folder) not in (before, after)


def test_bytes_cannot_move_across_a_file_boundary(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    (one / "a.safetensors").write_bytes(b"xxxxyy")
    (one / "b.safetensors").write_bytes(b"zz")
    (two / "a.safetensors").write_bytes(b"xxxx")
    (two / "b.safetensors").write_bytes(b"yyzz")
    assert model_fingerprint(one) != model_fingerprint(two)
    before = model_fingerprint(two)
    (two / "b.safetensors").rename(two / "c.safetensors")  # an index names the shard each tensor is in
    assert model_fingerprint(two) != before


def test_a_restart_reads_the_cache_and_it_keys_on_size_mtime_and_ctime(tmp_path, user_cache):
    folder = checkpoint(tmp_path / "m")
    first = model_fingerprint(folder)
    hashed = len(user_cache)
    assert hashed == 3 and (folder / CACHE_NAME).is_file()
    assert model_fingerprint(folder) == first and len(user_cache) == hashed  # nothing hashed again

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 4] ^= 0x01
    rewrite_keeping_mtime(weights, bytes(data))
    assert model_fingerprint(folder) != first  # the mtime was put back, the ctime moved: hashed again
    assert len(user_cache) == 2 * hashed
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    changed = model_fingerprint(folder)
    assert changed != first and len(user_cache) == 3 * hashed

    rewrite_keeping_mtime(weights, bytes(data) + b"\0")  # the size differs too now
    grown = model_fingerprint(folder)
    assert grown not in (first, changed) and len(user_cache) == 4 * hashed


def test_adding_or_removing_a_file_invalidates_the_cache(tmp_path, user_cache):
    folder = checkpoint(tmp_path / "m")
    first = model_fingerprint(folder)
    (folder / "merges.txt").write_text("a b\n")
    added = model_fingerprint(folder)
    assert added != first and len(user_cache) == 3 + 4
    (folder / "merges.txt").unlink()
    (folder / "tokenizer.json").unlink()
    assert model_fingerprint(folder) not in (first, added) and len(user_cache) == 3 + 4 + 2
    (folder / "notes.md").write_text("not part of the model")
    model_fingerprint(folder)
    assert len(user_cache) == 3 + 4 + 2  # files that do not define the model are neither hashed nor keyed


def forged_entry(folder):
    """A well-formed cache entry for the folder's current files, with a digest nobody computed."""
    files = fp._stats(fp._files(folder))
    return {"version": fp.CACHE_VERSION, "digest": "0" * 64, "files": files}


@pytest.mark.parametrize(
    "case",
    ["garbage", "not-a-dict", "non-hex digest", "wrong version", "foreign owner", "group-writable", "symlink", "fifo"],
)
def test_an_untrustworthy_cache_file_is_ignored(tmp_path, monkeypatch, user_cache, case):
    folder = checkpoint(tmp_path / "m")
    truth = model_fingerprint(folder)
    cache = folder / CACHE_NAME
    cache.unlink()
    entry = forged_entry(folder)
    cache.write_text(json.dumps(entry))
    cache.chmod(0o600)
    assert model_fingerprint(folder) == "0" * 64  # the forgery is well-formed: only its trust decides
    target = tmp_path / "elsewhere.json"
    if case == "garbage":
        cache.write_bytes(b"\xff{not json")
    elif case == "not-a-dict":
        cache.write_text(json.dumps([entry]))
    elif case == "non-hex digest":
        cache.write_text(json.dumps(entry | {"digest": "z" * 64}))
    elif case == "wrong version":
        cache.write_text(json.dumps(entry | {"version": fp.CACHE_VERSION + 1}))
    elif case == "foreign owner":
        monkeypatch.setattr(fp.os, "geteuid", lambda: os.getuid() + 1)
    elif case == "group-writable":
        cache.chmod(0o620)
    elif case == "symlink":
        cache.rename(target)
        cache.symlink_to(target)
    elif case == "fifo":
        cache.unlink()
        os.mkfifo(cache)
    hashed = len(user_cache)
    assert model_fingerprint(folder) == truth and len(user_cache) == hashed + 3
    if case == "symlink":  # the link was replaced, not written through
        assert not cache.is_symlink() and json.loads(target.read_text())["digest"] == "0" * 64


def test_an_unwritable_model_folder_falls_back_to_the_user_cache(tmp_path, monkeypatch, user_cache, caplog):
    folder = checkpoint(tmp_path / "m")
    real = fp.tempfile.mkstemp

    def mkstemp(dir, **kw):
        if os.path.realpath(dir) == os.path.realpath(folder):
            raise PermissionError(13, "Permission denied")
        return real(dir=dir, **kw)

    monkeypatch.setattr(fp.tempfile, "mkstemp", mkstemp)
    first = model_fingerprint(folder)
    key = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()
    cached = tmp_path / "xdg" / "hybridkv" / "fingerprints" / f"{key}.json"
    assert not (folder / CACHE_NAME).exists() and json.loads(cached.read_text())["digest"] == first
    assert stat.S_IMODE(cached.stat().st_mode) == 0o600 and stat.S_IMODE(cached.parent.stat().st_mode) == 0o700
    assert model_fingerprint(folder) == first and len(user_cache) == 3  # the restart read the fallback

    cached.unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "model.safetensors"))  # a file: no folder can go there
    with caplog.at_level(logging.INFO, logger=fp.__name__):
        assert model_fingerprint(folder) == first
        assert model_fingerprint(folder) == first
    assert len(user_cache) == 3 * 3  # no cache anywhere: hashed at every call, no error
    assert sum("cannot cache the model fingerprint" in r.getMessage() for r in caplog.records) == 1
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_a_file_that_changes_while_being_hashed_is_not_cached(tmp_path, monkeypatch, caplog):
    folder = checkpoint(tmp_path / "m")
    hash_file = fp._hash_file

    def touch_then_hash(path):
        if path.name == "model.safetensors":
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # as a download still being written would
        return hash_file(path)

    monkeypatch.setattr(fp, "_hash_file", touch_then_hash)
    with caplog.at_level(logging.WARNING, logger=fp.__name__):
        model_fingerprint(folder)
    assert not (folder / CACHE_NAME).exists() and "changed while it was being fingerprinted" in caplog.text
