"""Stable content hashes of full KV blocks, chained so a hash names a whole prefix.

    block:    [ b0 ][ b1 ][ b2 ][ partial ]
    hash:  r -> h0 -> h1 -> h2              (h_i = H(h_{i-1}, tokens of b_i, extra_keys))

The chain starts at a root `r` named by the request's cache salt (none: all zeros), so the
blocks of prompts with different salts never share a hash, in memory or on disk.

blake2b over packed integers gives the same bytes in every process, so a hash can key a cache
that outlives one (e.g. on disk). Python's `hash()` is salted per process and cannot.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.media import PromptMedia

BlockHash = bytes

DIGEST_SIZE = 16
_ROOT = b"\x00" * DIGEST_SIZE


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    `extra_keys` (ints or strings, e.g. an adapter id) separate caches that share token ids.
    """
    h = hashlib.blake2b(parent or _ROOT, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        data = str(key).encode()
        h.update(struct.pack("<cI", b"s" if isinstance(key, str) else b"i", len(data)) + data)
    return h.digest()


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent of a salted chain's first block (None: unsalted). Its own personalization
    keeps it apart from every block hash."""
    if cache_salt is None:
        return None
    data = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=b"cache_salt").digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int,
    extra_keys: tuple = (), cache_salt: str | None = None, media: PromptMedia | None = None,
) -> None:
    """Append to `hashes` (in place) until it covers the first `num_blocks` full blocks.
    A block that holds an image's placeholder tokens also takes the image's content hash
    (`media`)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else salt_root(cache_salt)
        block = token_ids[i * block_size : (i + 1) * block_size]
        keys = extra_keys if media is None else (*extra_keys, *media.block_keys(i, block_size))
        hashes.append(hash_block(parent, block, keys))
