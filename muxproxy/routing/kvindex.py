"""Which prompt blocks each engine holds in its KV cache, learnt from the engine's own events,
and how much of a request's prompt each engine could reuse.

Obeys the routing rules: pure code, standard library and attrs only, no clock, no I/O. The
events come from the engine (vLLM's ``--kv-events-config``, decoded by ``kvwire.py``); the
driver feeds them in, and asks for scores when it places a request.

The events (vLLM ``vllm/distributed/kv_events.py``):

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``:
  full blocks a request has filled, in order; the first one's parent is ``parent_block_hash``
  (None: the prompt starts there), and ``token_ids`` are the blocks' tokens, ``block_size``
  each.
* ``BlockRemoved(block_hashes, medium)``: blocks the engine evicted.
* ``AllBlocksCleared()``: the engine dropped its whole cache (a reset, a restart).

**Blocks are matched by their tokens, not by the engine's hashes.** vLLM names a block by a
hash of its parent's hash, its tokens and extra keys (``kv_cache_utils.hash_block_tokens``),
seeded with ``NONE_HASH``, which is random per process unless ``PYTHONHASHSEED`` is set, with a
hash function chosen by ``--prefix-caching-hash-algo``: the proxy cannot compute it. The
events carry the tokens, though, so the index keeps its own name for each block, a chained
digest of the tokens (:func:`block_keys`): ``key[i] = blake2b(key[i - 1] + tokens of block
i)``, the chain starting from a root that names the LoRA adapter (its blocks are apart, as in
vLLM, where the adapter is one of the extra keys). The engine's hashes are kept only to follow
a ``BlockStored``'s parent and to apply a ``BlockRemoved``. A request's tokens cut the same way
give the same keys, so a request's cached prefix is its leading keys present in the index.

**Only the device cache counts.** Events whose ``medium`` names another tier than the GPU
(vLLM's offloading connectors publish ``"CPU"``) are ignored: those blocks must be loaded back
first, and mixing tiers under one hash would let a removal from one erase the other.

**Bounded memory.** An engine's index holds at most ``max_blocks`` blocks; storing one more
forgets the block stored (or stored again) longest ago. The engine evicts its least recently
used blocks and says so, so the cap only matters when removals were missed (a dropped
connection, a sequence gap) or the cap is below the engine's cache: then the oldest knowledge
goes first. A stored block whose parent the index does not know (its parent was forgotten,
or stored before the subscription began) cannot be placed in a chain and is skipped, counted
in ``orphans``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import attrs

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EngineBlocks",
    "KVEvent",
    "best_cached",
    "block_keys",
]

BlockHash = bytes | int
"""An engine's name for a block (vLLM's ``ExternalBlockHash``: bytes, or an int before 0.11)."""

DEVICE_MEDIA = frozenset({None, "GPU"})
"""``medium`` values of the engine's device cache (None: an engine that does not say)."""

_DIGEST_BYTES = 16
"""128-bit block keys: a collision among a fleet's millions of blocks is beyond reach."""


@attrs.frozen(kw_only=True)
class BlockStored:
    """Full blocks an engine filled, in prompt order (see the module header)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    """The block before the first one; None: the first block starts a prompt."""
    token_ids: tuple[int, ...]
    """The blocks' tokens, ``block_size`` per block."""
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks an engine evicted."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """The engine dropped every block."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _root(lora_id: int | None) -> bytes:
    name = b"muxproxy kv root" if lora_id is None else b"muxproxy kv lora %d" % lora_id
    return hashlib.blake2b(name, digest_size=_DIGEST_BYTES).digest()


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    # 'q': every token id an engine uses fits 64 bits; the bytes never leave this process.
    return hashlib.blake2b(
        parent + array("q", tokens).tobytes(), digest_size=_DIGEST_BYTES
    ).digest()


