"""The prefix-cache key of a block (``cadence.core.block_hash``): its digests, its chain, and the keys
of a request's blocks in a row."""

from __future__ import annotations

import hashlib

import pytest
import xxhash

from cadence.config import HASH_ALGOS, CacheConfig, ConfigError, check_hash_algo
from cadence.core.block_hash import block_hashes, hash_block, prompt_block_hashes

# msgpack of (None, [1, 2, 3, 4], ()): fixarray(3), nil, fixarray(4) 1 2 3 4, fixarray(0).
FIRST_BLOCK = bytes.fromhex("93c0940102030490")


def test_sha256_is_the_default_key_its_first_8_bytes_of_the_msgpack_triple_and_stable_across_runs() -> None:
    expected = int.from_bytes(hashlib.sha256(FIRST_BLOCK).digest()[:8], "little")
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, [1, 2, 3, 4], algo="sha256") == expected
    assert expected == 6729288735558005244
    # A KV-aware router in another process must compute the same chained keys.
    assert hash_block(6729288735558005244, [5, 6, 7, 8]) == 16777306416764416897
    assert hash_block(None, [1, 2, 3, 4], ("lora", 1)) == 2635171801990979476


def test_xxhash_is_xxh3_64_of_the_same_triple_and_stable_across_runs() -> None:
    assert hash_block(None, [1, 2, 3, 4], algo="xxhash") == xxhash.xxh3_64_intdigest(FIRST_BLOCK)
    assert hash_block(None, [1, 2, 3, 4], algo="xxhash") == 8754283201081605830
    assert hash_block(8754283201081605830, [5, 6, 7, 8], algo="xxhash") == 11987529134511890644
    assert hash_block(None, [1, 2, 3, 4], ("lora", 1), algo="xxhash") == 17531031764925471388


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_a_key_chains_the_parent_and_extra_keys_and_order_change_it(algo: str) -> None:
    def key(parent: int | None, ids: list[int] | tuple[int, ...], extra: tuple = ()) -> int:
        return hash_block(parent, ids, extra, algo)

    first = key(None, [1, 2, 3, 4])
    assert key(first, [5, 6, 7, 8]) != key(None, [5, 6, 7, 8])
    assert key(first, [5, 6, 7, 8]) != key(key(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert key(first, [5, 6, 7, 8]) == key(key(None, (1, 2, 3, 4)), (5, 6, 7, 8))  # a list or a tuple alike
    assert key(None, [1, 2, 3, 4], ("lora", 1)) not in (first, key(None, [1, 2, 3, 4], ("lora", 2)))
    assert key(None, [1, 2, 4, 3]) != first  # order matters
    assert 0 <= key(None, list(range(16)), ("x",)) < 2**64


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_hashes_chain_hash_block_salt_the_first_block_only_and_resume_from_a_parent(algo: str) -> None:
    ids = list(range(7, 30))  # 5 full blocks of 4, and 3 ids more
    chained: list[int] = []
    for i in range(5):
        chained.append(hash_block(chained[-1] if chained else None, ids[4 * i:4 * i + 4], ("s",) if i == 0 else (),
                                  algo))
    assert list(block_hashes(ids, 4, 5, "s", algo=algo)) == chained
    assert list(block_hashes(ids, 4, 5, "s", start=2, parent=chained[1], algo=algo)) == chained[2:]
    assert list(prompt_block_hashes(ids, 4, "s", algo)) == chained  # the 6th block is not full
    assert list(prompt_block_hashes(ids[:20], 4, "s", algo)) == chained[:4]  # the last token is always computed
    assert next(block_hashes(ids, 4, 5, algo=algo)) == hash_block(None, ids[:4], (), algo)  # lazily


def test_an_unknown_algorithm_is_refused_with_the_choices() -> None:
    assert check_hash_algo("xxhash") == "xxhash"
    with pytest.raises(ConfigError, match="must be one of sha256, xxhash, got 'md5'"):
        check_hash_algo("md5")
    with pytest.raises(ConfigError, match="got 'md5'"):
        CacheConfig(prefix_caching_hash_algo="md5")
