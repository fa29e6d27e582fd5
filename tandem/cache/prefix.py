"""Prefix caching for a hybrid model: KV blocks shared by content, and the index of GDN state snapshots.

A full block's key chains the keys before it with its tokens (`block_keys`), seeded by the model's fingerprint,
so a key names the whole prefix up to the block's end. The MTP layer's KV entry at position p was computed with
token p + 1, so when the engine drafts (k > 0) the key of block i also takes the token after it (position
16i + 16 at block size 16): a block whose next token differs in a new request does not match, and every MTP
entry of a matched block is the one the new request would compute.

`BlockPool` hands out KV blocks with reference counts. A block that a request has fully computed is registered
under its key (`register`); when its last user frees it, it stays cached, unused, until an allocation needs it,
least recently freed first (a request's blocks are freed tail first, so a prefix outlives its continuations).

A GDN state describes a whole prefix, so a cached chain is usable only up to a block that has a state snapshot
at its end. `SnapshotIndex` maps block keys to snapshot entries of a fixed pool (`CachePools.snapshots`),
evicted least recently used; a snapshot whose blocks were evicted is unreachable and goes in its turn.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.cache.allocator import OutOfCapacity


KEY_BYTES = 16  # 128-bit keys: a prompt crafted to collide with another's prefix (and read its cache) is infeasible


def chain_seed(fingerprint: str) -> int:
    """The key before a prompt's first block, from a string naming the model and cache layout."""
    return int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=KEY_BYTES).digest(), "little")


def _chain(prev: int, tokens: list[int]) -> int:
    # a cryptographic hash, not Python's hash(): tuples of ints hash predictably, so colliding prompts are easy
    h = hashlib.blake2b(prev.to_bytes(KEY_BYTES, "little"), digest_size=KEY_BYTES)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_keys(tail: list[int], block_size: int, with_next: bool, seed: int, keys: list[int]) -> list[int]:
    """Extends `keys` (the keys of a sequence's first len(keys) blocks) with the keys of the full blocks of `tail`,
    the sequence's tokens from the end of those blocks on; with `with_next`, a block's key also needs the token
    after it. Returns `keys`."""
    prev = keys[-1] if keys else seed
    i = 0
    while (i + 1) * block_size + with_next <= len(tail):
        prev = _chain(prev, tail[i * block_size : (i + 1) * block_size + with_next])
        keys.append(prev)
        i += 1
    return keys


class BlockPool:
    """KV block allocator with reference counts and a content index; index 0 is the null block. `num_used`
    counts blocks with a user; `num_free` also counts cached unused blocks, which an allocation evicts."""

    def __init__(self, capacity: int, name: str = "kv blocks"):
        if capacity < 2:
            raise ValueError(f"{name}: capacity must be at least 2 (index 0 is reserved), got {capacity}")
        self.name = name
        self.capacity = capacity - 1
        self._free = list(range(capacity - 1, 0, -1))
        self._refs: dict[int, int] = {}
        self._by_key: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, least recent first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._unused)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfCapacity(f"{self.name}: need {n}, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._unused.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
                self.num_evicted += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, ids: list[int]) -> None:
        """Drops one reference to each block, last block first."""
        for b in reversed(ids):
            refs = self._refs.get(b)
            if refs is None:
                raise ValueError(f"{self.name}: freeing {b}, which is not allocated")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._key_of:
                self._unused[b] = None
            else:
                self._free.append(b)

    def lookup(self, key: int) -> int | None:
        return self._by_key.get(key)

    def share(self, ids: list[int]) -> None:
        """One more reference to each of these cached blocks (unused ones leave the eviction order)."""
        for b in ids:
            if b in self._refs:
                self._refs[b] += 1
            else:
                del self._unused[b]
                self._refs[b] = 1

    def num_unused(self, ids: list[int]) -> int:
        """How many of these blocks nobody uses now (sharing them takes them from the free count)."""
        return sum(b not in self._refs for b in ids)

    def register(self, block: int, key: int) -> None:
        """A used block whose contents are final for the prefix `key` names; a second block of the same
        contents stays private."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key


class SnapshotIndex:
    """Which snapshot entry (1..capacity; 0 is never used) holds the GDN state at the end of the block whose key
    it is filed under; least recently used first out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(capacity, 0, -1))
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, key: int) -> int | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: int) -> int:
        """The entry to write `key`'s snapshot into (the least recently used one when all are taken)."""
        if self._free:
            entry = self._free.pop()
        else:
            entry = self._entries.popitem(last=False)[1]
            self.num_evicted += 1
        self._entries[key] = entry
        return entry


