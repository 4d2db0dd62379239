"""The disk tier on a shared host: another user can neither read entries (0700 dir, 0600 files, whatever the
umask) nor plant one we serve (a MAC keyed by the mesh secret; instances with other secrets use other dirs), and
symlinks, FIFOs and foreign directories are refused at once, never followed or waited on."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import shutil
import stat
import struct
import threading
import uuid
from collections.abc import Callable

import pytest

from hybridkv.connectors.base import EngineIdentity, KVTransferConfig
from hybridkv.connectors.mesh_auth import SECRET_ENV, MeshKeys
from hybridkv.connectors.offload import disk as offload_disk
from hybridkv.connectors.offload.connector import OffloadingConnector
from hybridkv.connectors.offload.disk import HEADER, DiskTier
from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from tests.offload.test_offload_e2e import check_idle, embedded_prompts, metrics, offload_llm, outputs
from tests.offload.test_tiers import COMPAT, key, payload, read

SECRET_A, SECRET_B = b"a" * 32, b"b" * 32
A, B, PUBLIC = MeshKeys.derive(SECRET_A), MeshKeys.derive(SECRET_B), MeshKeys.derive(None)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def forge(k: tuple[bytes, int], data: bytes, disk_key: bytes) -> bytes:
    """A well-formed entry built by hand from the documented format (what an attacker without the secret can do
    with the public key)."""
    fields = struct.pack("<8s32s32sIQ", b"HKVOFF02", bytes.fromhex(COMPAT), k[0], k[1], len(data))
    h = hmac.new(disk_key, digestmod=hashlib.sha256)
    for part in (fields, data):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return fields + h.digest() + data


def promptly(fn: Callable[[], object], timeout: float = 2.0) -> list:
    """Run `fn` in a thread; fail if it has not returned within `timeout` (a blocked open of a FIFO)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked"
    return result


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


# ---- modes -------------------------------------------------------------------------------------------------
def test_root_dir_and_entries_are_private_whatever_the_umask(tmp_path, umask0, monkeypatch):
    root = tmp_path / "cache" / "kv"
    tier = DiskTier(root, COMPAT, 1 << 20, keys=A)
    temp_modes = []
    real_replace = offload_disk.os.replace

    def spy(src, dst):
        temp_modes.append(mode(src))
        real_replace(src, dst)

    monkeypatch.setattr(offload_disk.os, "replace", spy)
    assert tier.write(key(0), payload(0))
    assert (mode(root), mode(tier.dir)) == (0o700, 0o700)
    assert temp_modes == [0o600] and mode(tier._path(key(0))) == 0o600


def test_a_symlink_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path / "kv", COMPAT, 1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    monkeypatch.setattr(offload_disk.uuid, "uuid4", lambda: uuid.UUID(int=0))
    tmp = tier.dir / f".{tier._path(key(0)).name}.{os.getpid()}.00000000.tmp"
    os.symlink(victim, tmp)
    assert not tier.write(key(0), payload(0)) and tier.skipped == 1  # O_EXCL: the name exists, nothing written
    assert victim.read_bytes() == b"keep" and not tier.contains(key(0))


# ---- MACs ----------------------------------------------------------------------------------------------------
def test_a_forged_entry_is_refused_by_a_keyed_tier_and_accepted_without_a_secret(tmp_path):
    forged = forge(key(0), bytes(payload(7)), PUBLIC.disk)
    keyless = DiskTier(tmp_path, COMPAT, 1 << 20)
    keyless._path(key(0)).write_bytes(forged)
    assert read(DiskTier(tmp_path, COMPAT, 1 << 20), key(0)) == ("ok", bytes(payload(7)))  # a well-formed entry

    keyed = DiskTier(tmp_path, COMPAT, 1 << 20, keys=A)
    keyed._path(key(0)).write_bytes(forged)
    keyed = DiskTier(tmp_path, COMPAT, 1 << 20, keys=A)  # a restart adopts the planted file by its name
    assert keyed.contains(key(0))
    assert read(keyed, key(0))[0] == "corrupt" and keyed.corrupt == 1
    assert not keyed._path(key(0)).exists() and not keyed.contains(key(0))
    keyed.check_integrity()