def block_keys(
    token_ids: Sequence[int], block_size: int, lora_id: int | None = None
) -> list[bytes]:
    """The chained keys of the full blocks of ``token_ids`` (a partial last block has none)."""
    keys: list[bytes] = []
    parent = _root(lora_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@attrs.define
class EngineBlocks:
    """One engine's cached blocks, as its events tell them (see the module header)."""

    max_blocks: int = attrs.field(validator=attrs.validators.ge(1))

    block_size: int | None = attrs.field(default=None, init=False)
    """The engine's block size, from its last ``BlockStored`` (None: none seen yet)."""
    orphans: int = attrs.field(default=0, init=False)
    """Stored blocks skipped because their parent was unknown."""
    forgotten: int = attrs.field(default=0, init=False)
    """Blocks dropped to keep within ``max_blocks``."""
    malformed: int = attrs.field(default=0, init=False)
    """``BlockStored`` events whose tokens do not fill their blocks exactly (ignored)."""

    _key_of: dict[BlockHash, bytes] = attrs.field(factory=dict, init=False, repr=False)
    """The engine's hash -> our key."""
    _blocks: OrderedDict[bytes, BlockHash] = attrs.field(
        factory=OrderedDict, init=False, repr=False
    )
    """Our key -> the engine's hash, the block stored longest ago first."""

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, event: KVEvent) -> None:
        """Take one event into the index."""
        match event:
            case BlockStored():
                self._store(event)
            case BlockRemoved():
                if event.medium in DEVICE_MEDIA:
                    for block_hash in event.block_hashes:
                        self._remove(block_hash)
            case AllBlocksCleared():
                self._key_of.clear()
                self._blocks.clear()

    def _store(self, event: BlockStored) -> None:
        if event.medium not in DEVICE_MEDIA:
            return
        size = event.block_size
        if size < 1 or len(event.token_ids) != size * len(event.block_hashes):
            self.malformed += 1
            return
        self.block_size = size
        if event.parent_block_hash is None:
            parent = _root(event.lora_id)
        else:
            known = self._key_of.get(event.parent_block_hash)
            if known is None:
                self.orphans += len(event.block_hashes)
                return
            parent = known
        for at, block_hash in enumerate(event.block_hashes):
            parent = _chain(parent, event.token_ids[at * size : (at + 1) * size])
            self._remember(block_hash, parent)

    def _remember(self, block_hash: BlockHash, key: bytes) -> None:
        self._remove(block_hash)
        previous = self._blocks.pop(key, None)
        if previous is not None:  # the same tokens stored again under another hash
            self._key_of.pop(previous, None)
        self._blocks[key] = block_hash
        self._key_of[block_hash] = key
        while len(self._blocks) > self.max_blocks:
            _, oldest = self._blocks.popitem(last=False)
            del self._key_of[oldest]
            self.forgotten += 1

    def _remove(self, block_hash: BlockHash) -> None:
        key = self._key_of.pop(block_hash, None)
        if key is not None:
            del self._blocks[key]

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's chained block keys), from the first, are cached."""
        count = 0
        for key in keys:
            if key not in self._blocks:
                break
            count += 1
        return count

    def cached_tokens(self, token_ids: Sequence[int], lora_id: int | None = None) -> int:
        """Leading tokens of ``token_ids`` this engine holds in whole cached blocks."""
        size = self.block_size
        if size is None:
            return 0
        return self.cached_blocks(block_keys(token_ids, size, lora_id)) * size


def best_cached(
    order: Sequence[int],
    cached_tokens: Iterable[tuple[int, int]],
    within: Callable[[int], bool] | None = None,
) -> list[int]:
    """``order`` with the server holding the longest cached prefix moved to the front.

    ``cached_tokens`` gives ``(server, tokens)`` pairs (servers missing from it hold none);
    ``within`` (``load.within_bounds``'s predicate, or None: no bound) says which servers may
    take one more stream: a server outside the load bounds is never moved forward, however
    much it holds. A tie keeps ``order``'s first; with nothing cached anywhere (or no server
    within the bounds holding any) ``order`` is returned unchanged.
    """
    held = dict(cached_tokens)
    best_at, best = -1, 0
    for at, index in enumerate(order):
        tokens = held.get(index, 0)
        if tokens > best and (within is None or within(index)):
            best_at, best = at, tokens
    result = list(order)
    if best_at > 0:
        result.insert(0, result.pop(best_at))
    return result
