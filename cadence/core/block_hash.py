"""The prefix-cache key of a full KV block, and of a request's blocks in a row.

A block's key is a 64-bit digest of the msgpack triple (parent key, token ids, extra keys): it
chains the parent's key, so a block equals another only if their whole prefixes are equal. The
digest is stable across processes and Python versions (unlike ``hash()`` of strings), so a KV-aware
router in another process computes the same keys as the engines. Two digests, as vLLM's
``--prefix-caching-hash-algo`` offers (docs/architecture.md, "KV cache"):

- ``sha256`` (the default): collisions cannot be crafted, so one tenant's prompt cannot pose as
  another's cached prefix;
- ``xxhash`` (xxh3, 64 bits): about 3x faster a block, not collision-resistant against a crafted
  prompt. It suits a trusted deployment and the simulator, whose figures do not depend on the keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import xxhash

from cadence.config import HASH_ALGOS

# One encoder for the process: hashing runs on the hot path.
_encode = msgspec.msgpack.Encoder().encode


def _sha256_key(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


# Each algorithm's digest of the encoded triple, as a 64-bit int (the choices: config.HASH_ALGOS).
_DIGESTS: dict[str, Callable[[bytes], int]] = {"sha256": _sha256_key, "xxhash": xxhash.xxh3_64_intdigest}
assert tuple(_DIGESTS) == HASH_ALGOS


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = (),
               algo: str = "sha256") -> int:
    """The 64-bit prefix-cache key of one full block, chained from ``parent_hash`` (``None`` for a
    request's first block). A list and a tuple of the same ids hash the same (msgpack encodes both
    as an array)."""
    return _DIGESTS[algo](_encode((parent_hash, token_ids, extra_keys)))


def salt_keys(block_index: int, cache_salt: str | None) -> tuple[Any, ...]:
    """The extra keys of a request's block ``block_index``: its cache salt (a LoRA adapter's) in the
    first block only, whose hash then carries it down the chain to every later block."""
    return (cache_salt,) if block_index == 0 and cache_salt else ()


def block_hashes(token_ids: list[int] | tuple[int, ...], block_size: int, num_blocks: int,
                 cache_salt: str | None = None, *, start: int = 0, parent: int | None = None,
                 algo: str = "sha256") -> Iterator[int]:
    """The prefix-cache keys of full blocks ``start`` to ``num_blocks`` (exclusive) of ``token_ids``, in
    order and lazily (a lookup may stop at the first miss), chained from ``parent`` (block
    ``start - 1``'s key; None from the first block): :func:`hash_block`'s keys, without its call a
    block (the simulator hashes every block of a million requests)."""
    digest = _DIGESTS[algo]
    for i in range(start, num_blocks):
        parent = digest(_encode((parent, token_ids[i * block_size:(i + 1) * block_size], salt_keys(i, cache_salt))))
        yield parent


def prompt_block_hashes(prompt_token_ids: list[int] | tuple[int, ...], block_size: int,
                        cache_salt: str | None = None, algo: str = "sha256") -> Iterator[int]:
    """The keys of a prompt's blocks that a prefix-cache lookup may hit: every full block but one
    that ends the prompt (its last token is always computed, to sample from)."""
    return block_hashes(prompt_token_ids, block_size, (len(prompt_token_ids) - 1) // block_size, cache_salt,
                        algo=algo)