@dataclass
class Hit:
    """A prompt against the cache: the cached blocks it starts from (a snapshot at their end: `snapshot`), and
    how many of its blocks are cached in a row (`chain`, >= len(blocks): its branch point from the cache)."""

    blocks: list[int] = field(default_factory=list)
    snapshot: int = 0
    chain: int = 0


class PrefixCache:
    """The engine's side of prefix caching: matching a prompt, planning its snapshots, registering the blocks and
    snapshots a step completed. `queries` and `hits` count prompt tokens looked up and found (vLLM's
    prefix-cache counters)."""

    def __init__(self, pools, block_size: int, with_next: bool, seed: int, interval: int, snapshots: int):
        self.pools, self.blocks = pools, pools.blocks
        self.block_size, self.with_next, self.seed, self.interval = block_size, with_next, seed, interval
        self.snapshots = SnapshotIndex(snapshots)
        self.queries = self.hits = 0

    def _keys(self, seq) -> list[int]:
        # only the tokens past the blocks keyed so far: this runs on the decode path, every block_size tokens
        tail = seq.tokens(len(seq.block_keys) * self.block_size, seq.num_tokens)
        return block_keys(tail, self.block_size, self.with_next, self.seed, seq.block_keys)

    def match(self, seq) -> Hit:
        """The longest cached chain of the tokens `seq` prefills that ends in a snapshot, at most all but the
        last token. Requests that want prompt logprobs compute every row (no hit), as in vLLM."""
        keys = self._keys(seq)[: (seq.prefill_len - 1) // self.block_size]
        chain = []
        for key in keys:
            b = self.blocks.lookup(key)
            if b is None:
                break
            chain.append(b)
        if seq.params.prompt_logprobs is None:
            for m in range(len(chain), 0, -1):
                if keys[m - 1] in self.snapshots:
                    return Hit(chain[:m], self.snapshots.get(keys[m - 1]), len(chain))
        return Hit(chain=len(chain))

    def plan(self, seq, hit: Hit) -> list[int]:
        """Where the prompt chunks of `seq` starting from `hit` end for a snapshot: the prompt's last block
        boundary before its last token, the branch point from the cached chain, and every `interval` tokens."""
        bs, start = self.block_size, len(hit.blocks) * self.block_size
        end = (seq.prefill_len - 1) // bs * bs
        points = set(range(self.interval, end, self.interval)) | {end, hit.chain * bs}
        return sorted(p for p in points if p > start)

    def start(self, seq, hit: Hit, points: list[int]) -> None:
        """`seq` now holds `hit.blocks` (shared) and a fresh slot: it starts from the snapshot."""
        start = len(hit.blocks) * self.block_size
        if hit.blocks:
            self.pools.load_snapshot(hit.snapshot, seq.state_slots[0])
            seq.num_computed, seq.num_registered = start, len(hit.blocks)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = start
        seq.snapshot_points = points
        self.queries += seq.prefill_len
        self.hits += start

    def next_point(self, seq) -> int:
        """Where `seq`'s current prompt chunk must end at the latest."""
        return seq.snapshot_points[0] if seq.snapshot_points else seq.prefill_len

    def after_step(self, seq) -> None:
        """After a step of a running `seq`: its blocks now fully computed (MTP entries included) join the index,
        and when its prompt chunk ended at a snapshot point, its slot's state is saved there."""
        done = seq.num_computed // self.block_size
        if done > seq.num_registered:
            keys = self._keys(seq)
            for i in range(seq.num_registered, min(done, len(keys))):
                self.blocks.register(seq.block_ids[i], keys[i])
            seq.num_registered = min(done, len(keys))
        while seq.snapshot_points and seq.num_computed >= seq.snapshot_points[0]:
            point = seq.snapshot_points.pop(0)
            key = seq.block_keys[point // self.block_size - 1]
            if point == seq.num_computed and key not in self.snapshots and self.snapshots.capacity:
                self.pools.save_snapshot(seq.state_slots[0], self.snapshots.put(key))
