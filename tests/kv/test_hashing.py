import os
import subprocess
import sys

from hybridkv.kv.hashing import ROOT_HASH, hash_block, hash_blocks, is_private

SCRIPT = (
    "from hybridkv.kv.hashing import hash_blocks; "
    "print(b''.join(hash_blocks(list(range(100)), 16, cache_salt='s')).hex())"
)


def test_hashes_are_equal_across_processes_and_hash_seeds():
    outs = set()
    for seed in ("0", "1", "random"):
        env = os.environ | {"PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    assert outs.pop() == b"".join(hash_blocks(list(range(100)), 16, cache_salt="s")).hex()


def test_only_full_blocks_are_hashed_and_chained():
    hs = hash_blocks(list(range(40)), 16)
    assert len(hs) == 2
    assert hs[0] == hash_block(None, list(range(16))) and hs[1] == hash_block(hs[0], list(range(16, 32)))
    assert hash_blocks(list(range(32)), 16, parent=hs[0], start_block=1) == hs[1:]


def test_equal_prefixes_share_hashes_and_differences_propagate():
    a = hash_blocks([1] * 48, 16)
    b = hash_blocks([1] * 16 + [2] + [1] * 31, 16)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_cache_salt_separates_whole_prefixes():
    plain, salted = hash_blocks([5] * 32, 16), hash_blocks([5] * 32, 16, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert hash_blocks([5] * 32, 16, cache_salt="tenant-a") == salted


def test_a_salted_prefix_is_private_down_its_whole_chain_and_only_it():
    """Bit 0 of the first byte marks a salted prefix's blocks (KV events never publish them), inherited by every
    later block, also when hashing resumes from a parent; an unsalted chain is never marked."""
    salted = hash_blocks(list(range(64)), 16, cache_salt="tenant-a")
    assert all(is_private(h) for h in salted)
    resumed = hash_blocks(list(range(80)), 16, parent=salted[-1], start_block=4)
    assert len(resumed) == 1 and is_private(resumed[0])
    plain = [h for n in range(1, 200) for h in hash_blocks([n] * 32, 16)]
    assert not any(is_private(h) for h in plain)  # 398 hashes: a random bit would have been set ~199 times


def test_encoding_is_pinned():
    # Peers (PD, disk tier) compare hashes made by other processes and versions: the encoding must not drift.
    pinned = "3c1f09bd58aab8343132d05828aad06208114aa332bea74b15eedbd8e3d23c0d"
    assert hash_block(None, [1, 2, 3], ("salt",)).hex() == pinned
    assert hash_block(ROOT_HASH, [1, 2, 3], ("salt",)) == hash_block(None, [1, 2, 3], ("salt",))
    # A private hash is the same digest with bit 0 of its first byte set.
    assert hash_block(None, [1, 2, 3], ("salt",), private=True).hex() == "3d" + pinned[2:]
