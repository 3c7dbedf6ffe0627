"""The embedded engine's prefix cache: KV states of token prefixes seen before, reused so a
request that shares a long prefix with an earlier one prefills only what is new.

Why: agents send the same 3-12k-token system prompt and tools on every request, and each turn
is the previous request plus the reply plus one message, so nearly all of a prompt was
prefilled before. Same idea as SGLang's radix cache (a tree over token ids whose nodes hold
KV, evicted leaf-first by last use), laid out the way a CPU engine wants it:

- Pages. Token ids are cut into blocks of `block` tokens (64). A block is named by a chained
  key, `hash((parent key, its tokens))`, whose root is the request's namespace, so a block's
  key stands for every token before it too: the blocks form a trie, shared prefixes share
  blocks (one copy of a system prompt serves every conversation that starts with it). Each
  block stores its tokens and parent, checked on every lookup: a hash collision is a miss,
  never a wrong answer. Only whole blocks are cached; the tail of a prompt is prefilled.
- KV. A block holds one contiguous tensor `[layers, 2, kv_heads, block, head_dim]`, copied
  out of the forward's cache, so nothing it stores aliases a live batch. A hit concatenates
  the blocks into per-layer (K, V) that the prefill extends, as a decode step extends its own.
- Namespace. Keys start from the weights' serial and the request's namespace (its LoRA
  adapter's uid, or None for the base model): KV made by one set of weights, or with one
  adapter, never serves another. The scheduler bumps the serial on every weight swap (a new
  serial even when the version label stays) and `retire` drops the older weights' blocks.
- Memory. `budget_bytes` bounds the stored KV; past it the least recently used blocks go.
  Every use touches a chain from its deepest block up to its root, so a parent is always more
  recent than its children and eviction takes leaves first: a surviving block's ancestors
  survive too.

Exactness: a cached block's K and V are what a forward over the same tokens in the same
position computes, so a hit changes the result only by float rounding of a shorter matmul
(tests/engine/test_engine_prefix_cache.py: same greedy tokens, logprobs to 1e-4).

Used only by the scheduler thread (clawrl/engine/scheduler.py), which owns it: no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 64
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [1, kv_heads, T, head_dim]


@dataclass(eq=False)
class _Block:
    parent: int
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, block, head_dim]


class PrefixCache:
    """LRU store of KV blocks keyed by chained hashes of token ids (see the module doc)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> None:
        if block < 1:
            raise ValueError("block must be at least 1 token")
        self.budget_bytes = max(int(budget_bytes), 0)
        self.block = block
        self.nbytes = 0
        self.serial = 0  # weights the stored blocks were made with
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # oldest first

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def retire(self, serial: int) -> None:
        """New weights are serving: forget every block the old ones made."""
        if serial != self.serial:
            self.clear()
            self.serial = serial

    def lookup(self, namespace: Hashable, tokens: Sequence[int], limit: int) -> tuple[int, KV]:
        """The longest cached prefix of `tokens` of at most `limit` tokens: (its length, its
        KV per layer). (0, []) on a miss."""
        chain = self._chain(namespace, tokens, limit // self.block if self.enabled else 0)
        found: list[int] = []
        for key, parent, block_tokens in chain:
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != block_tokens:
                break
            found.append(key)
        if not found:
            return 0, []
        self._touch(found)
        kv = torch.cat([self._blocks[k].kv for k in found], dim=3)
        return len(found) * self.block, [(kv[i, 0][None], kv[i, 1][None])
                                         for i in range(kv.shape[0])]

    def insert(self, namespace: Hashable, tokens: Sequence[int],
               kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Remember the KV of `tokens`' whole blocks. `kv` is per layer (K, V), each
        `[kv_heads, T, head_dim]` with position t holding token t (T >= the blocks' tokens);
        only blocks not cached yet are copied."""
        if not self.enabled or not kv:
            return
        per_block = self._block_bytes(kv)
        n = min(len(tokens) // self.block, self.budget_bytes // per_block, kv[0][0].shape[1]
                // self.block)
        chain: list[int] = []
        for key, parent, block_tokens in self._chain(namespace, tokens, n):
            block = self._blocks.get(key)
            if block is not None and (block.parent != parent or block.tokens != block_tokens):
                break  # a hash collision: keep the block that is there, cache no deeper
            if block is None:
                start = len(chain) * self.block
                data = torch.stack([torch.stack([k[:, start:start + self.block],
                                                 v[:, start:start + self.block]])
                                    for k, v in kv])
                self._blocks[key] = _Block(parent, block_tokens, data)
                self.nbytes += per_block
            chain.append(key)
        self._touch(chain)
        while self.nbytes > self.budget_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= old.kv.numel() * old.kv.element_size()

    def _chain(self, namespace: Hashable, tokens: Sequence[int],
               n_blocks: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(key, parent key, tokens) of the first `n_blocks` blocks of `tokens`."""
        parent = hash(("prefix-cache", self.serial, namespace))
        out = []
        for i in range(n_blocks):
            block_tokens = tuple(tokens[i * self.block:(i + 1) * self.block])
            key = hash((parent, block_tokens))
            out.append((key, parent, block_tokens))
            parent = key
        return out

    def _touch(self, chain: list[int]) -> None:
        """Most recent use: deepest block first, root last, so parents outlive children."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def _block_bytes(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        k = kv[0][0]
        return 2 * len(kv) * k.shape[0] * self.block * k.shape[2] * k.element_size()