def test_other_secrets_use_other_dirs_and_never_accept_each_others_entries(tmp_path):
    a, b, none = (DiskTier(tmp_path, COMPAT, 1 << 20, keys=k) for k in (A, B, PUBLIC))
    assert len({a.dir, b.dir, none.dir}) == 3 and {p.parent for p in (a.dir, b.dir, none.dir)} == {tmp_path}
    assert a.write(key(0), payload(0))
    for other in (b, none):
        shutil.copyfile(a._path(key(0)), other._path(key(0)))
        assert read(other, key(0))[0] == "corrupt" and other.corrupt == 1
        assert not other._path(key(0)).exists()
    again = DiskTier(tmp_path, COMPAT, 1 << 20, keys=MeshKeys.derive(SECRET_A))  # the same secret shares
    assert read(again, key(0)) == ("ok", bytes(payload(0)))


def test_an_entry_of_the_old_format_is_refused(tmp_path):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    tier.write(key(0), payload(0))
    path = tier._path(key(0))
    path.write_bytes(b"HKVOFF01" + path.read_bytes()[8:])
    assert read(tier, key(0))[0] == "corrupt" and not path.exists()


# ---- special files -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "fed_fifo", "symlink"])
def test_a_special_file_under_an_entry_name_is_refused_at_once(tmp_path, kind):
    tier = DiskTier(tmp_path / "kv", COMPAT, 1 << 20)
    tier.write(key(0), payload(0))
    path = tier._path(key(0))
    target = tmp_path / "elsewhere.kv"
    os.replace(path, target)  # a valid entry of this very key, moved out of the dir
    holder = None
    if kind == "symlink":
        os.symlink(target, path)
    else:
        os.mkfifo(path, 0o600)
        if kind == "fed_fifo":  # an attacker holding the FIFO open, a well-formed entry waiting in it
            holder = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            os.write(holder, target.read_bytes())
    try:
        (status,) = promptly(lambda: read(tier, key(0))[0])
    finally:
        if holder is None and kind != "symlink":
            with contextlib.suppress(OSError):  # a reader stuck in open() (the test failed): a writer frees it
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        if holder is not None:
            os.close(holder)
    assert status == "corrupt" and tier.corrupt == 1
    assert not os.path.lexists(path) and not tier.contains(key(0)) and target.exists()
    tier.check_integrity()


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_read_refuses_what_is_not_a_regular_file_even_at_the_entry_size(tmp_path, kind, caplog):
    """The fstat check, not the size check, refuses it: a directory under an entry name, read with a payload
    length that makes its st_size the entry's, is still dropped and counted (not read as "missing" and kept), and
    a FIFO is refused as not a regular file."""
    tier = DiskTier(tmp_path / "kv", COMPAT, 1 << 20)
    tier.write(key(0), payload(0))
    path = tier._path(key(0))
    path.unlink()
    if kind == "dir":
        path.mkdir()
        for i in range(1000):  # a file system whose dirs start small (tmpfs, btrfs) grows them by name
            if path.stat().st_size > HEADER.size:
                break
            (path / f"{i:0200d}").touch()
        n = path.stat().st_size - HEADER.size
    else:
        os.mkfifo(path, 0o600)
        n = 64
    with caplog.at_level(logging.WARNING, logger=offload_disk.__name__):
        (status,) = promptly(lambda: read(tier, key(0), n)[0])
    assert status == "corrupt" and tier.corrupt == 1 and not tier.contains(key(0))
    assert "not a regular file" in caplog.text
    tier.check_integrity()


def test_start_up_removes_special_files_and_adopts_only_regular_entries(tmp_path):
    tier = DiskTier(tmp_path / "kv", COMPAT, 1 << 20)
    for i in range(3):
        tier.write(key(i), payload(i))
    target = tmp_path / "elsewhere.kv"
    os.replace(tier._path(key(0)), target)
    os.symlink(target, tier._path(key(0)))
    tier._path(key(1)).unlink()
    os.mkfifo(tier._path(key(1)), 0o600)
    (again,) = promptly(lambda: DiskTier(tmp_path / "kv", COMPAT, 1 << 20))
    assert [again.contains(key(i)) for i in range(3)] == [False, False, True]
    assert not os.path.lexists(tier._path(key(0))) and not os.path.lexists(tier._path(key(1)))
    assert again.used_bytes == HEADER.size + 64 and again.corrupt == 2 and target.exists()
    again.check_integrity()


