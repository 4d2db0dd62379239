import os
import subprocess
import sys

import pytest

from hybridkv.events.wire import external_hash
from hybridkv.kv.hash_algos import HASH_ALGOS
from hybridkv.kv.hashing import ROOT_HASH, BlockHasher, hash_block, hash_blocks, is_private

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


# vLLM v0.17.0's ids for two chained 16-token blocks (tokens 101, 202, ..., 3232), as KV events publish them (the
# digest's low 8 bytes, big-endian), recorded by a third party from vLLM's own code: with the root PYTHONHASHSEED=0
# gives, and with a zero parent.
VLLM_IDS = {
    ("sha256_cbor", "0"): (7876691182959014722, 8769878286166771163),
    ("xxhash_cbor", "0"): (11066090714971094433, 8162514883595054550),
    ("sha256_cbor", None): (14515664427994421226, 10510627572844902094),
    ("xxhash_cbor", None): (17857287826602605865, 16694457297254314181),
}
VLLM_SEED0_ROOTS = {
    "sha256_cbor": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
    "xxhash_cbor": "1ebe36576dcb573f26b99533a20aaeca",
}


def test_vllm_algorithms_give_vllms_ids():
    tokens = [101 * i for i in range(1, 33)]
    for (algo, seed), ids in VLLM_IDS.items():
        hasher = BlockHasher.create(algo, seed)
        if seed is None:  # the zero parent the recorded vectors start from
            hasher = BlockHasher(hasher.algo, bytes(hasher.algo.digest_size))
        else:
            assert hasher.root.hex() == VLLM_SEED0_ROOTS[algo]
        hashes = hasher.hash_blocks(tokens, 16)
        assert tuple(external_hash(h) for h in hashes) == ids, algo
        assert all(len(h) == 32 for h in hashes)


def test_pickle_algorithms_are_pinned_and_all_differ():
    # sha256 and xxhash serialise with pickle (vLLM's default algorithm is sha256): pinned against drift.
    hashers = {a: BlockHasher.create(a, "0") for a in HASH_ALGOS}
    ids = {a: [external_hash(h) for h in hs.hash_blocks(list(range(32)), 16)] for a, hs in hashers.items()}
    assert ids["sha256"] == [7982712666671721126, 12675106281628537544]
    assert ids["xxhash"] == [12446601617588617037, 15415768829451575322]
    assert len({tuple(v) for v in ids.values()}) == len(HASH_ALGOS)


def test_vllm_root_rule_seeded_or_random_per_hasher():
    assert BlockHasher.create("sha256", "7").root == BlockHasher.create("sha256", "7").root
    assert BlockHasher.create("sha256", "7").root != BlockHasher.create("sha256", "8").root
    assert BlockHasher.create("sha256", None).root != BlockHasher.create("sha256", None).root  # random, as vLLM
    assert BlockHasher.create("hybridkv", "7").root == BlockHasher.create("hybridkv", None).root == ROOT_HASH


def test_salt_and_privacy_with_a_vllm_algorithm():
    hasher = BlockHasher.create("xxhash_cbor", "0")
    plain, salted = hasher.hash_blocks([5] * 48, 16), hasher.hash_blocks([5] * 48, 16, cache_salt="t")
    assert not any(map(is_private, plain)) and all(map(is_private, salted))
    assert all(a != b for a, b in zip(plain, salted))
    # The private bit sits in the padding of a 16-byte digest: the chain is vLLM's with the salt as extra key.
    assert salted[0][16:] == hasher.algo.block(hasher.root, [5] * 16, ("t",))
    assert salted[1][16:] == hasher.algo.block(salted[0][16:], [5] * 16, None)
    first = hasher.links([5] * 16, 16, cache_salt="t")
    assert [x.block_hash for x in hasher.links([5] * 48, 16, after=first[0], cache_salt="t", start_block=1)] == salted[
        1:
    ]


def test_a_vllm_chain_continues_from_the_digest_not_the_flagged_id():
    # Find a block whose SHA-256 digest has bit 0 of byte 0 set: its id differs from the digest there, and the next
    # block must still chain from the digest (as vLLM's does), also when resumed from the link.
    hasher = BlockHasher.create("sha256", "0")
    n = next(n for n in range(100) if hasher.links([n] * 16, 16)[0].digest[0] & 1)
    tokens = [n] * 16 + list(range(16))
    first, second = hasher.links(tokens, 16)
    assert first.block_hash != first.digest and not is_private(first.block_hash)
    assert second.digest == hasher.algo.block(first.digest, list(range(16)), None)
    assert hasher.links(tokens, 16, after=first, start_block=1) == [second]


def test_an_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="sha256_cbor"):
        BlockHasher.create("md5")
