"""One engine's own KV blocks, as its KV-cache events describe them, mapped to raykv page keys.

vLLM publishes what its prefix cache holds as events (vllm/distributed/kv_events.py):
`BlockStored` (block hashes, the parent of the first, the blocks' token ids), `BlockRemoved`
(hashes) and `AllBlocksCleared`. Its block hashes are its own (salted per process), so they
cannot be compared with raykv's keys; the token ids can. Each stored block is kept as a node
of a tree, hash -> (parent hash, token ids, depth in tokens), and the raykv page keys that
the block completes are computed from the tokens of the chain above it:

    root ── b0 [t0..t15] ── b1 [t16..t31] ── b2 ... ── b15 [t240..t255]  -> page key k0
                                                        b16 ... b31      -> page key k1

A raykv page of `page_tokens` tokens is held by the engine when every block covering it is
stored, from the root on: the engine's prefix cache serves a prefix only from its first block.
Any block size works: with blocks that do not divide pages, a block that crosses a page
boundary completes the page it ends in (and a page may be completed by the block after the
one holding its start); a page is held only when all the blocks up to its last token are.

Only plain blocks are keyed: a block with a LoRA adapter, extra hash keys (vLLM's cache_salt,
multimodal inputs), another medium than the GPU's or another KV-cache group than the first is
kept in the tree (its children must find their parent) but keys no page, nor do blocks under
it, nor blocks whose parent is unknown (their chain to the root is not). A hash stored twice
(vLLM re-reports reused blocks) is one block; one removal removes it (an engine holding two
copies of a block is then under-reported, never over-reported).

Pure: no Ray, no ZMQ; events arrive as the dataclasses below (cluster/serving/engine_events.py
decodes vLLM's wire format into them).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from cluster.core.keys import KeyChain, PageKey

BlockHash = Hashable  # vLLM's ExternalBlockHash: bytes or int


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks stored, each the child of the one before (the first's parent: `parent_hash`,
    None at the root); `token_ids` holds `block_size` tokens per block. `keyable`: a plain
    block of the engine's GPU cache (see the module docstring)."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    keyable: bool = True


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block is gone (vLLM's AllBlocksCleared: a prefix-cache reset)."""


EngineEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class _Block:
    parent: BlockHash | None
    tokens: tuple[int, ...]
    depth_tokens: int  # tokens from the root to this block's end
    keyed: bool  # on a plain chain from the root: its pages have keys
    last_key: PageKey  # the key of the last page ending at or before depth_tokens (or root)
    keys: tuple[PageKey, ...]  # the pages this block completes


class EngineBlocks:
    """The blocks one engine holds, and the raykv pages they make whole (module docstring)."""

    def __init__(self, chain: KeyChain):
        self.chain = chain
        self._blocks: dict[BlockHash, _Block] = {}
        self._by_key: dict[PageKey, BlockHash] = {}  # page key -> the block completing it

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def apply(self, event: EngineEvent) -> None:
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            for block_hash in event.block_hashes:
                self._remove(block_hash)
        elif isinstance(event, Cleared):
            self.clear()
        else:
            raise TypeError(f"not an engine event: {event!r}")

    def clear(self) -> None:
        self._blocks.clear()
        self._by_key.clear()

    def held_pages(self, keys: Sequence[PageKey]) -> int:
        """How many leading pages of `keys` (a prompt's page keys, in order) the engine holds
        whole: each page's blocks, and every block before them, stored."""
        num_held, boundary = 0, None  # boundary: the block completing the page before
        for key in keys:
            block_hash = self._by_key.get(key)
            if block_hash is None or not self._chain_to(block_hash, boundary):
                break
            num_held, boundary = num_held + 1, block_hash
        return num_held

    def _chain_to(self, block_hash: BlockHash, stop: BlockHash | None) -> bool:
        """Whether every block from `block_hash` up to (not including) `stop` is stored.
        Bounded by the page's tokens: a chain longer than that is not this page's."""
        budget = self.chain.page_tokens + 1
        while block_hash != stop:
            block = self._blocks.get(block_hash)
            if block is None or budget <= 0:
                return False
            budget -= len(block.tokens)
            block_hash = block.parent
        return True

    def _store(self, event: Stored) -> None:
        size = event.block_size
        if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
            raise ValueError(f"{len(event.token_ids)} token ids for "
                             f"{len(event.block_hashes)} blocks of {size}")
        parent = event.parent_hash
        for index, block_hash in enumerate(event.block_hashes):
            if block_hash not in self._blocks:  # a re-report of a stored block changes nothing
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                self._blocks[block_hash] = self._block(parent, tokens, event.keyable)
                for key in self._blocks[block_hash].keys:
                    self._by_key[key] = block_hash
            parent = block_hash

    def _block(self, parent: BlockHash | None, tokens: tuple[int, ...],
               keyable: bool) -> _Block:
        above = self._blocks.get(parent) if parent is not None else None
        if parent is not None and above is None:  # an orphan: no chain to the root
            return _Block(parent, tokens, 0, False, self.chain.root, ())
        start = above.depth_tokens if above else 0
        keyed = keyable and (above.keyed if above else True)
        last_key = above.last_key if above else self.chain.root
        end = start + len(tokens)
        page_tokens = self.chain.page_tokens
        first_page, end_page = start // page_tokens, end // page_tokens
        if not keyed or end_page == first_page:
            return _Block(parent, tokens, end, keyed, last_key, ())
        # Pages first_page .. end_page - 1 end in this block: key them from the tokens since
        # first_page's start (the part before `start` is the chain above's).
        before = self._tokens_above(parent, start - first_page * page_tokens)
        if before is None:  # a block above is gone: the chain is not whole
            return _Block(parent, tokens, end, False, last_key, ())
        page_span = (before + tokens)[: (end_page - first_page) * page_tokens]
        keys = tuple(KeyChain(page_tokens, last_key).keys(list(page_span)))
        return _Block(parent, tokens, end, keyed, keys[-1], keys)

    def _tokens_above(self, block_hash: BlockHash | None,
                      num_tokens: int) -> tuple[int, ...] | None:
        """The last `num_tokens` tokens of the chain ending at `block_hash`; None when a
        block of theirs is not stored."""
        parts: list[tuple[int, ...]] = []
        collected = 0
        while collected < num_tokens:
            block = self._blocks.get(block_hash) if block_hash is not None else None
            if block is None:
                return None
            parts.append(block.tokens)
            collected += len(block.tokens)
            block_hash = block.parent
        joined = tuple(token for part in reversed(parts) for token in part)
        return joined[len(joined) - num_tokens :]

    def _remove(self, block_hash: BlockHash) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is None:
            return
        for key in block.keys:
            if self._by_key.get(key) == block_hash:
                del self._by_key[key]