# ---- the entry dir ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir to another uid needs root")
def test_an_entry_dir_owned_by_another_user_is_an_error(tmp_path):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20, keys=A)
    os.chown(tier.dir, 65534, 65534)
    with pytest.raises(ValueError, match=r"belongs to uid 65534.*remove it"):
        DiskTier(tmp_path, COMPAT, 1 << 20, keys=A)


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_an_entry_dir_that_is_a_symlink_or_a_file_is_an_error(tmp_path, kind):
    entry_dir = DiskTier(tmp_path, COMPAT, 1 << 20).dir
    entry_dir.rmdir()
    if kind == "symlink":
        (tmp_path / "theirs").mkdir(mode=0o700)
        os.symlink(tmp_path / "theirs", entry_dir)
    else:
        entry_dir.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{entry_dir} is a symlink or not a directory: remove it"):
        DiskTier(tmp_path, COMPAT, 1 << 20)


def test_an_open_entry_dir_of_ours_is_made_private_with_a_warning(tmp_path, caplog):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    os.chmod(tier.dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="hybridkv.connectors.offload.disk"):
        DiskTier(tmp_path, COMPAT, 1 << 20)
    assert mode(tier.dir) == 0o700 and any("mode 777" in r.getMessage() for r in caplog.records)


# ---- the secret through the connector's options ------------------------------------------------------------
def connector(**extra) -> OffloadingConnector:
    config = KVTransferConfig.parse({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})
    return OffloadingConnector(config, EngineIdentity("e", "f" * 64, "float32"))


def test_secret_file_option_reads_a_private_file_and_refuses_others(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    good = tmp_path / "secret"
    good.write_bytes(SECRET_A)
    good.chmod(0o600)
    assert connector(cpu_bytes="1MiB", secret_file=str(good)).keys == A
    assert connector(cpu_bytes="1MiB").keys == PUBLIC
    monkeypatch.setenv(SECRET_ENV, SECRET_B.decode())
    assert connector(cpu_bytes="1MiB").keys == B
    os.symlink(good, tmp_path / "link")
    with pytest.raises(ValueError, match="a symlink is refused"):
        connector(cpu_bytes="1MiB", secret_file=str(tmp_path / "link"))
    good.chmod(0o644)
    config = EngineConfig(kv_offload_cpu="4MiB", kv_connector_extra_config={"secret_file": str(good)})
    assert config.kv_transfer_config.kv_connector_extra_config["secret_file"] == str(good)  # the flags pass it on
    with pytest.raises(ValueError, match=r"readable by others \(mode 644\)"):  # at start-up, through LLM
        offload_llm(str(DEFAULT_MODEL_DIR), "packed", kv_connector_extra_config={"secret_file": str(good)})


# ---- end to end --------------------------------------------------------------------------------------------
def test_disk_hits_need_the_same_secret(tmp_path, monkeypatch):
    folder, prompts, disk = str(DEFAULT_MODEL_DIR), embedded_prompts()[:2], f"{tmp_path}:64MiB"
    monkeypatch.setenv(SECRET_ENV, SECRET_A.decode())
    first = offload_llm(folder, "packed", kv_offload_disk=disk)
    expected = outputs(first, prompts)
    first.engine.connector.shutdown()
    assert metrics(first)["kv_offload_hits_total"] == 0 and metrics(first)["kv_offload_cpu_to_disk_blocks_total"] > 0

    second = offload_llm(folder, "packed", kv_offload_disk=disk)
    assert outputs(second, prompts) == expected
    m = metrics(second)
    assert m["kv_offload_disk_hit_blocks_total"] > 0 and m["kv_offload_corrupt_entries_total"] == 0
    check_idle(second)
    second.engine.connector.shutdown()
    kept = sorted(os.listdir(second.engine.connector.disk.dir))

    monkeypatch.setenv(SECRET_ENV, SECRET_B.decode())
    third = offload_llm(folder, "packed", kv_offload_disk=disk)
    assert outputs(third, prompts) == expected
    m = metrics(third)
    assert m["kv_offload_disk_hit_blocks_total"] == 0 and m["kv_offload_corrupt_entries_total"] == 0
    check_idle(third)
    assert third.engine.connector.disk.dir != first.engine.connector.disk.dir
    assert sorted(os.listdir(first.engine.connector.disk.dir)) == kept  # secret A's entries are left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_a_root_another_user_owns_or_may_write_is_an_error(tmp_path):
    """Whoever may rename entries in a directory above the entry dir can swap it for one of their own while we
    run: the tier refuses such a root at start-up (a sticky directory such as /tmp is fine)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        DiskTier(theirs / "kv", COMPAT, 1 << 20, keys=A)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"other users may write to \(mode 777, not sticky\)"):
        DiskTier(shared / "kv", COMPAT, 1 << 20, keys=A)
    shared.chmod(0o1777)
    assert DiskTier(shared / "kv", COMPAT, 1 << 20, keys=A).write(key(0), payload(0))
